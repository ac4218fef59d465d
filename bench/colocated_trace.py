"""Where bench/colocated.py's slow requests come from (issue 35): each request's arrival and
TTFT set against what happened on the host meanwhile — the training job's events as the
broker stored them (its progress reports, logs, checkpoints: the events table's times) and,
with ``--lag-probe``, every stall of an event loop in the marketplace's processes (the
broker, the provider daemon, the replica's engine): a callback that ran longer than
SLOW_MS, or a timer that fired more than SLOW_MS late (the loop held by other work, the
GIL held by another thread, or the process not scheduled).

The probe is a ``sitecustomize`` module on PYTHONPATH for the processes the bench starts
(nothing of it is in the marketplace's code): it wraps ``asyncio.events.Handle._run`` (every
callback and task step of a pure-asyncio loop) and keeps a ticker on each running loop,
appending what it saw, one JSON object a line, to a file per process; the bench probes its
own client's loop the same way (``probe_here``). The replica's engine is not probed: a
job's environment is the provider's to make (no PYTHONPATH of ours). Imported by
bench/colocated.py; prints nothing.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

SLOW_MS = 2.0           # a callback longer than this, or a tick this late, is a stall
TICK_MS = 5.0           # the ticker's period on each loop
PAD_MS = 2.0            # a request meets an event this close before its arrival too
WINDOW_MS = 20.0        # ... or this soon after it (about a request's TTFT p50)

PROBE = """
import asyncio.events as _events, asyncio.base_events as _base, json as _json, os as _os
import sys as _sys, time as _time
_dir = _os.environ.get("COLOCATED_LAG_PROBE")
if _dir:
    _slow, _tick = {slow} / 1000, {tick} / 1000
    _out = []
    def _emit(kind, began, ms, what):
        try:
            if not _out:
                _out.append(open(_os.path.join(_dir, f"{{_os.getpid()}}.jsonl"), "a",
                                 buffering=1))
            _out[0].write(_json.dumps({{"pid": _os.getpid(), "kind": kind, "at": began,
                                       "ms": round(ms, 2), "what": what[:160]}}) + "\\n")
        except OSError:
            pass
    _run = _events.Handle._run
    def _timed(self):
        began, t0 = _time.time(), _time.perf_counter()
        _run(self)
        took = _time.perf_counter() - t0
        if took > _slow:
            cb = getattr(self, "_callback", None)
            owner = getattr(cb, "__self__", None)      # a task's step: name its coroutine
            coro = getattr(owner, "get_coro", lambda: None)()
            what = getattr(coro, "__qualname__", None) or repr(cb)
            _emit("callback", began, took * 1000, what)
    _events.Handle._run = _timed
    _forever = _base.BaseEventLoop.run_forever
    def _probed(loop):
        def tick(due):
            late = _time.perf_counter() - due
            if late > _slow:
                _emit("late", _time.time() - late, late * 1000, "a timer fired late")
            loop.call_later(_tick, tick, _time.perf_counter() + _tick)
        loop.call_soon(tick, _time.perf_counter())
        return _forever(loop)
    _base.BaseEventLoop.run_forever = _probed
"""


def install_probe(directory: Path) -> dict[str, str]:
    """Write the probe into ``directory`` (its stalls land there too); returns the
    environment the processes to probe need (PYTHONPATH and COLOCATED_LAG_PROBE)."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o777)          # a job's process may run as a uid of its own
    (directory / "sitecustomize.py").write_text(PROBE.format(slow=SLOW_MS, tick=TICK_MS))
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": f"{directory}{os.pathsep}{path}" if path else str(directory),
            "COLOCATED_LAG_PROBE": str(directory)}


def probe_here(directory: Path) -> None:
    """Probe this process's loops too (the bench's own client: its requests' loop)."""
    os.environ["COLOCATED_LAG_PROBE"] = str(directory)
    exec(compile((directory / "sitecustomize.py").read_text(), "lag-probe", "exec"), {})


def stalls(directory: Path, roles: dict[int, str]) -> list[dict]:
    """Every stall the probe wrote, each with its process's ``role`` (``roles``: pid ->
    role; another process's is "other")."""
    out = []
    for path in directory.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                seen = json.loads(line)
            except ValueError:
                continue
            out.append({**seen, "role": roles.get(seen["pid"], "other")})
    return out


def run_delay(pids: list[int]) -> float:
    """Seconds the threads of processes ``pids`` have spent runnable but waiting for a CPU
    (the second field of /proc/PID/task/TID/schedstat, where the kernel keeps it): read
    before and after a side, how long each process waited for a core on it. A thread that
    ended between the readings takes its wait with it (an undercount)."""
    total = 0
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                total += int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return total / 1e9


def training_events(db_path: Path, job_id: str) -> list[dict]:
    """The training job's events as the broker stored them: ``at`` (s, wall clock, the
    broker's time of receipt, to the ms) and ``type`` (progress, log, checkpoint, ...)."""
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT at_ms, type FROM events WHERE job_id = ?", [job_id])
        return [{"at": at / 1000, "type": kind} for at, kind in rows]
    finally:
        db.close()


def near(request: dict, at: float) -> bool:
    """Whether an instant event at ``at`` (s) fell in ``request``'s first WINDOW_MS (from
    PAD_MS before its arrival): a window of one length for every request, so that a slow
    request, whose wait is long, is not counted as meeting more only for being long."""
    return request["at"] - PAD_MS / 1000 <= at <= request["at"] + WINDOW_MS / 1000


def covered(request: dict, stalls: list[dict]) -> float:
    """The share of ``request``'s wait for its first token that its longest overlapping
    stall (``{"at": s, "ms": ...}``) covered: near 1, the request waited on that stall."""
    start, end = request["at"], request["at"] + request["ttft"]
    best = 0.0
    for s in stalls:
        overlap = min(end, s["at"] + s["ms"] / 1000) - max(start, s["at"])
        best = max(best, overlap)
    return best / max(request["ttft"], 1e-9)


def coincidence(requests: list[dict], events: dict[str, list[dict]],
                stalls: dict[str, list[dict]]) -> list[dict]:
    """For each side (alone, colocated) and each group of its requests by TTFT (the slowest
    1 %, the next 4 %, the other 95 %): how many, their TTFT range; for each kind of instant
    event in ``events`` (name -> [{"at": s}]) the share of the group's requests that had one
    in their first WINDOW_MS (``near``); for each process's stalls in ``stalls`` the median
    share of a request's wait that one stall covered (``covered``). A kind the slow requests
    meet far more than the others is where the tail comes from."""
    rows = []
    for side in ("alone", "colocated"):
        mine = sorted((r for r in requests if r["side"] == side), key=lambda r: -r["ttft"])
        if not mine:
            continue
        n = len(mine)
        top1, top5 = max(1, round(n * 0.01)), max(2, round(n * 0.05))
        for group, chosen in (("slowest 1 %", mine[:top1]), ("next 4 %", mine[top1:top5]),
                              ("other 95 %", mine[top5:])):
            if not chosen:
                continue
            row = {"side": side, "group": group, "requests": len(chosen),
                   "ttft_ms": f"{chosen[-1]['ttft'] * 1000:.1f}-{chosen[0]['ttft'] * 1000:.1f}"}
            for name, seen in events.items():
                hit = sum(any(near(r, e["at"]) for e in seen) for r in chosen)
                row[f"{name} near"] = round(hit / len(chosen), 2)
            for name, seen in stalls.items():
                shares = sorted(covered(r, seen) for r in chosen)
                row[f"{name} covered"] = round(shares[len(shares) // 2], 2)
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """``coincidence``'s rows as a markdown table (shares of each group's requests)."""
    if not rows:
        return "(no requests)"
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row.get(k, "")) for k in keys) + " |" for row in rows]
    return "\n".join(lines)
