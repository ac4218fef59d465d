"""Work stealing between the lanes of a job array when the broker's count of a lease's tasks
left is behind: it counts the tasks not reported, and a provider holds its results up to a
second (provider/task_results.py), so a steal may mark tasks the lease has run already. The
provider decides with what it really has left (YieldLease.min_left_s); the broker records
what it reports either way, and moves only the tasks that did not run."""

from __future__ import annotations

import asyncio

from gpumarket.broker.jobs.job import LeaseTerms
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.provider import task_results
from gpumarket.provider.attempt import Attempt
from gpumarket.provider.reports import TaskEnded

from tests.test_array_rules import array_job
from tests.test_provider_parts import (  # noqa: F401 (checksum_kind: its fixture)
    FakeHost,
    checksum_assignment,
    checksum_kind,
)


class TwoLanes:
    """Arrays of 40 tasks over two lanes on a real store: lease p1's batch reports its 20
    tasks and ends, lease p2's has reported 1 of its 20 (a lane is idle)."""

    def __init__(self, store) -> None:
        from gpumarket.proto.identity import Identity

        self.store = store
        self.broker, self.client, self.provider = (Identity.generate() for _ in range(3))

    async def start(self, array: str) -> None:
        from gpumarket.broker.jobs import arrays as broker_arrays
        from gpumarket.broker.jobs import transitions as jobs
        from gpumarket.proto.envelope import seal

        w = self.store.write
        await w(broker_arrays.submit, array_job(self.client, array, 40, 0), 1, 2)
        for batch, p in ((f"{array}-1", "p1"), (f"{array}-2", "p2")):
            await w(jobs.create_lease, LeaseTerms(batch, p, (0,), 1.0, 60_000, 0), 1,
                    lambda lease: seal(self.broker, lease))
            await w(jobs.mark_started, batch, 1, p, 2)
        await w(broker_arrays.record_results, f"{array}-2", 1, "p2", ok([20]), 3)
        await w(broker_arrays.record_results, f"{array}-1", 1, "p1", ok(range(20)), 4)
        await self.end(f"{array}-1", "p1", 5)

    async def end(self, batch: str, provider_id: str, at: int) -> None:
        from gpumarket.broker.jobs import transitions as jobs
        from gpumarket.proto.envelope import seal
        from gpumarket.proto.v1 import types_pb2 as pb

        receipt = seal(self.provider, pb.Receipt(job_id=batch, epoch=1,
                                                 provider_id=provider_id))
        await self.store.write(jobs.succeed, batch, 1, provider_id,
                               receipt.SerializeToString(), at)


def ok(tasks) -> list[gw.TaskResult]:
    return [gw.TaskResult(task=t, ok=True, seconds=0.1) for t in tasks]


def test_a_steal_of_tasks_run_already_moves_only_those_not_run(store):
    """A lane ends; the other lease has reported 1 of its 20 tasks, so the broker marks 19.
    Its provider had run 15 of them (held) and runs one more: they are recorded; only the 3
    it did not run go to new leases (split between the lanes), no attempt counted. A lease
    that declines the steal runs its tasks out: every one recorded, nothing to move."""
    from gpumarket.broker.jobs import arrays as broker_arrays
    from gpumarket.broker.jobs import transitions as jobs
    from gpumarket.proto.v1 import types_pb2 as pb

    w, r = store.write, store.read
    two = TwoLanes(store)
    lanes, end = two.start, two.end

    def tasks(db, array: str):
        return {t: (state, attempts, batch) for t, state, attempts, batch in db.execute(
            "SELECT task, state, attempts, batch_id FROM array_tasks WHERE array_id = ?"
            " ORDER BY task", [array])}

    async def scenario():
        S, Q = pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_QUEUED
        await lanes("s1")
        assert await w(broker_arrays.steal_for_idle_lane, "s1", 6) == ("p2", "s1-2", 1, 19)
        # It yields: what it held (15 tasks) and its current task come before its receipt.
        await w(broker_arrays.record_results, "s1-2", 1, "p2", ok(range(21, 37)), 7)
        await end("s1-2", "p2", 8)
        got = await r(tasks, "s1")
        assert all(got[t] == (S, 0, "s1-2") for t in range(20, 37))
        assert sorted(got[t] for t in range(37, 40)) == [(Q, 0, "s1-3"), (Q, 0, "s1-3"),
                                                        (Q, 0, "s1-4")]
        await lanes("s2")
        assert await w(broker_arrays.steal_for_idle_lane, "s2", 6) == ("p2", "s2-2", 1, 19)
        # Its provider declines (little left): it runs its tasks out, every one recorded.
        await w(broker_arrays.record_results, "s2-2", 1, "p2", ok(range(21, 40)), 7)
        await end("s2-2", "p2", 8)
        got = await r(tasks, "s2")
        assert all(got[t] == (S, 0, "s2-2") for t in range(20, 40))
        assert (await r(jobs.job_row, "s2"))["state"] == S
        assert (await r(jobs.job_row, "s2"))["parts"] == 2        # no lease for nothing

    asyncio.run(scenario())


def test_a_steal_asks_the_provider_with_the_least_a_steal_needs(store):
    """The broker's ask for an idle lane (task_results.lane_freed) carries STEAL_MIN_S for
    the provider to weigh against what it has not run; a fair share's ask carries none."""
    from types import SimpleNamespace

    from gpumarket.broker.api import task_results as broker_task_results
    from gpumarket.broker.api.sessions import Sessions
    from gpumarket.broker.jobs import arrays as broker_arrays

    sent: list[tuple[str, gw.BrokerMessage]] = []
    sessions = Sessions()
    sessions.relay = lambda provider_id, message: sent.append((provider_id, message))
    sessions.remote["p2"] = (None, None)         # its session is on another broker
    state = SimpleNamespace(store=store, sessions=sessions)

    async def scenario():
        await TwoLanes(store).start("s3")
        await broker_task_results.lane_freed(state, "s3", 6)

    asyncio.run(scenario())
    assert [(p, m.yield_lease.job_id, m.yield_lease.min_left_s) for p, m in sent] == \
        [("p2", "s3-2", broker_arrays.STEAL_MIN_S)]
    sessions.ask_to_yield("p2", "s3-2", 1, "another client waits")
    assert sent[-1][1].yield_lease.min_left_s == 0.0


class Runner:
    """The job's process as far as a yield goes: how often the runner was told to stop (and
    to split: tests/test_array_splits.py)."""

    def __init__(self) -> None:
        self.asked = 0
        self.splits = 0

    def request_yield(self) -> None:
        self.asked += 1

    def request_split(self) -> None:
        self.splits += 1


def test_a_provider_yields_to_a_steal_only_for_what_it_has_not_run(tmp_path, monkeypatch,
                                                                   checksum_kind):  # noqa: F811
    """Asked to yield for an idle lane (min_left_s), a lease stops after its current task
    only if the tasks it has not run would take it that long at its pace, whatever the
    broker counted; declined, it holds its results as before, and a later ask (another
    client waits: no minimum) is taken."""
    monkeypatch.setattr(task_results, "TASK_FLUSH_S", 60.0)

    def lease(tmp: str, ran: int, took_s: float) -> tuple[Attempt, Runner, FakeHost]:
        host = FakeHost(tmp_path / tmp, {})
        a = checksum_assignment(b"x")
        a.lease.tasks.extend(range(100))
        job = Attempt(a, tmp_path / tmp / "j.1", host)
        job.process = runner = Runner()
        for t in range(ran):
            job.task_results.ended(TaskEnded(t, True, "", 0.001))
        if ran:
            job.task_results.began -= took_s    # its first task began took_s ago
        return job, runner, host

    async def scenario():
        # 90 run in 0.9 s: 10 left, about 0.1 s, under a steal's 0.75 s.
        job, runner, host = lease("near", 90, 0.9)
        assert 0.09 < job.task_results.left_s() < 0.2
        told = lambda: sum(len(m.job_update.tasks.results) for m in host.sent)
        held = 90 - told()
        assert held > 0
        job.request_yield(0.75)
        assert runner.asked == 0 and not job.yield_sent
        assert told() == 90 - held              # what it holds stays held
        job.task_ended(TaskEnded(90, True, "", 0.001))
        assert runner.asked == 0
        job.request_yield(0.0)                  # another client waits: it yields
        assert runner.asked == 1 and job.yield_sent
        assert told() == 91                     # and what it held goes at once
        # 10 run in 1 s: 90 left, about 9 s: it yields at once, and only once.
        job, runner, _ = lease("far", 10, 1.0)
        job.request_yield(0.75)
        job.request_yield(0.75)
        assert runner.asked == 1 and job.yield_sent
        # Asked before it ran a task (no pace yet): it decides at its first task's end.
        job, runner, _ = lease("early", 0, 0.0)
        job.request_yield(0.75)
        assert runner.asked == 0 and job.yield_asked
        job.task_ended(TaskEnded(0, True, "", 0.1))    # 99 left at 0.1 s
        assert runner.asked == 1

    asyncio.run(scenario())
