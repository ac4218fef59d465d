"""bench/colocated_trace.py, what bench/colocated.py tells slow requests apart with: the lag
probe sees a loop held by a long callback (and names the coroutine), and the coincidence
table counts a slow request as meeting an event only where the event fell in its first
WINDOW_MS — not for having waited long — and says how much of its wait a stall covered."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import colocated_trace as trace  # noqa: E402

HELD = """
import asyncio, time
async def holds_the_loop():
    await asyncio.sleep(0.02)
    time.sleep(0.06)            # blocks the loop: a callback of 60 ms
    await asyncio.sleep(0.02)
asyncio.run(holds_the_loop())
"""


def test_the_probe_names_a_callback_that_held_the_loop(tmp_path):
    env = {**os.environ, **trace.install_probe(tmp_path / "probe")}
    subprocess.run([sys.executable, "-c", HELD], env=env, check=True, timeout=60)
    seen = trace.stalls(tmp_path / "probe", {})
    held = [s for s in seen if s["kind"] == "callback" and s["ms"] >= 50]
    assert [s["what"] for s in held] == ["holds_the_loop"], seen
    # the ticker saw its timer come late by about as much
    assert any(s["kind"] == "late" and s["ms"] >= 30 for s in seen), seen


def test_a_slow_request_meets_an_event_only_near_its_arrival():
    requests = [{"side": "colocated", "at": i * 0.1, "ttft": 0.01} for i in range(100)]
    requests[5]["ttft"] = 0.3                   # the slowest: arrived at 0.5 s
    requests[50]["ttft"] = 0.2                  # the next: arrived at 5.0 s
    events = {"progress": [{"at": 0.505},        # in the slowest's first WINDOW_MS
                           {"at": 5.15}]}        # in the next's wait, but 150 ms in
    stalls = {"broker stall": [{"at": 0.50, "ms": 270.0}]}
    rows = {r["group"]: r for r in trace.coincidence(requests, events, stalls)}
    assert rows["slowest 1 %"]["progress near"] == 1.0
    assert rows["slowest 1 %"]["broker stall covered"] == 0.9
    assert rows["next 4 %"]["progress near"] == 0.0     # met it only by waiting long
    assert rows["other 95 %"]["progress near"] == 0.0
    assert rows["other 95 %"]["broker stall covered"] == 0.0
    assert "| slowest 1 % |" in trace.table(list(rows.values())).replace("colocated | ", "")
