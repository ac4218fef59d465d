"""Spot checks of job arrays' tasks (docs/verification.md, Job arrays). No grpc here; every
function runs inside one write transaction.

An array's lease (a batch of tasks run by one provider) reports each task with its own
receipt; nothing in one task's outputs says whether another's are right. So when such a
lease ends, a sample of the tasks it ran is replayed on another provider, exactly those tasks
(the same signed spec, the same lines of its tasks input), and the broker compares each
task's files with what the provider delivered by the array's declared rule
(``outputs_compare``, kinds/output_compare.py). It is a check like any other
(broker/checks/verification.py): drawn at the provider's rate, the lease's pay held, a check
lease that says neither whose work nor which job it replays, a tie-break on disagreement; a
provider found wrong has every task of that lease run again elsewhere and is not paid for
it (``rerun``). A kind with no declared rule (a script's "none", or a built-in kind's array)
is never checked: its work reads ``unverified``.
"""

from __future__ import annotations

import json
import secrets

from sqlite_utils import Database

from gpumarket import kinds
from gpumarket.broker.checks import verification
from gpumarket.broker.checks.policy import Policy
from gpumarket.broker.jobs import arrays
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.store import blob_holdings
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb

SHARE = 4          # a check replays a quarter of the lease's tasks (rounded up) ...
MAX_TASKS = 4096   # ... and at most this many, as a render's frames (kinds/render.py
                   # MAX_CHECK_FRAMES): what a check's scope lists. A lease runs at most
                   # kinds.arrays.MAX_PER_LEASE (1,000) tasks, so a check replays at most 250;
                   # the broker compares them within a time a pass and goes on at its next
                   # (kinds/output_compare.py compare_task_outputs)
SUCCEEDED = pb.JOB_STATE_SUCCEEDED
_RANDOM = secrets.SystemRandom()


def sample_size(n: int) -> int:
    """How many of a lease's ``n`` succeeded tasks one check replays: k = min(n, 4096,
    ⌈n/4⌉). One doctored task of n is caught by a check with p = k/n (render's rule: see
    kinds/render.py catch_probability): a quarter, whatever the lease's length, so a new
    provider doctoring one task of every lease is caught within its 20 warm-up checks with
    p ≈ 0.997. The same share for every check, warm-up or not: a sample sized by the
    checked provider's rate would tell the checker, who counts the tasks its lease names,
    that the provider is new (docs/verification.md, What a checker learns)."""
    return min(n, MAX_TASKS, -(-n // SHARE))


def sample(tasks: list[int], rng=_RANDOM) -> list[int]:
    """The tasks a check replays, drawn from the system's random source (the provider cannot
    predict which), ascending."""
    return sorted(rng.sample(sorted(tasks), sample_size(len(tasks))))


def rule(kind: kinds.Kind, values: dict) -> dict:
    """The comparison an array's spec declares for its tasks' outputs (a check scope's
    ``outputs``, ``rtol``, ``atol``); {} for one that declares none (never checked)."""
    if kind.verify != "outputs" or not kind.checked(values):
        return {}
    return kind.check_scope(values, 0, 0, {}, 0)


def choose(db: Database, policy: Policy, batch, lease: dict, now: int) -> str | None:
    """An array's lease ended with its receipt (``batch``: its job row): perhaps check a
    sample of the tasks it ran and succeeded. Returns the check's id, or None."""
    if not policy.enabled or not verification._checkable(batch["kind"], batch["spec"]):
        return None      # (nor one whose spec this broker cannot read)
    kind = kinds.get(batch["kind"])
    scope = rule(kind, verification._values(kind, batch))
    if not scope:
        return None
    done = {task: json.loads(outs) for task, outs in db.execute(
        "SELECT task, outputs FROM array_tasks WHERE batch_id = ? AND state = ? AND"
        " provider_id = ? AND outputs IS NOT NULL", [batch["id"], SUCCEEDED,
                                                     lease["provider_id"]]).fetchall()}
    if not done:
        return None
    picked = sample(list(done))
    expect = {ref["name"]: ref for task in picked for ref in done[task]}
    # (a task that delivered no file is checked all the same: the replay's files say
    # whether it should have)
    check_id = verification.choose(db, policy, batch, lease, 0, len(picked), None, expect,
                                   {**scope, "tasks": picked, "of_tasks": len(done)}, now)
    if check_id:
        jobs.set_job(db, check_id, now, part=0, parts=0)   # its lease names tasks, no part
    return check_id


def receipt_came(db: Database, policy: Policy, job, lease: dict, total: int, outputs: dict,
                 receipt: pb.Receipt, now: int) -> str | None:
    """A lease's receipt came (a reaction, jobs/reactions.py): perhaps check its work, a
    sample of its tasks for an array's lease (``choose``), else as verification.choose_final
    does."""
    if job["tasks"]:
        return choose(db, policy, job, lease, now)
    return verification.choose_final(db, policy, job, lease, total, outputs, receipt, now)


def tasks_of(db: Database, check_id: str) -> list[int]:
    """The tasks a check's scope replays ([] for a check of anything else)."""
    row = db.execute("SELECT scope FROM checks WHERE id = ?", [check_id]).fetchone()
    return list(json.loads(row[0]).get("tasks", [])) if row else []


def lease_tasks(db: Database, job_id: str) -> list[int]:
    """The tasks a new lease of this job row runs: a batch's open tasks, or the tasks a check
    of an array's lease replays."""
    return tasks_of(db, job_id) or arrays.lease_tasks(db, job_id)


def record_results(db: Database, job_id: str, epoch: int, provider_id: str,
                   results: list[gw.TaskResult], now: int,
                   receipts: dict[int, pb.Receipt] | None = None,
                   blobs: list[tuple[str, int]] = (), quota: int = 0,
                   yielded: list[int] = ()) -> int:
    """A lease's task results (arrays.record_results, whose arguments these are): a batch's
    are its array's; a check's are kept with the check, the outputs of the tasks it
    replays (its receipt names none), to be compared when its lease ends (a check is never
    asked to split: tasks it says it gives back are ignored)."""
    job = jobs.job_row(db, job_id)
    if not job.check_of:
        return arrays.record_results(db, job_id, epoch, provider_id, results, now, receipts,
                                     blobs, quota, yielded)
    jobs.current(db, job_id, epoch, provider_id)
    if blobs:
        blob_holdings.record_many(db, list(blobs), provider_id, quota, now)
    wanted = set(tasks_of(db, job_id))
    receipts = receipts or {}
    told = {r.task: receipts[r.task] for r in results
            if r.ok and r.task in wanted and r.task in receipts}
    outputs = arrays.receipted_outputs(db, job, epoch, provider_id, told)
    c = verification.check_row(db, job_id)
    kept = json.loads(c["outputs"] or "{}")
    for refs in outputs.values():
        for ref in refs:
            kept.setdefault(ref["name"], ref)       # a task's first result counts
    db.execute("UPDATE checks SET outputs = ? WHERE id = ?", [json.dumps(kept), job_id])
    for ref in kept.values():
        blob_holdings.refer(db, ref["sha256"], c["top_id"], "evidence")
    return 0


def rerun(db: Database, batch: dict, liar: str, why: str, now: int) -> int:
    """A check found ``liar``'s tasks of this array lease wrong: every task it ran on the
    lease (not only those replayed) goes back to the queue, its outputs forgotten, to run
    again on another provider: no batch of the array goes to ``liar`` again, the
    conviction on record says so (verification.excluded), so the new batches are plain
    first attempts, none of the client's ``max_attempts`` spent. Returns how many."""
    n = db.execute("UPDATE array_tasks SET state = ?, batch_id = NULL, outputs = NULL,"
                   " receipt = NULL, yielded = 0, error = ?, updated_at_ms = ? WHERE"
                   " batch_id = ? AND provider_id = ? AND state = ?",
                   [pb.JOB_STATE_QUEUED, why[:1000], now, batch["id"], liar,
                    SUCCEEDED]).rowcount
    jobs.append_event(db, batch["parent_id"], "check", jobs.job_row(
        db, batch["parent_id"]).state, 1, now, mirror=False,
        message=f"{n} tasks of {batch['id']} run again on another provider: {why}")
    if batch["state"] in jobs.TERMINAL_STATES:
        # (a batch still open gets them new batches when it ends: arrays._batch_ended)
        arrays.follow_batch(db, batch["parent_id"], batch["id"], "disputed", now)
    return n
