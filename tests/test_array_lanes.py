"""An array's lanes while a lease of it waits for its spot checks (broker/jobs/arrays.py; the
checks are broker/checks/task_checks.py): a batch whose lease ended with its receipt is
VERIFYING until a replay elsewhere agrees, minutes perhaps, and its lane is free meanwhile.
The array's other leases yield to that lane (work stealing), and the tasks such a lease
yielded go on at once. On a real SQLite file through the broker's own transactions, as
tests/test_task_checks.py."""

from __future__ import annotations

import dataclasses

from gpumarket.broker.checks import task_checks
from gpumarket.broker.jobs import arrays as broker_arrays
from gpumarket.kinds import script
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from tests import test_verification_rules as verification_rules
from tests.test_ledger import new_job
from tests.test_task_checks import checks, end, report
from tests.test_verification_rules import start

w = verification_rules.w
TASKS = 40


def two_lane_array(w, job_id: str) -> None:
    """A script array of TASKS tasks over two lanes (a batch of 20 each) whose signed spec
    has its outputs compared exactly: a lease of it that ends is spot-checked."""
    values = {"code": "code.tar", "entry": "main.py", "args": [], "steps": 0,
              "checkpoint_every": 0, "outputs_compare": "exact", "outputs_rtol": 0.0,
              "outputs_atol": 0.0}
    spec = pb.JobSpec()
    script.KIND.write(spec, values)
    spec.array.CopyFrom(pb.JobArray(count=TASKS, tasks_input="tasks.jsonl"))
    job = new_job(job_id, "ca", 500_000, True)
    job = dataclasses.replace(
        job, spec=pb.Envelope(payload=spec.SerializeToString()).SerializeToString(),
        needs=dataclasses.replace(job.needs, kind=pb.JOB_KIND_SCRIPT))
    w.write(broker_arrays.submit, job, w.now, 2)


def tasks(w) -> dict[int, tuple[int, int, str]]:
    return {t: (state, attempts, batch) for t, state, attempts, batch in w.db.execute(
        "SELECT task, state, attempts, batch_id FROM array_tasks ORDER BY task")}


def test_a_lease_waiting_for_its_checks_frees_its_lane_for_a_steal(w):
    """Lane h1 ended its lease and waits for its check (VERIFYING): it runs no task, so the
    other lease, 19 tasks of 0.1 s left, yields them to it."""
    two_lane_array(w, "a")
    start(w, "a-1", "h1")
    epoch = start(w, "a-2", "h2")
    report(w, "a-2", "h2", [20])
    report(w, "a-1", "h1", list(range(20)))
    end(w, "a-1", "h1")
    assert w.job("a-1")["state"] == pb.JOB_STATE_VERIFYING and checks(w, "a-1")
    w.now += 1000
    assert w.write(broker_arrays.steal_for_idle_lane, "a", w.now) == ("h2", "a-2", epoch, 19)


def test_the_tasks_a_lease_yielded_go_on_while_its_checks_run(w):
    """A lease asked to yield ends with its receipt and waits for its check: the tasks it
    did not run go back to the queue now, as two batches and without an attempt, not when
    the check ends; the array runs on."""
    two_lane_array(w, "a")
    start(w, "a-1", "h1")
    epoch = start(w, "a-2", "h2")
    report(w, "a-2", "h2", [20])
    assert w.write(broker_arrays.yield_lease, "a-2", epoch, w.now) == 19
    report(w, "a-2", "h2", [21])                     # the task it ran when asked
    end(w, "a-2", "h2")
    assert w.job("a-2")["state"] == pb.JOB_STATE_VERIFYING and checks(w, "a-2")
    got = tasks(w)
    S, Q = pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_QUEUED
    assert got[20] == got[21] == (S, 0, "a-2")
    assert {t: got[t] for t in range(22, 40)} == \
        {t: (Q, 0, "a-3" if t < 31 else "a-4") for t in range(22, 40)}
    assert w.job("a-3")["state"] == w.job("a-4")["state"] == Q
    assert w.job("a")["state"] == pb.JOB_STATE_RUNNING
    # Run there, they are recorded as any batch's.
    start(w, "a-3", "h1")
    w.now += 1000
    w.write(task_checks.record_results, "a-3", w.job("a-3")["epoch"], "h1",
            [gw.TaskResult(task=22, ok=False, error="boom")], w.now)
    assert tasks(w)[22][:2] == (Q, 1)
