"""How an attempt ends without its result: its provider reports it failed, its lease is
lost or given back, its client cancels it, or its spec expires in the queue — and what follows
(queued again for another provider from its latest checkpoint, or failed for good). Each
function runs inside one write transaction (see Store.write), over the rows and events of
``transitions``. No grpc here.
"""

from __future__ import annotations

from sqlite_utils import Database

from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs.job import Job
from gpumarket.broker.jobs.reactions import hooks
from gpumarket.proto.jobspec import TERMINAL_STATES

FAIL_QUORUM = 2     # distinct providers whose reports that a job ran and failed fail it
TAIL_LINES = 5      # lines of a failed job's log shown with its provider's report

def fail(db: Database, job_id: str, epoch: int, provider_id: str, error: str, now: int, *,
         job_ran: bool = True, log_tail: tuple[str, ...] = ()) -> None:
    """The provider reports the job failed: its word, not the client's. The lease ends
    ``failed`` (``lost`` if the job never ran there: the provider failed, not the job) and its
    work since its last settlement is neither paid nor charged; the job is queued again
    (attempt + 1), for another provider first, from its latest checkpoint. It fails only once
    FAIL_QUORUM distinct providers report that it ran and failed (those leases then end
    ``crashed``: the job's own failure, no longer counted against them), or when it has used
    up its attempts. ``log_tail``: the last lines of the job's log, as the provider's signed
    report gave them (shown with its error). A check job fails at once, as a replay that
    could not run (disputes.could_not_run)."""
    job, lease = jobs.current(db, job_id, epoch, provider_id)
    jobs.end_lease(db, lease["id"], "failed" if job_ran else "lost", error, now)
    if job.check_of:
        _give_up(db, job, provider_id, error, now)
        return
    said = (f"{provider_id} reports it failed: {error}" if job_ran
            else f"{provider_id} failed before the job ran: {error}")
    tail = "".join(f"\n    | {line}" for line in log_tail[-TAIL_LINES:])
    reports = provider_failures(db, job_id)
    if len(reports) >= FAIL_QUORUM:
        db.execute("UPDATE leases SET state = 'crashed' WHERE job_id = ? AND state = 'failed'",
                   [job_id])
        _give_up(db, job, provider_id, f"failed on {len(reports)} providers: "
                 + each_error(reports), now, tail)
    elif job.attempt >= job.max_attempts:
        _give_up(db, job, provider_id, f"gave up after {job.attempt} attempts; last: {said}",
                 now, tail)
    else:
        _requeue(db, job, provider_id, said, now, tail)


def provider_failures(db: Database, job_id: str) -> dict[str, str]:
    """The providers that reported that the job ran and failed (leases ``failed``), each with
    its latest error, in the order of those reports."""
    out: dict[str, str] = {}
    for provider_id, reason in db.execute(
            "SELECT provider_id, reason FROM leases WHERE job_id = ? AND state = 'failed'"
            " ORDER BY epoch", [job_id]).fetchall():
        out.pop(provider_id, None)
        out[provider_id] = reason
    return out


def each_error(reports: dict[str, str], limit: int = 2000) -> str:
    """Each provider's reported error, in one line of at most ``limit`` characters."""
    text = "; ".join(f"{p}: {e}" for p, e in reports.items())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _give_up(db: Database, job: Job, provider_id: str, error: str, now: int,
             tail: str = "") -> None:
    """The job fails for good (its failed event says ``error``, then ``tail``)."""
    jobs.set_job(db, job.id, now, state=jobs.FAILED, error=error)
    jobs.drop_checkpoints(db, job.id)
    jobs.append_event(db, job.id, "failed", jobs.FAILED, job.attempt, now,
                 provider_id=provider_id, message=error + tail)
    if job.sort == "check":
        hooks().check_failed(db, job.id, error, now)


def _requeue(db: Database, job: Job, provider_id: str, why: str, now: int,
             tail: str = "") -> None:
    """Queue the job again after a lease of it ended without its result: attempt + 1, from
    its latest checkpoint, for another provider first (scheduler.place_queued); its event
    says ``why``, then ``tail``."""
    attempt = job.attempt + 1
    jobs.set_job(db, job.id, now, state=jobs.QUEUED, attempt=attempt, provider_id=None, lease_id=None)
    if job.sort == "replica":
        # A replica is ready again only once its next lease's engine says so (the autoscaler
        # gives up on a lease that is not ready within cold_start).
        jobs.set_job(db, job.id, now, progress_step=0)
    if job.sort == "check":
        hooks().check_requeued(db, job.id)
    resume = (f"resumes from step {job.checkpoint_step}" if job.resume_from
              else "starts over (no checkpoint yet)")
    jobs.append_event(db, job.id, "requeued", jobs.QUEUED, attempt, now, provider_id=provider_id,
                 message=f"{why}; attempt {attempt} {resume}{tail}")


def cancel(db: Database, job_id: str, client_id: str, now: int
           ) -> tuple[int, list[jobs.EndedLease]]:
    """Cancel the job (all its parts, if split) for its client; return (new state, the
    leases to revoke)."""
    job = jobs.job_row(db, job_id)
    if job.client_id != client_id or job.check_of:
        raise jobs.no_such_job(job_id)   # the same answer as for a job that does not exist
    if job.state in TERMINAL_STATES:
        return job.state, []
    ended: list[jobs.EndedLease] = []
    parts = jobs.parts_of(db, job_id) if job.parts and not job.part else []
    if job.tasks and not job.parent_id:
        hooks().array_cancelled(db, job_id, now)
    for row in [*parts, job]:
        if row.state in TERMINAL_STATES:
            continue
        if row.state in jobs.ACTIVE_STATES and row.lease_id:
            jobs.stop_lease(db, row, "cancelled", "cancelled by client", now)
            ended.append(jobs.EndedLease(row.id, row.epoch, row.provider_id))
        jobs.set_job(db, row.id, now, state=jobs.CANCELLED, error="cancelled by client")
        jobs.drop_checkpoints(db, row.id)
        ended += jobs.append_event(db, row.id, "cancelled", jobs.CANCELLED, row.attempt, now,
                              message="cancelled by client",
                              mirror=row is job and bool(job.parent_id))
    return jobs.CANCELLED, ended


def lose_lease(db: Database, lease_id: str, reason: str, now: int, *,
               outcome: str = "lost") -> bool:
    """End an active lease (``lost``, or ``released`` by its provider); requeue its job with
    attempt + 1 to resume from its latest checkpoint, or fail it past its attempt limit.

    Returns False when the lease was no longer active (nothing changed).
    """
    row = db.execute(
        "SELECT job_id, epoch, provider_id, state FROM leases WHERE id = ?", [lease_id]
    ).fetchone()
    if row is None or row[3] != "active":
        return False
    job_id, epoch, provider_id, _ = row
    jobs.end_lease(db, lease_id, outcome, reason, now)
    job = jobs.job_row(db, job_id)
    if job.epoch != epoch or job.state not in jobs.ACTIVE_STATES:
        return True
    if job.attempt >= job.max_attempts:
        _give_up(db, job, provider_id, f"gave up after {job.attempt} attempts; last:"
                 f" {reason}", now)
        return True
    what = outcome if outcome in ("released", "rejected") else "lost"
    _requeue(db, job, provider_id, f"lease {what} ({reason})", now)
    return True


def release(db: Database, job_id: str, epoch: int, provider_id: str, reason: str,
            now: int, outcome: str = "released") -> None:
    """The lease holder gives the job back (drain, or refused); it is queued again at once."""
    _, lease = jobs.current(db, job_id, epoch, provider_id)
    lose_lease(db, lease["id"], reason, now, outcome=outcome)


def expire_queued(db: Database, now: int) -> list[str]:
    """Fail jobs.QUEUED (and jobs.PAUSED) jobs whose spec expired before a provider could take them."""
    rows = db.execute(
        "SELECT id, attempt, state, check_of FROM jobs WHERE state IN (?, ?)"
        " AND expires_at_ms <= ?", [jobs.QUEUED, jobs.PAUSED, now]).fetchall()
    for job_id, attempt, state, check_of in rows:
        error = ("job spec expired while the job was paused (its hold spent)" if state == jobs.PAUSED
                 else "job spec expired before a provider could run it")
        jobs.set_job(db, job_id, now, state=jobs.FAILED, error=error)
        jobs.drop_checkpoints(db, job_id)
        jobs.append_event(db, job_id, "failed", jobs.FAILED, attempt, now, message=error)
        if check_of:
            hooks().check_failed(db, job_id, error, now)
    return [r[0] for r in rows]
