"""Spot checks of job arrays' tasks (issue 34; broker/checks/task_checks.py): when an array's
lease ends, a sample of the tasks it succeeded is replayed on another provider (a check lease
naming exactly those tasks) and compared task by task by the array's declared rule; a
mismatch goes the way of every check (tie-break, conviction: the lease's tasks run again
elsewhere, its pay returned). On a real SQLite file through the broker's own transactions,
as tests/test_script_checks.py runs a single script's checks; tests/test_verification.py has
a cheating array provider end to end."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import tempfile
from pathlib import Path

import pytest

from gpumarket.broker.checks import disputes, task_checks, verification
from gpumarket.broker.jobs import arrays as broker_arrays
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs.job import LeaseTerms
from gpumarket.broker.market import matcher, placement
from gpumarket.broker.money import ledger
from gpumarket.kinds import arrays, script
from gpumarket.kinds.schema import ParamError
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from tests.test_ledger import new_job
from tests import test_verification_rules as verification_rules
from tests.test_verification_rules import CHECK, checks, receipt, sign, start

TASKS = 8
w = verification_rules.w


def array_job(job_id: str, rule: str, count: int = TASKS):
    """A script array of ``count`` tasks, TASKS a lease, whose signed spec declares
    ``rule``."""
    values = {"code": "code.tar", "entry": "main.py", "args": [], "steps": 0,
              "checkpoint_every": 0, "outputs_compare": rule, "outputs_rtol": 0.0,
              "outputs_atol": 0.0}
    spec = pb.JobSpec()
    script.KIND.write(spec, values)
    spec.array.CopyFrom(pb.JobArray(count=count, tasks_input="tasks.jsonl",
                                    per_lease=TASKS))
    job = new_job(job_id, "ca", 500_000, True)
    return dataclasses.replace(
        job, spec=pb.Envelope(payload=spec.SerializeToString()).SerializeToString(),
        needs=dataclasses.replace(job.needs, kind=pb.JOB_KIND_SCRIPT))


def output(text: str) -> tuple[str, int]:
    return hashlib.sha256(text.encode()).hexdigest(), len(text.encode())


def report(w, job_id: str, provider: str, tasks: list[int], doctored: int = -1) -> None:
    """``provider``'s lease of ``job_id`` reports each task succeeded with one output file,
    its content the task's own (another for the ``doctored`` task)."""
    epoch = w.job(job_id)["epoch"]
    results, receipts, blobs = [], {}, []
    for t in tasks:
        sha, size = output(f'{{"task": {t}}}' if t != doctored else '{"task": -1}')
        blobs.append((sha, size))
        receipts[t] = pb.Receipt(job_id=job_id, epoch=epoch, provider_id=provider,
                                 spec_sha256="0" * 64, outputs=[pb.ArtifactRef(
                                     name=arrays.output_name(t, "out.json"), sha256=sha,
                                     size_bytes=size)])
        results.append(gw.TaskResult(task=t, ok=True, seconds=0.1))
    w.now += 1000
    w.write(task_checks.record_results, job_id, epoch, provider, results, w.now, receipts,
            blobs, 1 << 30)


def end(w, job_id: str, provider: str) -> None:
    """The lease's receipt: it names no outputs (each task's came with its own)."""
    w.now += 1000
    w.write(jobs.succeed, job_id, w.job(job_id)["epoch"], provider,
            receipt(job_id, provider, [], w), w.now, CHECK)


def run_array(w, rule: str, provider: str, doctored: int = -1) -> None:
    w.write(broker_arrays.submit, array_job("a", rule), w.now)
    start(w, "a-1", provider)
    report(w, "a-1", provider, list(range(TASKS)), doctored)
    end(w, "a-1", provider)


def replay(w, check_id: str, checker: str) -> pb.Lease:
    """The checker leases the check, runs the tasks its lease names and reports them."""
    w.now += 1000
    env = w.write(jobs.create_lease, LeaseTerms(check_id, checker, (0,), 1.0, 60_000, 10),
                  w.now, sign)
    lease = pb.Lease.FromString(env.payload)
    w.write(jobs.mark_started, check_id, lease.epoch, checker, w.now)
    report(w, check_id, checker, list(lease.tasks))
    end(w, check_id, checker)
    return lease


def compare(c: dict, doctored: int = -1) -> tuple[bool, str]:
    """The broker's comparison of the check's files (as verdicts.py gives them: by name)."""
    def texts(refs: dict, bad: int) -> dict[str, str]:
        return {name: '{"task": -1}' if arrays.output_task(name)[0] == bad else
                f'{{"task": {arrays.output_task(name)[0]}}}' for name in refs}
    return task_checks_compare(texts(json.loads(c["expect"]), doctored),
                               texts(json.loads(c["outputs"]), -1), json.loads(c["scope"]))


def task_checks_compare(expect: dict[str, str], got: dict[str, str], scope: dict):
    """script.KIND.compare of two sides' files (by name: their text) written to disk."""
    with tempfile.TemporaryDirectory() as d:
        paths = {}
        for side, files in (("e", expect), ("g", got)):
            paths[side] = {}
            for name, text in files.items():
                p = Path(d) / side / name
                p.parent.mkdir(exist_ok=True)
                p.write_text(text)
                paths[side][name] = p
        return script.KIND.compare(paths["e"], paths["g"], scope)


def test_a_quarter_of_a_leases_tasks_drawn_at_random_whatever_its_length():
    assert [task_checks.sample_size(n) for n in (1, 4, 5, 8, 100, 128, 1000)] == \
        [1, 1, 2, 2, 25, 32, 250]
    assert task_checks.sample_size(20_000) == task_checks.MAX_TASKS == 4096
    draws = {tuple(task_checks.sample(list(range(10)), random.Random(i))) for i in range(50)}
    assert len(draws) > 10 and all(len(d) == 3 and list(d) == sorted(d) for d in draws)


def test_an_array_whose_kind_declares_no_rule_is_never_checked_and_reads_unverified(w):
    run_array(w, "none", "h1")
    assert checks(w, "a-1") == {}
    assert w.job("a")["state"] == jobs.SUCCEEDED
    v = verification.view(w.db, "a")
    assert (v.status, v.rate) == ("unverified", 0)
    assert ledger.balance(w.db, ledger.provider("h1")) > 0


def test_a_task_cannot_change_the_arrays_rule():
    with pytest.raises(ParamError, match="the same for every task"):
        arrays.task_values(script.KIND, {"code": "code.tar", "outputs_compare": "exact"},
                           {"outputs_compare": "none"}, {"code.tar"}, 3)


def test_an_honest_lease_has_a_sample_of_its_tasks_replayed_exactly_and_verified(w):
    run_array(w, "exact", "h1")
    (check_id,) = checks(w, "a-1")
    c = checks(w, "a-1")[check_id]
    scope = json.loads(c["scope"])
    assert len(scope["tasks"]) == 2 and scope["outputs"] == "exact"
    assert set(json.loads(c["expect"])) == {arrays.output_name(t, "out.json")
                                            for t in scope["tasks"]}
    assert w.job("a-1")["state"] == verification.VERIFYING      # its pay held
    assert ledger.balance(w.db, ledger.provider("h1")) == 0
    assert verification.view(w.db, "a").rate >= verification.FLOOR
    assert verification.excluded(w.db, check_id) == {"h1"}
    lease = replay(w, check_id, "h2")
    assert list(lease.tasks) == scope["tasks"]        # exactly those tasks, no others
    assert lease.job_id == check_id and lease.part == 0
    c = checks(w, "a-1")[check_id]
    assert c["state"] == "returned" and set(json.loads(c["outputs"])) == set(
        json.loads(c["expect"]))
    agrees, detail = compare(c)
    assert agrees, detail
    w.write(disputes.conclude, check_id, agrees, False, detail, w.now)
    assert w.job("a-1")["state"] == jobs.SUCCEEDED
    assert w.job("a")["state"] == jobs.SUCCEEDED
    v = verification.view(w.db, "a")
    assert v.status == "verified" and [x.state for x in v.checks] == ["passed"]
    assert v.checks[0].what.startswith(f"tasks {arrays.format_indices(scope['tasks'])} (2 of")
    assert ledger.balance(w.db, ledger.provider("h1")) > 0
    assert ledger.audit(w.db) == []


def test_a_lease_that_doctored_a_task_is_caught_its_tasks_re_run_elsewhere_unpaid(
        w, monkeypatch):
    """The cheat doctors one task, and that task is in the sample (the draw is the
    system's: the test takes the first drawn task as the one it doctored, before the
    receipt): the checker disagrees, a tie-break agrees with the checker, every task of the
    cheat's lease goes back to the queue in a new batch the cheat may not run, and its
    pay on the lease is returned."""
    w.write(broker_arrays.submit, array_job("a", "exact"), w.now)
    start(w, "a-1", "liar")
    drawn = task_checks.sample(list(range(TASKS)))
    monkeypatch.setattr(task_checks, "sample", lambda tasks, rng=None: drawn)
    report(w, "a-1", "liar", list(range(TASKS)), doctored=drawn[0])
    end(w, "a-1", "liar")
    (first,) = checks(w, "a-1")
    replay(w, first, "h1")
    agrees, detail = compare(checks(w, "a-1")[first], doctored=drawn[0])
    assert not agrees and arrays.output_name(drawn[0], "out.json") in detail, detail
    w.write(disputes.conclude, first, agrees, False, detail, w.now)
    tiebreak = next(c for c, row in checks(w, "a-1").items() if row["first_check"] == first)
    assert verification.excluded(w.db, tiebreak) == {"liar", "h1"}
    replay(w, tiebreak, "h2")
    w.write(disputes.conclude, tiebreak, False, True, "tie-break", w.now)
    assert checks(w, "a-1")[tiebreak]["liar"] == "liar"
    assert w.job("a-1")["state"] == jobs.SUCCEEDED         # the batch ended ...
    queued = w.db.execute("SELECT count(*) FROM array_tasks WHERE array_id = 'a' AND"
                          " state = ? AND batch_id = 'a-2'", [jobs.QUEUED]).fetchone()[0]
    assert queued == TASKS                                  # ... its tasks run again
    a2 = w.job("a-2")
    # a plain first attempt, none of the client's spent: the conviction on record, not the
    # attempt, keeps it from the cheat
    assert (a2["state"], a2["attempt"]) == (jobs.QUEUED, 1)
    assert a2["max_attempts"] == w.job("a-1")["max_attempts"]
    assert verification.excluded(w.db, "a-2") == {"liar"}    # never by the cheat
    assert exclusions(w)["a-2"] == {"liar"}
    assert ledger.balance(w.db, ledger.provider("liar")) == 0
    assert verification.summary(w.db, "a") == "disputed -> re-run"
    assert ledger.audit(w.db) == []


def exclusions(w) -> dict[str, frozenset[str]]:
    """By queued job row, the providers a placement pass keeps it from (its read of the
    queue, as the scheduler's)."""
    return {q.job.id: q.needs.exclude
            for q in placement.read_queue(w.db, matcher.Book([]), w.now)}


def first_tasks(tasks, rng=None) -> list[int]:
    """A check's sample, made predictable: the first tasks of the lease (as many as the real
    draw takes), so a test knows which task a cheat must doctor to be caught."""
    return sorted(tasks)[:task_checks.sample_size(len(tasks))]


def disagree(w, batch: str, checker: str) -> str:
    """The single check of ``batch``'s lease is replayed by ``checker``, which disagrees;
    returns the tie-break queued."""
    (first,) = checks(w, batch)
    replay(w, first, checker)
    w.write(disputes.conclude, first, False, False, "differs", w.now)
    return next(c for c, row in checks(w, batch).items() if row["first_check"] == first)


def test_a_provider_found_wrong_on_an_array_runs_none_of_its_batches_whatever_the_attempt(
        w, monkeypatch):
    """Fixed: placement kept a job from the providers found wrong on it only at attempt 2
    on, so the array's batches already queued (first attempts) could go to the cheat, and
    its re-run batches were made "attempt 2" with one more attempt, just for that. Now every
    row of the array is kept from it as long as the conviction is on record, the re-run a
    plain first attempt; and a pass reads the checks once, not once a job."""
    monkeypatch.setattr(task_checks, "sample", first_tasks)
    w.write(broker_arrays.submit, array_job("a", "exact", 2 * TASKS), w.now)
    start(w, "a-1", "liar")
    report(w, "a-1", "liar", list(range(TASKS)), doctored=0)
    end(w, "a-1", "liar")
    assert exclusions(w)["a-2"] == set()        # nothing on record: nobody kept off
    tiebreak = disagree(w, "a-1", "h1")
    replay(w, tiebreak, "h2")
    w.write(disputes.conclude, tiebreak, False, True, "tie-break", w.now)
    assert checks(w, "a-1")[tiebreak]["liar"] == "liar"
    kept = exclusions(w)        # a-2 queued since the submit; a-3 the re-run of liar's tasks
    assert (kept["a-2"], kept["a-3"]) == ({"liar"}, {"liar"})
    a2, a3 = w.job("a-2"), w.job("a-3")
    assert (a2["attempt"], a3["attempt"]) == (1, 1)
    assert a3["max_attempts"] == a2["max_attempts"]
    # One read of the checks table for the whole pass, however many jobs wait.
    statements: list[str] = []
    w.db.conn.set_trace_callback(statements.append)
    try:
        exclusions(w)
    finally:
        w.db.conn.set_trace_callback(None)
    assert len([s for s in statements if "FROM checks" in s]) == 1, statements


def test_a_provider_in_doubt_on_an_array_never_checks_its_other_leases(w, monkeypatch):
    """Fixed: a provider whose lease of an array a check disputed, or found wrong, could be
    drawn as the checker of the array's other leases — an honest provider's (to frame it)
    or its own tasks' re-run. Now a check of an array's lease (of a job's work) is kept from
    every provider in doubt on that array: found wrong, or accused in a dispute no tie-break
    cleared (docs/verification.md, Who checks)."""
    monkeypatch.setattr(task_checks, "sample", first_tasks)
    w.write(broker_arrays.submit, array_job("a", "exact", 2 * TASKS), w.now)
    start(w, "a-1", "liar")
    report(w, "a-1", "liar", list(range(TASKS)), doctored=0)
    end(w, "a-1", "liar")
    tiebreak = disagree(w, "a-1", "h1")         # liar's lease disputed, the tie-break open
    start(w, "a-2", "h2")
    report(w, "a-2", "h2", list(range(TASKS, 2 * TASKS)))
    end(w, "a-2", "h2")
    (other,) = checks(w, "a-2")
    assert verification.excluded(w.db, other) == {"h2", "liar"}
    assert exclusions(w)[other] >= {"h2", "liar"}
    replay(w, tiebreak, "h3")
    w.write(disputes.conclude, tiebreak, False, True, "tie-break", w.now)   # found wrong
    assert verification.disputed(w.db, "a") == set()     # no longer in doubt: convicted
    assert verification.excluded(w.db, other) == {"h2", "liar"}
    start(w, "a-3", "h1")                       # the re-run of liar's tasks
    report(w, "a-3", "h1", list(range(TASKS)))
    end(w, "a-3", "h1")
    (rerun_check,) = checks(w, "a-3")
    assert verification.excluded(w.db, rerun_check) == {"h1", "liar"}


def test_a_check_whose_checker_is_found_wrong_meanwhile_is_checked_again_elsewhere(
        w, monkeypatch):
    """Fixed (seen once in a fresh clone's suite, a render job's part stuck VERIFYING): the
    cheat was replaying the check of an honest lease when its own lease was found wrong;
    that check was cancelled with nothing in its place, so the honest lease waited for a
    verdict forever and the array never ended. Now the check is queued again, for another
    provider, and the honest lease ends when that one passes."""
    monkeypatch.setattr(task_checks, "sample", first_tasks)
    w.write(broker_arrays.submit, array_job("a", "exact", 2 * TASKS), w.now)
    start(w, "a-1", "h1")
    report(w, "a-1", "h1", list(range(TASKS)))
    end(w, "a-1", "h1")
    (honest,) = checks(w, "a-1")
    start(w, honest, "liar")                    # the cheat replays h1's lease, not done yet
    start(w, "a-2", "liar")
    report(w, "a-2", "liar", list(range(TASKS, 2 * TASKS)), doctored=TASKS)
    end(w, "a-2", "liar")
    tiebreak = disagree(w, "a-2", "h2")
    replay(w, tiebreak, "h3")
    out = w.write(disputes.conclude, tiebreak, False, True, "tie-break", w.now)
    assert checks(w, "a-2")[tiebreak]["liar"] == "liar"
    assert (honest, w.job(honest)["epoch"], "liar") in out.stop
    c = checks(w, "a-1")
    assert c[honest]["state"] == "cancelled"
    (again,) = [k for k, row in c.items() if row["state"] == "queued"]
    assert "liar" in verification.excluded(w.db, again)
    assert w.job("a-1")["state"] == pb.JOB_STATE_VERIFYING     # waits for the new check
    replay(w, again, "h2")
    w.write(disputes.conclude, again, True, False, "same", w.now)
    assert w.job("a-1")["state"] == jobs.SUCCEEDED
    assert ledger.balance(w.db, ledger.provider("h1")) > 0      # its held pay paid on
    assert ledger.audit(w.db) == []


def task_files(tasks: list[int], doctored: int = -1) -> tuple[dict[str, str], dict[str, str]]:
    """(the provider's delivery, the checker's replay) of two files a task, by name."""
    honest = {arrays.output_name(t, n): f'{{"task": {t}, "file": "{n}"}}'
              for t in tasks for n in ("a.json", "b.json")}
    return {n: '{"task": -1}' if arrays.output_task(n)[0] == doctored else text
            for n, text in honest.items()}, honest


def test_a_tasks_comparison_goes_on_over_passes_and_finds_a_doctored_task_when_it_reaches_it(
        monkeypatch):
    """The broker compares a check's tasks within its time a pass (render's rule): out of
    time with tasks left is neither a pass nor a disagreement, and the next pass goes on
    from the tasks found equal; a doctored task disagrees at the pass that reaches it."""
    from gpumarket.kinds import output_compare
    from gpumarket.kinds.base import Unfinished

    tasks = list(range(0, 40, 3))
    scope = {"outputs": "exact", "rtol": 0.0, "atol": 0.0, "tasks": tasks, "of_tasks": 40}
    monkeypatch.setattr(output_compare, "TASK_COMPARE_S", -1.0)     # one task a pass
    monkeypatch.setattr(output_compare, "_draw", random.Random(3))
    expect, got = task_files(tasks)
    compared: list[int] = []
    for passes in range(1, len(tasks) + 1):
        try:
            ok, why = task_checks_compare(expect, got, {**scope, "compared_tasks": compared})
            break
        except Unfinished as part:
            assert len(part.progress["compared_tasks"]) == passes      # a task more a pass
            compared = part.progress["compared_tasks"]
            assert f"{passes} of the {len(tasks)} replayed tasks" in str(part)
    assert ok and passes == len(tasks) and why == "28 output files of 14 tasks identical"
    expect, got = task_files(tasks, doctored=tasks[-1])
    compared, passes = [], 0
    while True:
        passes += 1
        try:
            ok, why = task_checks_compare(expect, got, {**scope, "compared_tasks": compared})
            break
        except Unfinished as part:
            compared = part.progress["compared_tasks"]
            assert tasks[-1] not in compared
    assert not ok and why == f"{arrays.output_name(tasks[-1], 'a.json')} differs (bytes)"
    assert passes <= len(tasks)
    # Within its time the whole sample is compared in one pass.
    monkeypatch.setattr(output_compare, "TASK_COMPARE_S", 60.0)
    assert not task_checks_compare(expect, got, scope)[0]


def test_a_file_only_one_side_has_or_of_no_replayed_task_differs_at_once(monkeypatch):
    from gpumarket.kinds import output_compare

    monkeypatch.setattr(output_compare, "TASK_COMPARE_S", -1.0)
    scope = {"outputs": "json", "tasks": [1, 2]}
    expect, got = task_files([1, 2])
    del got[arrays.output_name(2, "b.json")]
    assert task_checks_compare(expect, got, scope) == (
        False, "the replay returned no task000002.b.json")
    expect, got = task_files([1, 2, 5])
    assert task_checks_compare(expect, got, scope) == (
        False, "task000005.a.json is not a file of a replayed task")


def test_a_checks_tasks_are_named_one_by_one_when_few_else_by_their_range():
    rule = {"outputs": "exact", "of_tasks": 1000}
    assert verification.what(0, 0, {**rule, "tasks": [3, 4, 5, 9]}) == \
        "tasks 3-5,9 (4 of the 1000 a lease ran): every output file, compared exact"
    assert verification.what(0, 0, {**rule, "tasks": list(range(7, 1000, 4))}) == \
        ("249 tasks drawn from 7-999 (249 of the 1000 a lease ran): every output file,"
         " compared exact")
