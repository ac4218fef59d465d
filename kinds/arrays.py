"""Job arrays: one signed spec, many tasks. Task i runs the spec's kind with the parameters
of line i of the spec's tasks input (one JSON object a line) over the spec's own; the
client, the broker and the provider read a task's parameters with the same code, here.
No grpc here."""

from __future__ import annotations

import json
import math
from typing import Any

from gpumarket.kinds.base import Kind
from gpumarket.kinds.schema import TYPE_WORDS, ParamError
from gpumarket.proto.v1 import types_pb2 as pb

MAX_TASKS = 100_000
MAX_TASKS_BYTES = 32 << 20       # the tasks input
MAX_LINE_BYTES = 64 << 10        # one task's parameters
MAX_PER_LEASE = 1_000
TASK_OUTPUTS = 1_000             # files a task may leave (its own receipt names them)
INLINE_OUTPUT_BYTES = 64 << 10   # a task output this small may travel in its task results
INLINE_UPDATE_BYTES = 1 << 20    # update (not uploaded); one update carries at most this ...
INLINE_UPDATE_BLOBS = 1_000      # ... many bytes and blobs of them
# What a task may not change: what the broker matched and sized the whole array on, and how
# its tasks' outputs are compared when checked (docs/verification.md, Job arrays).
FIXED = frozenset({"model", "model_name", "engine", "trust_remote_code", "dtype", "split",
                   "outputs_compare", "outputs_rtol", "outputs_atol"})


def is_array(spec: pb.JobSpec) -> bool:
    return spec.HasField("array")


def check_array(spec: pb.JobSpec, kind: Kind) -> None:
    """Raise ParamError for an array the spec cannot run as (its tasks are read apart)."""
    a = spec.array
    if kind.name == "endpoint":
        raise ParamError("array", "an endpoint cannot be an array")
    if not 1 <= a.count <= MAX_TASKS:
        raise ParamError("array.count", f"must be between 1 and {MAX_TASKS:,}")
    if a.tasks_input not in {ref.name for ref in spec.inputs}:
        raise ParamError("array.tasks", f"names no input ({a.tasks_input!r})")
    if a.per_lease > MAX_PER_LEASE:
        raise ParamError("array.per_lease", f"must be at most {MAX_PER_LEASE:,}")
    if a.only:
        if any(b <= a_ for a_, b in zip(a.only, a.only[1:])):
            raise ParamError("array.only", "must name tasks in ascending order, each once")
        if a.only[-1] >= a.count:
            raise ParamError("array.only", f"names task {a.only[-1]}, past the"
                                           f" {a.count:,} of the tasks input")


def task_indices(spec: pb.JobSpec) -> list[int]:
    """The tasks the array runs: those ``only`` names, else every line of its input."""
    return list(spec.array.only) or list(range(spec.array.count))


def task_count(spec: pb.JobSpec) -> int:
    return len(spec.array.only) or spec.array.count


def per_lease(spec: pb.JobSpec, lanes: int = 0) -> int:
    """Most tasks one lease runs: the spec's; else the tasks spread evenly over ``lanes``
    leases, as many as the devices that fit the array could run at once when it came (eight
    where none did), 1 to 1,000 tasks each. A lease costs 0.1-0.3 s beside its tasks
    (matching, a fork, its outputs and receipt), a no-op task in it under a millisecond: one
    lease per device pays that once per device and ends together, where more leases than
    devices run in waves (docs/jobs.md has the figures)."""
    return spec.array.per_lease or max(1, min(MAX_PER_LEASE,
                                              math.ceil(task_count(spec) / (lanes or 8))))


def read_tasks(data: bytes, count: int) -> list[dict[str, Any]]:
    """The tasks input's lines as objects; ParamError naming the line for what is not one,
    or if there are not exactly ``count``."""
    if len(data) > MAX_TASKS_BYTES:
        raise ParamError("array.tasks", f"more than {MAX_TASKS_BYTES >> 20} MiB")
    lines = [ln for ln in data.split(b"\n") if ln.strip()]
    if len(lines) != count:
        raise ParamError("array.tasks", f"holds {len(lines):,} tasks, the spec says"
                                        f" {count:,}")
    out = []
    for i, line in enumerate(lines):
        if len(line) > MAX_LINE_BYTES:
            raise ParamError(f"task {i}", f"more than {MAX_LINE_BYTES >> 10} KiB")
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise ParamError(f"task {i}", "not JSON") from exc
        if not isinstance(item, dict):
            raise ParamError(f"task {i}", "not an object of parameters")
        out.append(item)
    return out


def task_values(kind: Kind, base: dict[str, Any], overrides: dict[str, Any],
                inputs: set[str], task: int) -> dict[str, Any]:
    """The parameters task ``task`` runs with: ``overrides`` over ``base``, checked; a
    ParamError names the task and the field."""
    values = dict(base)
    known = {p.name: p for p in kind.params}
    for key, value in overrides.items():
        p = known.get(key)
        if p is None:
            raise ParamError(f"task {task}: {kind.name}.{key}", "not a parameter of this kind")
        if key in FIXED:
            raise ParamError(f"task {task}: {kind.name}.{key}", "the same for every task"
                                                              " (set it in the job's table)")
        if not p.accepts_type(value):
            raise ParamError(f"task {task}: {kind.name}.{key}", f"must be {TYPE_WORDS[p.type]}")
        values[key] = value
    try:
        kind.check(values, inputs)
    except ParamError as exc:
        raise ParamError(f"task {task}: {exc.field}", exc.problem) from exc
    if kind.parts(values) != 1:
        raise ParamError(f"task {task}", "a task of an array cannot be split")
    return values


def check_tasks(kind: Kind, base: dict[str, Any], data: bytes, count: int,
                inputs: set[str]) -> list[dict[str, Any]]:
    """Every task's parameters, checked (ParamError for the first that cannot run)."""
    return [task_values(kind, base, o, inputs, i)
            for i, o in enumerate(read_tasks(data, count))]


def output_name(task: int, name: str) -> str:
    """A task's output as its lease's receipt names it (a plain name: ``task000042.NAME``)."""
    return f"task{task:06d}.{name}"


def parse_indices(text: str, count: int | None = None) -> list[int]:
    """Task indices written as a list of numbers and ranges ("3,17,40-45"), ascending and
    each once; ValueError naming what is wrong (one past ``count``, where given)."""
    found: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{part!r} is not a task index or a range of them (3 or 40-45)")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"{part!r}: a range goes up")
        if high >= (count if count is not None else MAX_TASKS):
            raise ValueError(f"task {high} is past the array's"
                             f" {count if count is not None else MAX_TASKS:,} tasks")
        found.update(range(low, high + 1))
    return sorted(found)


def format_indices(indices: list[int]) -> str:
    """Ascending task indices as parse_indices reads them: "3,17,40-45"."""
    parts: list[str] = []
    for i in sorted(indices):
        if parts and i == int(parts[-1].rpartition("-")[2]) + 1:
            parts[-1] = f"{parts[-1].partition('-')[0]}-{i}"
        else:
            parts.append(str(i))
    return ",".join(parts)


def output_task(name: str) -> tuple[int, str] | None:
    """(task, its own name) of a receipt's output named by ``output_name``; None if not."""
    head, dot, rest = name.partition(".")
    if dot and len(head) == 10 and head.startswith("task") and head[4:].isdigit() and rest:
        return int(head[4:]), rest
    return None


def batches(tasks: list[int], size: int) -> list[list[int]]:
    """Tasks in leases of at most ``size``, in order."""
    return [tasks[i:i + size] for i in range(0, len(tasks), max(1, size))]
