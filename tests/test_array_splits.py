"""Work stealing by splits (issue 32): a lane of a job array goes idle, and a lease of the
array with tasks left gives the later part of the tasks it has not started to it, going on
with the rest (YieldLease.split), rather than stopping for both lanes to start new leases.
The runner picks where it splits (its own pace, the new lease's start counted), the daemon
passes the tasks given on (TaskResults.yielded), and the broker moves only the tasks its
steal marked. At each layer, and end to end with real processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest

from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.provider import task_results
from gpumarket.provider.attempt import Attempt
from gpumarket.provider.reports import Split, TaskEnded, parse
from gpumarket.provider.runners import base

from tests.test_array_steals import Runner, TwoLanes, ok
from tests.test_provider_parts import (  # noqa: F401 (checksum_kind: its fixture)
    FakeHost,
    checksum_assignment,
    checksum_kind,
)


def rows(db, array: str) -> dict[int, tuple[int, int, str, int]]:
    return {t: (state, attempts, batch, marked) for t, state, attempts, batch, marked in
            db.execute("SELECT task, state, attempts, batch_id, yielded FROM array_tasks"
                       " WHERE array_id = ? ORDER BY task", [array])}


def test_a_split_moves_the_tasks_given_to_the_idle_lane_and_keeps_the_rest(store):
    """Lane p1 ended; p2 reported 1 of its 20 tasks, so its 19 are marked. It answers with
    tasks 21-25 run and 33-39 given: those 7 go to one new batch (for the one idle lane), no
    attempt counted; 26-32 stay its own, their marks cleared, and it ends with them. A
    provider that gives back tasks it was not asked for (no marks) moves nothing, and one
    that names more tasks than a lease holds is refused."""
    from gpumarket.broker.jobs import arrays as broker_arrays
    from gpumarket.broker.jobs import transitions as jobs
    from gpumarket.broker.jobs import views
    from gpumarket.proto.errors import InvalidArgument
    from gpumarket.proto.v1 import types_pb2 as pb

    w, r = store.write, store.read
    two = TwoLanes(store)
    S, Q, R = pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_QUEUED, pb.JOB_STATE_RUNNING

    async def scenario():
        await two.start("s1")
        assert await w(broker_arrays.steal_for_idle_lane, "s1", 6) == ("p2", "s1-2", 1, 19)
        assert await w(broker_arrays.record_results, "s1-2", 1, "p2", ok(range(21, 26)), 7,
                       None, (), 0, list(range(33, 40))) == 0
        got = await r(rows, "s1")
        assert all(got[t] == (S, 0, "s1-2", 0) for t in range(20, 26))
        assert all(got[t] == (R, 0, "s1-2", 0) for t in range(26, 33))    # marks cleared
        assert all(got[t] == (Q, 0, "s1-3", 0) for t in range(33, 40))    # one new batch
        batch = await r(jobs.job_row, "s1-2")
        assert (batch.tasks, batch.progress_total) == (13, 13)
        events = await r(views.events_after, "s1-2", 0)
        assert [e.message for e in events if e.type == "split"] == [
            "7 of its tasks not started go to another lease"]
        # The rest of its tasks, then its end: the array waits for the new batch alone.
        await w(broker_arrays.record_results, "s1-2", 1, "p2", ok(range(26, 33)), 8)
        await two.end("s1-2", "p2", 9)
        assert (await r(jobs.job_row, "s1")).state != S
        # Unasked: p2's next lease gives back tasks of its own (no steal marked them).
        await two.start("s2")
        await w(broker_arrays.record_results, "s2-2", 1, "p2", ok([21]), 7, None, (), 0,
                list(range(30, 40)))
        got = await r(rows, "s2")
        assert all(got[t][2] == "s2-2" and got[t][1] == 0 for t in range(20, 40))
        assert (await r(jobs.job_row, "s2")).parts == 2
        with pytest.raises(InvalidArgument, match="given back"):   # bounded as results are
            await w(broker_arrays.record_results, "s2-2", 1, "p2", [], 8, None, (), 0,
                    list(range(1001)))

    asyncio.run(scenario())


def ten_run(tmp_path: Path) -> tuple[Attempt, Runner, FakeHost]:
    """A lease of 100 tasks whose runner (a Runner: what it was asked) reported 10 of them in
    0.1 s, their results held (made in the event loop)."""
    host = FakeHost(tmp_path, {})
    a = checksum_assignment(b"x")
    a.lease.tasks.extend(range(100))
    job = Attempt(a, tmp_path / "j.1", host)
    job.process = runner = Runner()
    for t in range(10):
        job.task_results.ended(TaskEnded(t, True, "", 0.01))
    job.task_results.began -= 0.1
    return job, runner, host


def test_a_provider_passes_on_the_tasks_its_runner_gave(tmp_path, monkeypatch,
                                                         checksum_kind):  # noqa: F811
    """Asked to split with enough left, the daemon tells the runner (no yield: the lease
    goes on); the runner's answer sends the tasks it gave in an update of their own, with
    what it held, and the lease forgets them (a later ask may split it again). An answer
    nobody asked for, or naming no open task, gives nothing."""
    monkeypatch.setattr(task_results, "TASK_FLUSH_S", 60.0)

    async def scenario():
        job, runner, host = ten_run(tmp_path)
        job.split_answered(Split(60))               # not asked: nothing moves
        assert len(job.task_results.open) == 90 and not any(
            m.job_update.tasks.yielded for m in host.sent)
        job.request_yield(0.3, split=True)
        assert (runner.splits, runner.asked) == (1, 0) and job.yield_sent
        job.split_answered(Split(60))
        update = host.sent[-1].job_update.tasks
        assert list(update.yielded) == list(range(60, 100))
        assert job.task_results.open == set(range(10, 60))
        assert update.seq in job.task_results.unacked           # sent again until settled
        job.request_yield(0.3, split=True)      # asked before the broker recorded it: stale
        assert (runner.splits, runner.asked) == (1, 0) and not job.yield_asked
        job.task_results.settled(gw.TaskResultsSettled(seq=update.seq, accepted=True))
        job.request_yield(0.3, split=True)                      # asked again: told again
        assert (runner.splits, runner.asked) == (2, 0)
        job.split_answered(Split(None))                         # it gave none
        assert job.task_results.open == set(range(10, 60)) and not job.yield_sent

    asyncio.run(scenario())


def test_the_runner_splits_at_its_pace_and_runs_only_what_it_kept(tmp_path, monkeypatch):
    """A real split signal during a lease of 40 tasks: the runner keeps about half of what
    it had not started (a bit more: the other lane's start), reports the first task it
    gives, runs only those it kept, and ends as a lease that ran them all. Tasks too short
    to be worth a new lease are all kept."""
    from gpumarket.kinds.runner_job import RunnerJob

    assert base.split_point(10, 0.1) == 6           # (10 + 0.1 / 0.1) / 2, rounded up
    assert base.split_point(10, 1.0) == 6           # (10 + 0.1) / 2
    assert base.split_point(2, 0.01) == 2           # the other lane's start: nothing given
    assert base.split_point(0, 0.1) == 0
    sent: list[dict] = []

    class Reporter:
        def send(self, event: str, **fields) -> None:
            sent.append({"event": event, **fields})

        def done(self, **metrics: float) -> None:
            sent.append({"event": "done", "metrics": metrics})

    ran: list[int] = []

    def fn(tdir: Path, quiet) -> None:
        task = base.read_job(tdir).task
        ran.append(task)
        if task == 100:
            os.kill(os.getpid(), base.SPLIT_SIGNAL)
        time.sleep(0.02)            # 39 left at 0.02 s: it keeps (39 + 5) / 2
        quiet.done()

    job = RunnerJob.from_json(json.dumps({"params": {}, "inputs": {}, "tasks": [
        {"task": 100 + i, "params": {}} for i in range(40)]}))
    monkeypatch.chdir(tmp_path)
    old = signal.getsignal(base.SPLIT_SIGNAL)
    try:
        base.run_tasks(fn, tmp_path, job, Reporter())
    finally:
        signal.signal(base.SPLIT_SIGNAL, old)
    split = [m for m in sent if m["event"] == "split"]
    assert len(split) == 1
    first_given = split[0]["from_task"]
    assert ran == list(range(100, first_given))
    assert 100 + 21 <= first_given <= 100 + 24      # 22 kept, as its pace goes
    assert sent[-1] == {"event": "done", "metrics": {"tasks_ok": len(ran), "tasks_failed": 0}}
    assert parse(split[0]) == Split(first_given)
    assert parse({"event": "split", "from_task": None}) == Split(None)


SCRIPT = '''
import json, sys, time
from gpumarket.provider.runners import task
i = task.index()
time.sleep(0.005 if i < 12 else 0.15)
(task.output_dir() / "result.json").write_text(json.dumps({"task": i}))
'''


@pytest.mark.e2e
def test_an_idle_lane_takes_part_of_a_slow_lease_without_stopping_it(market, tmp_path):
    """Two providers, an array of 24 tasks in two leases: the first's 12 are quick, the
    second's take 0.15 s each. When the first lane goes idle the second lease splits: part
    of its tasks run on the idle lane, while it goes on (no yield, no lease of its own
    again). Every task succeeds once, with its result."""
    market.start_provider("p1", 1.0, "--kinds", "script")
    market.start_provider("p2", 1.0, "--kinds", "script")
    market.wait_for_offers(2)
    (tmp_path / "main.py").write_text(SCRIPT)
    (tmp_path / "tasks.jsonl").write_text("{}\n" * 24)
    path = tmp_path / "split.toml"
    path.write_text(f"""
name = "split"
kind = "script"
max_price = 2.0
budget = 100

[script]
code = "{tmp_path / 'main.py'}"

[array]
tasks = "{tmp_path / 'tasks.jsonl'}"
""")
    r = market.cli("submit", str(path))
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.split()[0]
    market.wait_state(job_id, "SUCCEEDED", timeout=180)
    r = market.cli("tasks", job_id, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["tasks"]
    assert sorted(t["task"] for t in got) == list(range(24))
    assert all(t["state"] == "SUCCEEDED" for t in got), got
    slow = {t["batch"] for t in got if t["task"] >= 12}
    assert len(slow) == 2, slow                 # the slow lease's tasks ran in two leases
    out = tmp_path / "out"
    r = market.cli("results", job_id, "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    for i in range(24):
        assert json.loads((out / f"task-{i:06d}" / "result.json").read_text()) == {"task": i}
    events = "\n".join(market.cli("watch", b, "--json").stdout for b in sorted(slow))
    assert '"split"' in events and "asked to stop" not in events, events
    logs = "".join(p.text() for p in market.providers.values())
    assert "gives" in logs and "tasks not started to another lease" in logs, logs[-2000:]


def test_a_split_that_gives_nothing_leaves_the_lease_to_later_asks(store):
    """A steal's marks ask a split, not a stop: its provider declining (little left at its
    pace, nothing sent) or the split still unanswered, the lease is asked again at its next
    report while the lane stays idle, and a fair share's yield may still be asked of it (a
    split frees no device). That yield's marks stay on what the lease keeps when its split's
    answer comes late: its unreported tasks go back without an attempt when it stops."""
    from gpumarket.broker.jobs import arrays as broker_arrays
    from gpumarket.proto.v1 import types_pb2 as pb

    w, r = store.write, store.read
    two = TwoLanes(store)
    Q, R = pb.JOB_STATE_QUEUED, pb.JOB_STATE_RUNNING

    def lease(db, batch: str) -> dict:
        return next(x for x in broker_arrays.running_leases(db) if x["id"] == batch)

    async def scenario():
        await two.start("s4")
        assert await w(broker_arrays.steal_for_idle_lane, "s4", 6) == ("p2", "s4-2", 1, 19)
        assert not (await r(lease, "s4-2"))["yielding"]     # its device stays busy
        # Declined: its tasks reported as usual; the lane is still idle, 14 left at 0.1 s.
        assert await w(broker_arrays.record_results, "s4-2", 1, "p2", ok(range(21, 26)),
                       7) == 14
        # Another client waits: the lease is asked to stop after its current task.
        assert await w(broker_arrays.yield_lease, "s4-2", 1, 8) == 14
        assert (await r(lease, "s4-2"))["yielding"]
        assert await w(broker_arrays.record_results, "s4-2", 1, "p2", ok([26]), 9) == 0
        # The split's answer, late: the tasks given move; the rest stay marked to go back.
        await w(broker_arrays.record_results, "s4-2", 1, "p2", [], 10, None, (), 0,
                list(range(33, 40)))
        got = await r(rows, "s4")
        assert all(got[t] == (Q, 0, "s4-3", 0) for t in range(33, 40))
        assert all(got[t][0] == R and got[t][3] for t in range(27, 33))
        await two.end("s4-2", "p2", 11)
        got = await r(rows, "s4")
        assert all(got[t][:2] == (Q, 0) for t in range(27, 33))     # no attempt counted

    asyncio.run(scenario())


def test_a_yield_asked_while_a_split_is_pending_is_told_to_the_runner(
        tmp_path, monkeypatch, checksum_kind):  # noqa: F811
    """Another client waits while the runner has not answered a split: the lease stops
    after its current task (the split frees no device); the split's late answer then gives
    nothing (the runner stops: what it did not run goes back with the lease's end)."""
    monkeypatch.setattr(task_results, "TASK_FLUSH_S", 60.0)

    async def scenario():
        job, runner, host = ten_run(tmp_path)
        job.request_yield(0.3, split=True)
        assert (runner.splits, runner.asked) == (1, 0)
        job.request_yield(0.0)
        assert (runner.splits, runner.asked) == (1, 1)
        assert job.task_results.stopping            # what it holds goes at once
        job.split_answered(Split(60))
        assert len(job.task_results.open) == 90
        assert not any(m.job_update.tasks.yielded for m in host.sent)

    asyncio.run(scenario())
