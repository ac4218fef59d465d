"""What a job tells its daemon, read by one bounded, validating reader.

A runner appends one JSON object a line to its reports file (runners/report.py); the daemon
also turns the job's stdout and stderr into log reports. All of it is the job's to write: a
script job's own code, or a model's remote code, can put anything there. So every line goes
through ``parse_line`` here and comes out as one of the typed reports below, or not at all:
each field of the right type and within its range (steps and task numbers non-negative
integers that fit the wire, metrics finite numbers, bounded counts and lengths, a checkpoint
path a plain relative path inside the work directory). A line that is not such a report is
dropped (``ReportReader`` counts it, and says so in the daemon's log at most once every
WARN_EVERY_S); nothing a job writes raises out of here.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from gpumarket.proto.jobspec import LOG_LINE_CHARS, LOG_LINES_PER_UPDATE

log = logging.getLogger(__name__)

MAX_LINE = 1 << 20          # bytes of one report line (the executor reads 1 MiB at a time)
MAX_STEP = 2**62            # steps and totals (uint64 on the wire, int64 in the broker)
MAX_TASK = 2**32 - 1        # a task's number in its array (uint32 on the wire)
MAX_METRICS = 64            # metrics in one report (more are left out)
MAX_NAME = 128              # characters of a metric's name
MAX_PATH = 1024             # characters of a checkpoint's path
MAX_PARTS = 16              # components of a checkpoint's path
MAX_ERROR = 1000            # characters of a task's error
MAX_SECONDS = 1e9           # a task's or a checkpoint write's seconds
WARN_EVERY_S = 10.0         # how often one job's dropped reports are logged


@dataclass(frozen=True)
class Progress:
    step: int
    total: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: str                   # relative to the work directory, plain components only
    write_seconds: float = 0.0


@dataclass(frozen=True)
class TaskEnded:
    """A task of a job array's lease ended (base.run_tasks)."""
    task: int
    ok: bool
    error: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class Split:
    """A job array's lease answered a split (base.run_tasks): it gives its tasks from
    ``from_task`` on (in the lease's order) to another lease; None: it gives none."""
    from_task: int | None


@dataclass(frozen=True)
class Log:
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Done:
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Drained:
    step: int = 0


@dataclass(frozen=True)
class EngineReady:
    """An endpoint replica's engine has loaded its model (runners/serve.py)."""
    engine: str
    task: str
    max_concurrency: int        # 0: not said (or not a positive 31-bit integer)
    max_seq_len: int


@dataclass(frozen=True)
class EngineAnswer:
    """A line of the engine's answer to a request (the line itself goes to the broker as
    the engine wrote it; the daemon reads only whose it is and whether it is the last)."""
    request_id: str
    last: bool


Report = Progress | Checkpoint | TaskEnded | Split | Log | Done | Drained

# Events a runner may write that the daemon has no use for: not an error.
IGNORED = frozenset({"resumed"})


class Malformed(ValueError):
    """A line that is no report the daemon takes (says which field, and why)."""


def _int(raw: dict, name: str, top: int, default: int | None = None) -> int:
    value = raw.get(name, default)
    if type(value) is not int or not 0 <= value <= top:
        raise Malformed(f"{name} is not an integer from 0 to {top}")
    return value


def _seconds(raw: dict, name: str) -> float:
    value = raw.get(name, 0.0)
    if type(value) not in (int, float) or not 0 <= value <= MAX_SECONDS:
        raise Malformed(f"{name} is not a number of seconds")
    return float(value)


def metrics_of(value: object) -> dict[str, float]:
    """The finite numeric metrics of ``value`` (at most MAX_METRICS, names at most MAX_NAME
    characters); entries that are anything else are left out, as is anything but a dict."""
    if not isinstance(value, dict):
        return {}
    out: dict[str, float] = {}
    for name, number in value.items():
        if len(out) == MAX_METRICS:
            break
        if (isinstance(name, str) and 0 < len(name) <= MAX_NAME
                and type(number) in (int, float) and math.isfinite(number)):
            out[name] = float(number)
    return out


def checkpoint_path(value: object, workdir: Path | None) -> str:
    """A checkpoint's path as the job reported it, made relative to its work directory (an
    absolute one must be inside it); Malformed unless it is a plain path of a few parts."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_PATH or "\0" in value:
        raise Malformed("path is not a path")
    path = PurePosixPath(value)
    if path.is_absolute():
        if workdir is None or not path.is_relative_to(workdir):
            raise Malformed("path is outside the work directory")
        path = path.relative_to(workdir)
    parts = path.parts
    if not parts or len(parts) > MAX_PARTS or any(p in (".", "..") for p in parts):
        raise Malformed("path is not a plain path inside the work directory")
    return str(path)


def parse(raw: object, workdir: Path | None = None) -> Report | None:
    """The report ``raw`` (a decoded line) is; None for an event the daemon has no use for.
    Raises Malformed."""
    if not isinstance(raw, dict):
        raise Malformed("a report is a JSON object")
    event = raw.get("event")
    if event == "progress":
        return Progress(_int(raw, "step", MAX_STEP, 0), _int(raw, "total", MAX_STEP, 0),
                        metrics_of(raw.get("metrics")))
    if event == "checkpoint":
        return Checkpoint(_int(raw, "step", MAX_STEP), checkpoint_path(raw.get("path"), workdir),
                          _seconds(raw, "write_seconds"))
    if event == "task":
        ok, error = raw.get("ok"), raw.get("error") or ""
        if not isinstance(ok, bool):
            raise Malformed("ok is not true or false")
        if not isinstance(error, str):
            raise Malformed("error is not a string")
        return TaskEnded(_int(raw, "task", MAX_TASK), ok, error[:MAX_ERROR],
                         _seconds(raw, "seconds"))
    if event == "split":
        return Split(None if raw.get("from_task") is None else _int(raw, "from_task", MAX_TASK))
    if event == "log":
        return log_report(raw.get("lines"))
    if event == "done":
        return Done(metrics_of(raw.get("metrics")))
    if event == "drained":
        return Drained(_int(raw, "step", MAX_STEP, 0))
    if isinstance(event, str) and event in IGNORED:
        return None
    raise Malformed("no such event")


def log_report(lines: object) -> Log:
    """Log lines (at most LOG_LINES_PER_UPDATE, each cut to LOG_LINE_CHARS); Malformed
    unless a list of strings."""
    if not isinstance(lines, list) or not all(isinstance(x, str) for x in lines):
        raise Malformed("lines is not a list of strings")
    return Log(tuple(x[:LOG_LINE_CHARS] for x in lines[:LOG_LINES_PER_UPDATE]))


def decode(line: bytes) -> object:
    """A line's JSON; Malformed if it is none (or too long, or nested too deep)."""
    if len(line) > MAX_LINE:
        raise Malformed("the line is too long")
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as exc:    # UnicodeDecodeError is a ValueError
        raise Malformed("not JSON") from exc


def parse_line(line: bytes, workdir: Path | None = None) -> Report | None:
    """``parse`` of one line of the reports file. Raises Malformed."""
    return parse(decode(line), workdir)


def engine_line(line: bytes) -> EngineReady | EngineAnswer:
    """What a line an endpoint's engine wrote is (provider/replica.py). Raises Malformed."""
    message = decode(line)
    if not isinstance(message, dict):
        raise Malformed("an engine's line is a JSON object")

    def count(key: str) -> int:
        value = message.get(key)
        return value if type(value) is int and 0 < value < 2**31 else 0

    if message.get("event") == "ready":
        return EngineReady(str(message.get("engine", ""))[:200],
                           str(message.get("task", ""))[:20],
                           count("max_concurrency"), count("max_seq_len"))
    request_id = message.get("id")
    if not isinstance(request_id, str):
        raise Malformed("no request id")
    return EngineAnswer(request_id, bool(message.get("done")))


class ReportReader:
    """One job's reports, line by line: the good ones typed, the rest counted and logged
    at most once every WARN_EVERY_S (a job cannot fill the daemon's log)."""

    def __init__(self, workdir: Path, name: str = "") -> None:
        self.workdir = workdir
        self.name = name or workdir.name
        self.dropped = 0            # malformed lines in all
        self._unsaid = 0            # ... not yet in a log line
        self._why = ""
        self._said_at = -math.inf

    def line(self, line: bytes) -> Report | None:
        """The report on ``line``; None if there is none (never raises)."""
        if not line.strip():
            return None
        try:
            return parse_line(line, self.workdir)
        except Malformed as exc:
            self.drop(str(exc))
        except Exception as exc:  # noqa: BLE001 (whatever a job wrote: never the daemon's end)
            self.drop(f"unreadable ({type(exc).__name__})")
        return None

    def lines(self, data: bytes) -> list[Report]:
        """The reports on the complete lines of ``data``."""
        return [r for r in map(self.line, data.split(b"\n")) if r is not None]

    def drop(self, why: str) -> None:
        self.dropped += 1
        self._unsaid += 1
        self._why = why
        now = time.monotonic()
        if now - self._said_at >= WARN_EVERY_S:
            self._said_at = now
            log.warning("job %s: %d report lines dropped (the last: %s)", self.name,
                        self._unsaid, self._why)
            self._unsaid = 0
