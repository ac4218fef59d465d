"""A job file's ``[array]`` table: the tasks of a job array, as a parameter grid or a JSONL
file of per-task parameters, checked here before anything is uploaded (docs/jobs.md).

    [array]
    grid = { lr = [0.1, 0.01], seed = [1, 2, 3] }   # every combination (6 tasks) ...
    # tasks = "tasks.jsonl"                         # ... or one JSON object a line
    per_lease = 16                                  # most tasks one lease runs (optional)
    inputs = ["prompts-a.jsonl", "prompts-b.jsonl"] # files tasks name (optional)
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumarket import kinds
from gpumarket.kinds import arrays
from gpumarket.kinds.schema import NAME_RE
from gpumarket.proto.errors import JobFileError

TASKS_INPUT = "tasks.jsonl"
FIELDS = {"grid", "tasks", "per_lease", "inputs"}


@dataclass(frozen=True)
class ArrayFile:
    count: int
    data: bytes                       # the tasks input: one JSON object a line
    per_lease: int
    inputs: tuple[Path, ...]          # more files, uploaded under their own names


def load(table: Any, base: Path, file: str) -> ArrayFile:
    """The ``[array]`` table's tasks (JobFileError naming the file and the field)."""
    if not isinstance(table, dict):
        raise JobFileError(f"{file}: field 'array' must be a table")
    unknown = sorted(set(table) - FIELDS)
    if unknown:
        raise JobFileError(f"{file}: unknown field 'array.{unknown[0]}' (known:"
                           f" {', '.join(sorted(FIELDS))})")
    if ("grid" in table) == ("tasks" in table):
        raise JobFileError(f"{file}: [array] needs either 'grid' or 'tasks'")
    if "grid" in table:
        data = grid_tasks(table["grid"], file)
    else:
        if not isinstance(table["tasks"], str):
            raise JobFileError(f"{file}: field 'array.tasks' must be a file path")
        path = (base / table["tasks"]).expanduser()
        try:
            if path.stat().st_size > arrays.MAX_TASKS_BYTES:
                raise JobFileError(f"{file}: array.tasks = {table['tasks']!r}: more than"
                                   f" {arrays.MAX_TASKS_BYTES >> 20} MiB")
            data = path.read_bytes()
        except OSError as exc:
            raise JobFileError(f"{file}: array.tasks = {table['tasks']!r}: cannot read"
                               f" ({exc.strerror})") from exc
    count = sum(1 for line in data.split(b"\n") if line.strip())
    if not 1 <= count <= arrays.MAX_TASKS:
        raise JobFileError(f"{file}: [array] has {count:,} tasks; 1 to"
                           f" {arrays.MAX_TASKS:,} may run in one array")
    per_lease = table.get("per_lease", 0)
    if not isinstance(per_lease, int) or isinstance(per_lease, bool) or \
            not 0 <= per_lease <= arrays.MAX_PER_LEASE:
        raise JobFileError(f"{file}: field 'array.per_lease' must be between 0 and"
                           f" {arrays.MAX_PER_LEASE:,}")
    extra = table.get("inputs", [])
    if not isinstance(extra, list) or not all(isinstance(v, str) for v in extra):
        raise JobFileError(f"{file}: field 'array.inputs' must be a list of file paths")
    paths = []
    for value in extra:
        path = (base / value).expanduser()
        if not path.is_file():
            raise JobFileError(f"{file}: array.inputs: {value!r} is not a file")
        if not NAME_RE.match(path.name) or path.name == TASKS_INPUT:
            raise JobFileError(f"{file}: array.inputs: {path.name!r} cannot name an input")
        paths.append(path)
    return ArrayFile(count, data, per_lease, tuple(paths))


def grid_tasks(grid: Any, file: str) -> bytes:
    """Every combination of the grid's values (the last parameter varies fastest)."""
    if not isinstance(grid, dict) or not grid:
        raise JobFileError(f"{file}: field 'array.grid' must be a table of lists")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise JobFileError(f"{file}: field 'array.grid.{key}' must be a list of values")
    total = 1
    for values in grid.values():
        total *= len(values)
        if total > arrays.MAX_TASKS:
            raise JobFileError(f"{file}: [array] grid makes more than {arrays.MAX_TASKS:,}"
                               " tasks")
    keys = list(grid)
    return b"".join(json.dumps(dict(zip(keys, combo)), separators=(",", ":")).encode() + b"\n"
                    for combo in itertools.product(*grid.values()))


def check(kind: kinds.Kind, base: dict[str, Any], array: ArrayFile, inputs: set[str],
          file: str) -> None:
    """Every task runs (JobFileError naming the first that does not)."""
    try:
        arrays.check_tasks(kind, base, array.data, array.count, inputs)
    except kinds.ParamError as exc:
        raise JobFileError(f"{file}: [array] {exc}") from exc
