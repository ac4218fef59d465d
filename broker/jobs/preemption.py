"""Preemption as rows: an interruptible lease asked to yield its devices to a job of a higher
tier, and its end, PREEMPTED (docs/broker.md, Preemption). Each function runs inside one write
transaction (Store.write), as in transitions. No grpc here.

A preempted lease is neither lost nor failed: it does not count against its provider's
record (views.histories counts ``lost`` and ``failed``) nor the job's attempts (the job is
queued again with the same attempt number). Its work since its last checkpoint is neither
paid nor charged, as for any lease that ends without its result: the job pays up to its
last checkpoint (settled when it came), the provider is paid for the time up to there, and
the interval after it is the provider's loss, which its interruptible price prices in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gpumarket.broker.checks import verification
from gpumarket.broker.jobs import endings
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs.job import Job, update_job
from gpumarket.proto.errors import FailedPrecondition
from gpumarket.proto.v1 import types_pb2 as pb
from sqlite_utils import Database


@dataclass(frozen=True)
class Interruptible:
    """An active lease of an interruptible job, as the scheduler weighs it."""

    lease_id: str
    job_id: str
    epoch: int
    provider_id: str
    devices: tuple[int, ...]
    unsaved_ms: int                  # run since its last checkpoint (what a preemption loses)
    preempt_for: str                 # the job it yields to; "" = not asked to yield
    for_waiting: bool = True         # the job it yields to still waits for it (is queued)


def interruptible_leases(db: Database, now: int) -> list[Interruptible]:
    """The active leases of interruptible jobs (a spot check's excepted: it stays where its
    checker was drawn), with the work each has not checkpointed yet, and, for one yielding,
    whether the job it yields to is still queued (one that is not, a replica leased the
    first device another lease freed, leaves this one's devices to whoever waits next)."""
    rows = db.execute(
        "SELECT l.id, l.job_id, l.epoch, l.provider_id, l.device_indices,"
        " coalesce(j.settled_to_ms, l.started_at_ms, l.issued_at_ms),"
        " coalesce(l.preempt_for, ''), EXISTS (SELECT 1 FROM jobs w WHERE w.id = l.preempt_for"
        " AND w.state = ?) FROM leases l JOIN jobs j ON j.id = l.job_id"
        " AND j.lease_id = l.id WHERE l.state = 'active' AND j.check_of IS NULL"
        " AND json_extract(j.needs, '$.tier') = 'interruptible'",
        [pb.JOB_STATE_QUEUED]).fetchall()
    return [Interruptible(r[0], r[1], r[2], r[3], tuple(json.loads(r[4])),
                          max(0, now - (r[5] or now)), r[6], bool(r[7])) for r in rows]


def waiting_for(db: Database) -> set[str]:
    """The jobs some lease is yielding its devices to now."""
    return {r[0] for r in db.execute("SELECT DISTINCT preempt_for FROM leases WHERE"
                                     " state = 'active' AND preempt_for IS NOT NULL")}


def preempt(db: Database, lease_id: str, for_job_id: str, tier: str, grace_s: int,
            now: int) -> jobs.EndedLease | None:
    """Ask an active interruptible lease to yield its devices to ``for_job_id`` (of ``tier``):
    the lease is marked, the job's event says so; returns the lease to tell its provider, or
    None if it is no longer active or is yielding already. Raises FailedPrecondition for a
    lease whose job is not interruptible (a standard lease is never preempted)."""
    lease = jobs.lease_row(db, lease_id)
    job = jobs.job_row(db, lease["job_id"])
    if lease["state"] != "active" or lease["preempt_for"] or job.lease_id != lease_id \
            or job.state not in jobs.ACTIVE_STATES:
        return None
    if tier_of(job) != "interruptible":
        raise FailedPrecondition(f"job {job.id} is not interruptible: its lease is never"
                                 " preempted")
    db.execute("UPDATE leases SET preempt_for = ?, preempt_at_ms = ? WHERE id = ?",
               [for_job_id, now, lease_id])
    jobs.append_event(db, job.id, "preempting", job.state, job.attempt, now,
                      provider_id=lease["provider_id"], mirror=False,
                      message=f"preempted by a {tier} job: checkpoint within {grace_s} s, then"
                      " resume from it (this costs the job nothing)")
    return jobs.EndedLease(job.id, lease["epoch"], lease["provider_id"])


def retarget(db: Database, lease_id: str, from_job_id: str, for_job_id: str, tier: str,
             now: int) -> bool:
    """A lease yielding to ``from_job_id``, which no longer waits for it, yields to
    ``for_job_id`` (a replica or a standard job waiting now, of ``tier``) instead: nothing
    new is preempted, its grace period runs on from when it was asked. False if it is no
    longer active or yields to another job by now."""
    done = db.execute("UPDATE leases SET preempt_for = ? WHERE id = ? AND state = 'active'"
                      " AND preempt_for = ?", [for_job_id, lease_id, from_job_id]).rowcount
    if done:
        lease = jobs.lease_row(db, lease_id)
        job = jobs.job_row(db, lease["job_id"])
        jobs.append_event(db, job.id, "preempting", job.state, job.attempt, now,
                          provider_id=lease["provider_id"], mirror=False,
                          message=f"its devices go to {for_job_id} ({tier}) instead: the job"
                          f" it was yielding to, {from_job_id}, no longer waits for them")
    return bool(done)


def tier_of(job: Job) -> str:
    return json.loads(job.needs).get("tier", "standard")


def end(db: Database, lease_id: str, reason: str, now: int) -> bool:
    """End a lease asked to yield: PREEMPTED (``preempted``), its job queued again from its
    latest checkpoint with the same attempt number. False if it was no longer active."""
    lease = jobs.lease_row(db, lease_id)
    if lease["state"] != "active":
        return False
    jobs.end_lease(db, lease_id, "preempted", reason, now)
    job = jobs.job_row(db, lease["job_id"])
    if job.epoch != lease["epoch"] or job.state not in jobs.ACTIVE_STATES:
        return True
    jobs.set_job(db, job.id, now, state=pb.JOB_STATE_QUEUED, provider_id=None,
                 lease_id=None)
    if job.check_of:
        verification.requeued(db, job.id)
    resume = (f"resumes from step {job.checkpoint_step}" if job.resume_from
              else "starts over (no checkpoint yet)")
    jobs.append_event(db, job.id, "requeued", pb.JOB_STATE_QUEUED, job.attempt, now,
                      provider_id=lease["provider_id"],
                      message=f"lease preempted ({reason}); {resume}; not counted as an"
                      f" attempt (still attempt {job.attempt})")
    return True


def release(db: Database, job_id: str, epoch: int, provider_id: str, reason: str,
            now: int) -> None:
    """The provider gives a lease back (JobReleased): a lease asked to yield ends PREEMPTED;
    any other as endings.release says (a provider cannot make its own release, or a
    failure, look like a preemption: only the broker marks one)."""
    _, lease = jobs.current(db, job_id, epoch, provider_id)
    if lease["preempt_for"]:
        end(db, lease["id"], reason, now)
        return
    endings.release(db, job_id, epoch, provider_id, reason, now)


def freed_for_waiting(db: Database, since_ms: int
                      ) -> list[tuple[str, str, tuple[int, ...], int]]:
    """Devices that leases preempted for a job since ``since_ms`` freed, while that job is
    still queued and another of its provider's leases still yields to it: (job, provider,
    devices, the job's devices wanted) per ended lease."""
    rows = db.execute(
        "SELECT l.preempt_for, l.provider_id, l.device_indices, json_extract(j.needs, '$.gpus')"
        " FROM leases l JOIN jobs j ON j.id = l.preempt_for WHERE l.state = 'preempted'"
        " AND l.preempt_at_ms >= ? AND j.state = ? AND EXISTS (SELECT 1 FROM leases a"
        " WHERE a.state = 'active' AND a.preempt_for = l.preempt_for"
        " AND a.provider_id = l.provider_id)", [since_ms, pb.JOB_STATE_QUEUED]).fetchall()
    return [(r[0], r[1], tuple(json.loads(r[2])), int(r[3] or 1)) for r in rows]


def overdue(db: Database, before_ms: int) -> list[tuple[str, str, int, str]]:
    """Leases asked to yield before ``before_ms`` that are still active: (lease, job, epoch,
    provider) each (the broker ends them itself)."""
    return [tuple(r) for r in db.execute(
        "SELECT id, job_id, epoch, provider_id FROM leases WHERE state = 'active'"
        " AND preempt_for IS NOT NULL AND preempt_at_ms < ?", [before_ms]).fetchall()]


def deadline_jobs(db: Database) -> list[Job]:
    """Interruptible jobs with a deadline that have not ended (queued, leased or running):
    the ones a deadline may promote."""
    cur = db.execute(
        "SELECT * FROM jobs WHERE state IN (?, ?, ?) AND NOT (parts > 0 AND part = 0)"
        " AND json_extract(needs, '$.tier') = 'interruptible'"
        " AND CAST(json_extract(needs, '$.deadline_s') AS REAL) > 0",
        [pb.JOB_STATE_QUEUED, pb.JOB_STATE_LEASED, pb.JOB_STATE_RUNNING])
    cols = [d[0] for d in cur.description]
    return [Job.from_row(dict(zip(cols, r))) for r in cur.fetchall()]


def promote(db: Database, job_id: str, why: str, now: int,
            lease_price: float | None = None) -> bool:
    """Move an interruptible job to the standard tier (its deadline is near): from now on
    its lease is not preempted and pays the standard price — its running lease
    ``lease_price`` (its provider's standard price) from its last settlement on, its next
    lease the standard price of wherever it runs. False if it is not interruptible (any
    more)."""
    job = jobs.job_row(db, job_id)
    needs = json.loads(job.needs)
    if needs.get("tier") != "interruptible":
        return False
    needs["tier"], needs["promoted"] = "standard", True
    update_job(db, job_id, None, needs=json.dumps(needs, sort_keys=True))
    repriced = ""
    if lease_price is not None and job.lease_id:
        db.execute("UPDATE leases SET price_per_gpu_hour = ? WHERE id = ? AND state = 'active'",
                   [lease_price, job.lease_id])
        repriced = f"; its lease now pays {lease_price:g}/GPU-hour from its last checkpoint"
    jobs.append_event(db, job_id, "promoted", job.state, job.attempt, now,
                      mirror=False, message=f"moved to the standard tier: {why}{repriced}")
    return True
