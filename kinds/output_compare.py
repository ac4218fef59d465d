"""How a replay's output files are held against the checked provider's, for work whose
client declared the rule (a ``script`` job's ``outputs_compare``, docs/verification.md):
every delivered file is compared, and a file only one side has is a mismatch. No grpc here.

Rules:
  exact   every file byte for byte (sha256)
  json    files that parse as JSON, or as JSON lines, by what they say: the same structure,
          strings, booleans and nulls equal, numbers within ``atol + rtol * max(|a|, |b|)``
          (so key order, spacing and float formatting do not matter, and float noise within
          the declared tolerance does); a file that is not JSON compared byte for byte
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpumarket.kinds.arrays import output_task
from gpumarket.kinds.base import in_time

RULES = ("exact", "json")
JSON_LIMIT = 64 << 20    # bytes: a file larger than this is compared byte for byte (the
                         # broker parses it in its compare thread, 300 s at most)
TASK_COMPARE_S = 120.0   # of the broker's 300 s to compare a check, an array check's tasks'
                         # share in one pass (render's SAMPLE_COMPARE_S): a sample of up to
                         # 250 tasks, each up to 1,000 files of up to 64 MiB parsed as JSON,
                         # goes on at the next pass rather than timing out into a
                         # disagreement (compare_task_outputs)
_draw = secrets.SystemRandom()   # the order tasks are compared in: none the provider can aim at


def compare_outputs(expect: dict[str, Path], got: dict[str, Path], rule: str,
                    rtol: float = 0.0, atol: float = 0.0) -> tuple[bool, str]:
    """Whether ``got`` (a replay's files, by name) reproduces ``expect`` (the checked
    provider's) under ``rule``: (agrees, what was compared or the first difference).
    Raises ValueError for a rule it does not know."""
    if rule not in RULES:
        raise ValueError(f"unknown outputs_compare rule {rule!r}")
    if not expect and not got:
        return True, "no output files on either side"
    if missing := sorted(set(expect) - set(got)):
        return False, f"the replay returned no {', '.join(missing)[:200]}"
    if extra := sorted(set(got) - set(expect)):
        return False, f"the checked result has no {', '.join(extra)[:200]}"
    for name in sorted(expect):
        same, why = _same_file(expect[name], got[name], rule, rtol, atol)
        if not same:
            return False, f"{name} differs{why}"
    how = "identical" if rule == "exact" else f"equal as JSON (rtol {rtol:g}, atol {atol:g})"
    return True, f"{len(expect)} output file{'s' if len(expect) > 1 else ''} {how}"


def compare_task_outputs(expect: dict[str, Path], got: dict[str, Path], tasks: list[int],
                         rule: str, rtol: float = 0.0, atol: float = 0.0,
                         compared: Iterable[int] = ()) -> tuple[bool, str]:
    """An array check's replayed ``tasks``: every file of each (``taskNNNNNN.NAME``), the
    checked provider's (``expect``) against the replay's (``got``) under ``rule``, as
    ``compare_outputs`` does for a whole job. Which files each side has is settled first (a
    file only one side has, or one of no replayed task, differs); then the tasks' files in
    an order drawn at random, for at most TASK_COMPARE_S, skipping the tasks an earlier pass
    ``compared`` (and found equal). Returns (agrees, what was compared or the first
    difference); raises Unfinished (its progress: {"compared_tasks": the tasks found equal
    so far}) when the time ran out with tasks left: neither a pass (a doctored task may be
    among the rest) nor a disagreement (that would hold an honest provider's pay for the
    broker's slowness). Each call compares at least one task, so a check's comparison ends
    within as many passes as it replays tasks. Raises ValueError for an unknown rule."""
    if rule not in RULES:
        raise ValueError(f"unknown outputs_compare rule {rule!r}")
    if missing := sorted(set(expect) - set(got)):
        return False, f"the replay returned no {', '.join(missing)[:200]}"
    if extra := sorted(set(got) - set(expect)):
        return False, f"the checked result has no {', '.join(extra)[:200]}"
    wanted, by_task = set(tasks), {}
    for name in expect:
        task = (output_task(name) or (-1, ""))[0]
        if task not in wanted:
            return False, f"{name[:200]} is not a file of a replayed task"
        by_task.setdefault(task, []).append(name)
    for task in in_time(sorted(wanted), compared, TASK_COMPARE_S, _draw, "compared_tasks",
                        "replayed tasks compared, their files equal"):
        for name in sorted(by_task.get(task, ())):
            same, why = _same_file(expect[name], got[name], rule, rtol, atol)
            if not same:
                return False, f"{name} differs{why}"
    how = "identical" if rule == "exact" else f"equal as JSON (rtol {rtol:g}, atol {atol:g})"
    return True, (f"{len(expect)} output file{'s' if len(expect) != 1 else ''} of"
                  f" {len(wanted)} task{'s' if len(wanted) != 1 else ''} {how}")


def _same_file(a: Path, b: Path, rule: str, rtol: float, atol: float) -> tuple[bool, str]:
    if sha256_file(a) == sha256_file(b):
        return True, ""
    if rule == "exact":
        return False, " (bytes)"
    want, have = _json_of(a), _json_of(b)
    if want is _NOT_JSON or have is _NOT_JSON:
        return False, " (bytes; not both JSON)"
    where = _first_difference(want, have, rtol, atol, "")
    return where is None, f" at {where or '/'}" if where is not None else ""


_NOT_JSON = object()


def _json_of(path: Path) -> Any:
    """The file as JSON, or as a list of JSON lines; _NOT_JSON if it is neither (or too
    large to parse here)."""
    if path.stat().st_size > JSON_LIMIT:
        return _NOT_JSON
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return _NOT_JSON
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError:
        return _NOT_JSON


def _first_difference(a: Any, b: Any, rtol: float, atol: float, at: str) -> str | None:
    """The path of the first place ``a`` and ``b`` differ beyond the tolerance; None if
    they agree."""
    if _number(a) and _number(b):
        if math.isnan(a) or math.isnan(b):
            return None if math.isnan(a) and math.isnan(b) else at or "/"
        if a == b or abs(a - b) <= atol + rtol * max(abs(a), abs(b)):
            return None
        return f"{at or '/'} ({a!r} against {b!r})"
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            odd = sorted(set(a) ^ set(b))[0]
            return f"{at}/{odd} (a key only one side has)"
        for key in sorted(a):
            if (where := _first_difference(a[key], b[key], rtol, atol, f"{at}/{key}")):
                return where
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{at or '/'} ({len(a)} items against {len(b)})"
        for i, (x, y) in enumerate(zip(a, b)):
            if (where := _first_difference(x, y, rtol, atol, f"{at}/{i}")):
                return where
        return None
    return None if type(a) is type(b) and a == b else at or "/"


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def sha256_file(path: Path) -> str:
    """A file's sha256 (hex), read a MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
