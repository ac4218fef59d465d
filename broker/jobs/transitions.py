"""The job and lease state machine. Each function runs inside one write transaction
(see Store.write) and appends the events it causes, so a state change and its
event are never apart. No grpc here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlite_utils import Database

from gpumarket.broker.checks.policy import OFF, Policy
from gpumarket.broker.jobs import job as rows
from gpumarket.broker.jobs.job import Job, LeaseTerms
from gpumarket.broker.jobs.reactions import hooks
from gpumarket.broker.market import calibration
from gpumarket.broker.market.admission import NewJob
from gpumarket.broker.money import credit_holds
from gpumarket.broker.money import ledger
from gpumarket.broker.store import blob_holdings
from gpumarket.proto.errors import (
    FailedPrecondition, InvalidArgument, NotFound, Replay,
)
from gpumarket.proto.jobspec import TERMINAL_STATES, state_name
from gpumarket.proto.v1 import types_pb2 as pb

QUEUED = pb.JOB_STATE_QUEUED
LEASED = pb.JOB_STATE_LEASED
RUNNING = pb.JOB_STATE_RUNNING
SUCCEEDED = pb.JOB_STATE_SUCCEEDED
FAILED = pb.JOB_STATE_FAILED
CANCELLED = pb.JOB_STATE_CANCELLED
PAUSED = pb.JOB_STATE_PAUSED
VERIFYING = pb.JOB_STATE_VERIFYING
ACTIVE_STATES = (LEASED, RUNNING)


@dataclass(frozen=True)
class EndedLease:
    """What the caller must tell a provider after a lease ended on the broker's side."""

    job_id: str
    epoch: int
    provider_id: str


def append_event(
    db: Database,
    job_id: str,
    type_: str,
    state: int,
    attempt: int,
    now: int,
    *,
    provider_id: str = "",
    message: str = "",
    progress: dict | None = None,
    mirror: bool = True,
    job: Job | None = None,
) -> list[EndedLease]:
    """Append a job event. An event of a split job's part also updates the parent (its
    state follows its parts) and is repeated on it; returns the leases of sibling parts
    that this ended (a part failed or was cancelled), to tell their providers. ``job``: the
    job as read in this transaction, where the caller has it (only what never changes of it,
    its sort and place, is used: not read again)."""
    rows.insert_event(db, job_id, type_, state, attempt, now, provider_id=provider_id,
                      message=message, progress=progress)
    if not mirror or type_ == "submitted":
        return []
    if job is None:
        job = job_row(db, job_id)
    if job.sort == "batch":     # a batch of a job array: its tasks follow it, and the array them
        hooks().batch_moved(db, job.top_id, job_id, type_, now)
    elif job.sort == "replica":
        # An endpoint does not follow its replicas' states: it notes their moves.
        if type_ not in ("progress", "checkpoint"):
            top = job_row(db, job.top_id)
            append_event(db, top.id, "replica", top.state, top.attempt, now,
                         provider_id=provider_id, message=f"replica {job.part} {type_}: {message}",
                         mirror=False)
    elif job.sort == "part":
        return _follow_parts(db, job.top_id, now, f"part {job.part}/{job.parts}: {message}",
                             type_, provider_id)
    return []


# The event type a split job gets when its parts move it into a state.
PARENT_EVENT = {QUEUED: "requeued", LEASED: "leased", RUNNING: "started",
                SUCCEEDED: "succeeded", FAILED: "failed", CANCELLED: "cancelled",
                PAUSED: "paused", VERIFYING: "verifying"}


def parts_of(db: Database, parent_id: str) -> list[Job]:
    """The rows under a top job (a split job's parts, an array's batches, an endpoint's
    replicas), by number."""
    cur = db.execute("SELECT * FROM jobs WHERE parent_id = ? ORDER BY part", [parent_id])
    cols = [d[0] for d in cur.description]
    return [Job.from_row(dict(zip(cols, r))) for r in cur.fetchall()]


def _follow_parts(db: Database, parent_id: str, now: int, message: str, type_: str,
                  provider_id: str) -> list[EndedLease]:
    """Set a split job's state from its parts: failed or cancelled if one part is (the
    others are stopped), succeeded when all are, else running, leased or queued."""
    parent = job_row(db, parent_id)
    if parent.state in TERMINAL_STATES:
        return []
    parts = parts_of(db, parent_id)
    states = [p.state for p in parts]
    failed = next((p for p in parts if p.state == FAILED), None)
    ended: list[EndedLease] = []
    error = ""
    if failed is not None or CANCELLED in states:
        state = FAILED if failed is not None else CANCELLED
        error = (f"part {failed.part}/{failed.parts} failed: {failed.error}"
                 if failed is not None else "a part was cancelled")
        for p in parts:
            if p.state in TERMINAL_STATES:
                continue
            if p.state in ACTIVE_STATES and p.lease_id:
                stop_lease(db, p, "cancelled", error, now)
                ended.append(EndedLease(p.id, p.epoch, p.provider_id))
            set_job(db, p.id, now, state=CANCELLED, error=error)
            drop_checkpoints(db, p.id)
            append_event(db, p.id, "cancelled", CANCELLED, p.attempt, now,
                         message=f"stopped: {error}", mirror=False)
    elif all(s == SUCCEEDED for s in states):
        state = SUCCEEDED
    elif all(s in (SUCCEEDED, VERIFYING) for s in states):
        state = VERIFYING
    elif RUNNING in states:
        state = RUNNING
    elif LEASED in states:
        state = LEASED
    elif PAUSED in states:
        state = PAUSED
    else:
        state = QUEUED
    step = sum(p.progress_step for p in parts)
    reason = next((p.queue_reason for p in parts if p.state == QUEUED), "")
    attempt = max(p.attempt for p in parts)
    set_job(db, parent_id, now, state=state, progress_step=step, attempt=attempt,
             error=error, queue_reason=reason)
    if type_ == "progress" and state == parent.state:
        append_event(db, parent_id, "progress", state, attempt, now, provider_id=provider_id,
                     progress={"step": step, "total": parent.progress_total, "metrics": {}})
    else:
        changed = state != parent.state
        append_event(db, parent_id, PARENT_EVENT[state] if changed else "part", state, attempt,
                     now, provider_id=provider_id, message=message)
    return ended


def no_such_job(job_id: str) -> NotFound:
    """The one answer for a job that does not exist and for another client's: nobody learns
    which job ids exist."""
    return NotFound(f"no job {job_id!r}")


def job_row(db: Database, job_id: str) -> Job:
    """Return the job; raise NotFound."""
    cur = db.execute("SELECT * FROM jobs WHERE id = ?", [job_id])
    row = cur.fetchone()
    if row is None:
        raise no_such_job(job_id)
    return Job.from_row(dict(zip([d[0] for d in cur.description], row)))


def set_job(db: Database, job_id: str, now: int, **values: object) -> None:
    """Change a job's row (jobs/job.update_job); a job that ends gives back its hold."""
    rows.update_job(db, job_id, now, **values)
    if values.get("state") in TERMINAL_STATES:
        # A job that ended (a whole job, or a split job once its parts did) gives back
        # what its hold has left, in the same transaction.
        row = db.execute("SELECT client_id FROM jobs WHERE id = ? AND parent_id IS NULL"
                         " AND check_of IS NULL", [job_id]).fetchone()
        if row is not None:
            # Its checks end with it (their checkers paid up to now), before the hold goes.
            hooks().job_ended(db, job_id, values["state"] == FAILED, now)
            ledger.release(db, job_id, row[0], now)


# What every child row inherits from the row it is made for: whose it is, what it runs, on
# what terms. What a sort changes, and why, is in ``spawn``.
INHERITED = ("client_id", "kind", "spec", "spec_sha256", "needs", "expires_at_ms",
             "max_attempts", "fee_ppm", "enforce_funds", "hold_basis")
FAR_FUTURE_MS = 100 * 365 * 86_400_000      # a replica is made when needed: never expires
CHECK_ATTEMPTS = 3                          # a replay that cannot run is a check not made


def spawn(db: Database, of: Mapping[str, Any], sort: str, child_id: str, name: str, now: int,
          **fields: object) -> None:
    """Insert a QUEUED child row of ``of`` — the one place a job row is made besides
    ``submit``. Its sort:

    - ``part`` of a split job, ``batch`` of a job array's tasks: a child of ``of``
      (``parent_id``), inheriting everything;
    - ``replica`` of an endpoint: a child that never expires queued (made when needed);
    - ``check``: a replay of ``of``'s segment, a job of its own (``check_of``, no parent),
      paid from the top job's hold (``pays_from``; no hold of its own), with its own
      attempts.

    ``fields``: the row's own values (``part``, ``tasks``, the progress it starts from, ...),
    set last."""
    row = {k: of[k] for k in INHERITED}
    row.update(id=child_id, name=name, state=QUEUED, attempt=1, epoch=0,
               created_at_ms=now, updated_at_ms=now)
    if sort in ("part", "batch", "replica"):
        row["parent_id"] = of["id"]
        if sort == "replica":
            row.update(parts=0, expires_at_ms=now + FAR_FUTURE_MS)
    elif sort == "check":
        row.update(check_of=of["id"], pays_from=of["parent_id"] or of["id"],
                   part=of["part"], parts=of["parts"], max_attempts=CHECK_ATTEMPTS,
                   hold_basis="")
    else:
        raise ValueError(f"no such sort of job row: {sort!r}")
    row.update(fields)
    rows.insert_job(db, row)


def submit(db: Database, job: NewJob, now: int) -> None:
    """Store a new QUEUED job; raise Replay if its nonce was used before."""
    # Both checks and the balance its hold draws on, in one read (a round trip on PostgreSQL).
    seen, exists, balance = db.execute(
        "SELECT (SELECT job_id FROM nonces WHERE signer_id = ? AND nonce = ?),"
        f" EXISTS (SELECT 1 FROM jobs WHERE id = ?), ({ledger.BALANCE})",
        [job.client_id, job.nonce, job.id, ledger.client(job.client_id)]).fetchone()
    if seen is not None:
        raise Replay(f"this signed spec was already submitted as job {seen} (nonce reused)")
    if exists:
        raise Replay(f"job {job.id} already exists")
    db["nonces"].insert({"signer_id": job.client_id, "nonce": job.nonce,
                         "expires_at_ms": job.expires_at_ms, "job_id": job.id})
    row = {
        "id": job.id, "client_id": job.client_id, "name": job.name, "kind": job.kind,
        "state": QUEUED, "spec": job.spec, "spec_sha256": job.spec_sha256,
        "needs": job.needs.to_json(), "expires_at_ms": job.expires_at_ms, "attempt": 1,
        "max_attempts": job.max_attempts, "epoch": 0, "created_at_ms": now,
        "updated_at_ms": now, "fee_ppm": job.fee_ppm, "enforce_funds": int(job.enforce_funds),
        "hold_basis": job.hold_basis,
    }
    if len(job.part_sizes) > 1:
        row.update(parts=len(job.part_sizes), progress_total=sum(job.part_sizes))
    rows.insert_job(db, row)
    for i, size in enumerate(job.part_sizes if len(job.part_sizes) > 1 else (), 1):
        part_id = f"{job.id}-{i}"
        spawn(db, row, "part", part_id, f"{job.name} part {i}", now, part=i,
              parts=row["parts"], progress_total=size)
        append_event(db, part_id, "submitted", QUEUED, 1, now,
                     message=f"part {i}/{len(job.part_sizes)} of job {job.id}")
    for sha in set(job.inputs):
        blob_holdings.refer(db, sha, job.id, "input")
    ledger.hold(db, job.id, job.client_id, job.hold, job.hold_basis, job.enforce_funds, now,
                read=(balance,))
    append_event(db, job.id, "submitted", QUEUED, 1, now,
                 message=f"submitted by {job.client_id}; {ledger.fmt(job.hold)} credits held"
                 f" ({job.hold_basis})")


def create_lease(db: Database, terms: LeaseTerms, now: int,
                 sign: Callable[[pb.Lease], pb.Envelope], job: Job | None = None) -> pb.Envelope:
    """Lease a QUEUED job to a provider on ``terms``; return the signed Lease envelope.
    Raises FailedPrecondition if the job is no longer QUEUED. ``job``: its row as read in
    this transaction, where the caller read several at once (placement.write_leases)."""
    if job is None:
        job = job_row(db, terms.job_id)
    lease = _lease(db, terms, now, job)
    envelope = sign(lease)
    db["leases"].insert(_lease_row(lease, terms, envelope, job))
    set_job(db, job.id, now, **_leased_columns(lease, job))
    append_event(db, job.id, "leased", LEASED, lease.attempt, now, provider_id=lease.provider_id,
                 message=_leased_message(lease, job), job=job)
    return envelope


def create_leases(db: Database, leases: list[tuple[LeaseTerms, Job]], now: int,
                  sign: Callable[[pb.Lease], pb.Envelope]) -> list[pb.Envelope | None]:
    """``create_lease`` for each (terms, job as read in this transaction), in order; return
    each one's envelope, None where the job is no longer QUEUED. The same rows as one
    ``create_lease`` each (tests/test_pg_bulk_leases.py compares them), written in three
    statements for the plain jobs among them — a lease's row, its job's row, its event; no
    reaction — where a statement each would be three a lease; the sorts a lease moves more
    for (parts, batches, replicas, checks) go through ``create_lease`` one by one."""
    made: list[pb.Envelope | None] = []
    plain: list[tuple[pb.Lease, LeaseTerms, pb.Envelope, Job]] = []
    for terms, job in leases:
        try:
            if job.sort != "job" or job.tasks or job.parts:
                made.append(create_lease(db, terms, now, sign, job))
                continue
            lease = _lease(db, terms, now, job)
        except FailedPrecondition:
            made.append(None)
            continue
        made.append(sign(lease))
        plain.append((lease, terms, made[-1], job))
    if plain:
        db["leases"].insert_all([_lease_row(*p) for p in plain])
        rows.update_jobs(db, {job.id: _leased_columns(lease, job)
                              for lease, _, _, job in plain}, now)
        rows.insert_events(db, [(job.id, now, "leased", LEASED, lease.attempt, lease.provider_id,
                                 _leased_message(lease, job), None)
                                for lease, _, _, job in plain])
    return made


def _lease(db: Database, terms: LeaseTerms, now: int, job: Job) -> pb.Lease:
    """The Lease of ``job`` on ``terms``, unsigned; raises FailedPrecondition if the job is
    no longer QUEUED. A check's scope is recorded as it is made (hooks().check_leased)."""
    if job.state != QUEUED:
        raise FailedPrecondition(f"job {job.id} is {state_name(job.state)}, not QUEUED")
    epoch = job.epoch + 1
    lease = pb.Lease(
        lease_id=f"{job.id}.{epoch}", job_id=job.id, attempt=job.attempt, epoch=epoch,
        provider_id=terms.provider_id, client_id=job.client_id,
        price_per_gpu_hour=terms.price_per_gpu_hour, checkpoint_every=terms.checkpoint_every,
        device_indices=list(terms.device_indices), issued_at_ms=now,
        expires_at_ms=now + terms.accept_within_ms, provider_mtbf_s=terms.provider_mtbf_s,
        checkpoint_interval_s=terms.checkpoint_interval_s,
        part=0 if job.tasks else job.part,
        parts=job.parts if job.part and not job.tasks else 0,
        tasks=hooks().batch_tasks(db, job.id) if job.sort in ("batch", "check") else (),
    )
    if job.resume_from:
        lease.resume_from.CopyFrom(pb.ArtifactRef(**json.loads(job.resume_from)))
    if job.sort == "check":
        lease.check.CopyFrom(hooks().check_leased(db, job.id, terms.provider_id, now))
    lease.job_spec.ParseFromString(job.spec)
    return lease


def _lease_row(lease: pb.Lease, terms: LeaseTerms, envelope: pb.Envelope, job: Job) -> dict:
    """The ``leases`` row of a lease just made."""
    return {"id": lease.lease_id, "job_id": job.id, "attempt": lease.attempt,
            "epoch": lease.epoch, "provider_id": lease.provider_id,
            "device_indices": json.dumps(list(terms.device_indices)),
            "price_per_gpu_hour": terms.price_per_gpu_hour, "state": "active",
            "issued_at_ms": lease.issued_at_ms, "renewed_at_ms": lease.issued_at_ms,
            "envelope": envelope.SerializeToString(), "raw_runtime_s": terms.raw_runtime_s,
            "start_step": job.checkpoint_step if job.resume_from else 0,
            "accelerator": terms.accelerator}


def _leased_columns(lease: pb.Lease, job: Job) -> dict[str, object]:
    """What a lease changes on its job's row."""
    return {"state": LEASED, "epoch": lease.epoch, "provider_id": lease.provider_id,
            "lease_id": lease.lease_id, "queue_reason": "", "settled_to_ms": None,
            "settled_step": job.checkpoint_step if job.resume_from else 0}


def _leased_message(lease: pb.Lease, job: Job) -> str:
    resume = f", resuming from step {job.checkpoint_step}" if job.resume_from else ""
    return (f"leased to {lease.provider_id} at {lease.price_per_gpu_hour:g}/GPU-hour"
            f" (attempt {lease.attempt}{resume})")


def current(db: Database, job_id: str, epoch: int, provider_id: str) -> tuple[Job, dict]:
    """Return (job, lease) if ``provider_id`` holds the job's current active lease."""
    job = job_row(db, job_id)
    row = db.execute(
        "SELECT * FROM leases WHERE job_id = ? AND epoch = ?", [job_id, epoch]
    ).fetchone()
    cols = [d[0] for d in db.execute("SELECT * FROM leases LIMIT 0").description]
    lease = dict(zip(cols, row)) if row else None
    if lease is None or lease["provider_id"] != provider_id:
        raise FailedPrecondition(f"job {job_id}: no lease of epoch {epoch} held by this provider")
    if job.epoch != epoch or lease["state"] != "active" or job.state not in ACTIVE_STATES:
        raise FailedPrecondition(
            f"job {job_id}: lease epoch {epoch} is stale (job is {state_name(job.state)},"
            f" current epoch {job.epoch})"
        )
    return job, lease


def mark_started(db: Database, job_id: str, epoch: int, provider_id: str, now: int,
                 resumed_from_step: int = 0) -> None:
    job, lease = current(db, job_id, epoch, provider_id)
    db.execute("UPDATE leases SET started_at_ms = coalesce(started_at_ms, ?), renewed_at_ms = ?"
               " WHERE id = ?", [now, now, lease["id"]])
    rows.start_billing(db, job_id, now)      # (once: a re-attach changes nothing)
    if job.state == LEASED:
        set_job(db, job_id, now, state=RUNNING)
        where = f", resumed from step {resumed_from_step}" if resumed_from_step else ""
        append_event(db, job_id, "started", RUNNING, job.attempt, now,
                     provider_id=provider_id, message=f"running on {provider_id}{where}")


def record_progress(
    db: Database, job_id: str, epoch: int, provider_id: str, progress: pb.Progress, now: int
) -> None:
    job, _ = current(db, job_id, epoch, provider_id)
    metrics = dict(progress.metrics)
    set_job(db, job_id, now, progress_step=progress.step, progress_total=progress.total,
             progress_metrics=json.dumps(metrics))
    append_event(db, job_id, "progress", job.state, job.attempt, now,
                 provider_id=provider_id,
                 progress={"step": progress.step, "total": progress.total, "metrics": metrics})


def record_checkpoint(
    db: Database, job_id: str, epoch: int, provider_id: str, step: int, artifact: pb.ArtifactRef,
    write_seconds: float, now: int, policy: Policy = OFF,
) -> bool | str:
    """Make a stored, hash-checked checkpoint the job's latest and settle the lease's work up
    to it; False if it is not newer. A job whose hold would not cover another segment like
    this one is paused here: then it returns "paused" (the caller tells the provider to stop).

    Raises InvalidArgument unless this provider uploaded the artifact intact (its hash was
    checked when the upload finished): naming a blob it only saw referenced is not enough.
    """
    job, lease = current(db, job_id, epoch, provider_id)
    if not blob_holdings.holds_intact(db, provider_id, artifact.sha256, artifact.size_bytes):
        raise InvalidArgument(f"checkpoint at step {step} was not uploaded intact by this"
                              " provider")
    if step <= job.checkpoint_step:
        return False
    ref = {"name": artifact.name, "sha256": artifact.sha256, "size_bytes": artifact.size_bytes}
    # The measured cost feeds the next lease's interval; smooth it over checkpoints.
    cost = job.checkpoint_seconds
    cost = write_seconds if cost <= 0 else 0.7 * cost + 0.3 * write_seconds
    set_job(db, job_id, now, resume_from=json.dumps(ref), checkpoint_step=step,
             checkpoint_seconds=cost)
    db.execute("DELETE FROM artifact_refs WHERE job_id = ? AND role = 'checkpoint'", [job_id])
    blob_holdings.refer(db, artifact.sha256, job_id, "checkpoint")
    paid = ledger.settle(db, job, lease, step, now)
    rows.update_job(db, job_id, None, hold_needed=0)
    hooks().checkpoint_stored(db, policy, job, lease, step, ref, now)
    append_event(db, job_id, "checkpoint", job.state, job.attempt, now,
                 provider_id=provider_id,
                 message=f"checkpoint at step {step} stored ({artifact.sha256[:12]}, "
                 f"{artifact.size_bytes} bytes, written in {write_seconds:.2f}s);"
                 f" {ledger.fmt(paid.paid)} credits settled")
    finished = job.progress_total and step >= job.progress_total
    if job.enforce_funds and not finished and not job.check_of and \
            paid.remaining - _siblings_accrued(db, job, now) < max(paid.amount, 1):
        _pause(db, job, lease, now, max(paid.amount, _resume_floor(lease)),
               "another segment like the last")
        return "paused"
    return True


def _siblings_accrued(db: Database, job: Job, now: int) -> int:
    """What the other running parts of a split job have cost since their last settlements:
    they draw on the same hold."""
    if not job.parent_id:
        return 0
    total = 0
    for part in parts_of(db, job.parent_id):
        if part.id != job.id and part.state in ACTIVE_STATES and part.lease_id:
            total += ledger.accrued(part, lease_row(db, part.lease_id), now)
    return total


def _resume_floor(lease: dict) -> int:
    return credit_holds.floor_units(lease["price_per_gpu_hour"], len(json.loads(lease["device_indices"])))


def _pause(db: Database, job: Job, lease: dict, now: int, needed: int, what: str) -> None:
    """The job's hold would not pay for more work: end the lease where it was settled last and
    wait for a top-up that brings the hold to ``needed`` units (it resumes from its latest
    checkpoint)."""
    end_lease(db, lease["id"], "paused", "hold exhausted", now)
    top = job.parent_id or job.id
    left = ledger.balance(db, ledger.escrow(top))
    why = (f"paused: its hold has {ledger.fmt(left)} credits left, {ledger.fmt(needed - left)}"
           f" short of {what} (gpumarket topup {top} AMOUNT)")
    set_job(db, job.id, now, state=PAUSED, provider_id=None, lease_id=None,
             queue_reason=why, hold_needed=needed)
    append_event(db, job.id, "paused", PAUSED, job.attempt, now,
                 provider_id=lease["provider_id"], message=why)


def lease_row(db: Database, lease_id: str) -> dict:
    cur = db.execute("SELECT * FROM leases WHERE id = ?", [lease_id])
    return dict(zip([d[0] for d in cur.description], cur.fetchone()))


def stop_lease(db: Database, job: Job, state: str, reason: str, now: int) -> None:
    """End the job's active lease for a reason that is not its provider's fault (its client
    cancelled it, a sibling part failed, it was retired): its work since the last settlement
    is paid up to now, as far as the hold goes. (A failed attempt is not: ``fail``.)"""
    lease = lease_row(db, job.lease_id)
    ledger.settle(db, job, lease, job.settled_step, now, tag="end")
    end_lease(db, lease["id"], state, reason, now)


def exhaust(db: Database, lease_id: str, now: int) -> EndedLease | None:
    """A running lease has cost what its job's hold has left (no checkpoint came in time):
    pay it up to the hold and pause the job; its work since its last checkpoint is redone
    after a top-up. None if the lease is no longer active or still covered."""
    lease = lease_row(db, lease_id)
    job = job_row(db, lease["job_id"])
    if lease["state"] != "active" or job.lease_id != lease_id or not job.enforce_funds:
        return None
    left = ledger.balance(db, ledger.escrow(job.parent_id or job.id))
    if ledger.accrued(job, lease, now) + _siblings_accrued(db, job, now) < left:
        return None
    ledger.settle(db, job, lease, job.settled_step, now, tag="end")
    _pause(db, job, lease, now, _resume_floor(lease), f"{credit_holds.RESUME_FLOOR_S} s of its lease")
    return EndedLease(job.id, job.epoch, lease["provider_id"])


def top_up(db: Database, job_id: str, client_id: str, amount: int, now: int,
           nonce: str = "") -> int:
    """Add ``amount`` units from the client's available balance to the job's hold (once per
    ``nonce``); a paused job (or paused parts) is queued again once the hold covers what the
    pause needs. Returns the job's state."""
    job = job_row(db, job_id)
    if job.client_id != client_id or job.parent_id or job.check_of:
        raise no_such_job(job_id)
    if job.state in TERMINAL_STATES:
        raise FailedPrecondition(f"job {job_id} is {state_name(job.state)}: nothing to top up")
    if job.state == PAUSED and job.expires_at_ms <= now:
        raise FailedPrecondition(f"job {job_id}: its signed spec expired; it cannot be"
                                 " leased again (cancel it to get its hold back)")
    ledger.top_up(db, job_id, client_id, amount, bool(job.enforce_funds), now, nonce)
    left = ledger.balance(db, ledger.escrow(job_id))
    # A split job's state follows its parts: resume those the hold covers (together), and it
    # follows.
    for row in parts_of(db, job_id) if job.parts else [job]:
        if row.state != PAUSED:
            continue
        if left < row.hold_needed:
            why = (f"paused: its hold has {ledger.fmt(left)} credits left,"
                   f" {ledger.fmt(row.hold_needed - left)} short of what it needs to go on"
                   f" (gpumarket topup {job_id} AMOUNT)")
            set_job(db, row.id, now, queue_reason=why)
            continue
        left -= row.hold_needed
        set_job(db, row.id, now, state=QUEUED, queue_reason="", hold_needed=0)
        append_event(db, row.id, "resumed", QUEUED, row.attempt, now,
                     message=f"hold topped up by {ledger.fmt(amount)} credits; queued to"
                     f" resume from step {row.checkpoint_step}")
    return job_row(db, job_id)["state"]


def drop_checkpoints(db: Database, job_id: str) -> None:
    db.execute("DELETE FROM artifact_refs WHERE job_id = ? AND role IN ('checkpoint', 'history')",
               [job_id])


def end_lease(db: Database, lease_id: str, state: str, reason: str, now: int) -> None:
    db.execute("UPDATE leases SET state = ?, ended_at_ms = ?, reason = ? WHERE id = ?",
               [state, now, reason, lease_id])


def succeed(
    db: Database, job_id: str, epoch: int, provider_id: str, receipt: bytes, now: int,
    policy: Policy = OFF,
) -> None:
    """The lease's receipt: its work is paid to the end; the job succeeds, or waits
    (VERIFYING) for the checks of its work still running; a check's job hands what its
    checker returned to the verdict."""
    job, lease = current(db, job_id, epoch, provider_id)
    total = max(job.progress_step, job.progress_total)
    ledger.settle(db, job, lease, total, now, tag="final")
    end_lease(db, lease["id"], "succeeded", "", now)
    parsed = pb.Envelope()
    parsed.ParseFromString(receipt)
    receipt_msg = pb.Receipt()
    receipt_msg.ParseFromString(parsed.payload)
    outputs = {o.name: {"name": o.name, "sha256": o.sha256, "size_bytes": o.size_bytes}
               for o in receipt_msg.outputs}
    if job.check_of:
        set_job(db, job_id, now, state=SUCCEEDED, receipt=receipt, progress_step=total)
        hooks().check_returned(db, job_id, outputs, now)
        append_event(db, job_id, "succeeded", SUCCEEDED, job.attempt, now,
                     provider_id=provider_id, message="replayed; compared next")
        return
    calibration.record(db, job, lease, now)
    for out in receipt_msg.outputs:
        blob_holdings.refer(db, out.sha256, job_id, "output")
    calibration.record_throughput(db, job, provider_id, receipt_msg, now)
    hooks().receipt_came(db, policy, job, lease, total, outputs, receipt_msg, now)
    if hooks().open_checks(db, job_id):
        set_job(db, job_id, now, state=VERIFYING, receipt=receipt, progress_step=total)
        append_event(db, job_id, "verifying", VERIFYING, job.attempt, now,
                     provider_id=provider_id, message="finished; receipt verified; waiting"
                     " for the checks of its work")
        return
    set_job(db, job_id, now, receipt=receipt, progress_step=total)
    finished(db, job_row(db, job_id), now, "finished; receipt verified"
             + ("" if not policy.enabled else f"; work {hooks().work_summary(db, job_id)}"))


def finished(db: Database, job: Job, now: int, message: str) -> None:
    """The job succeeded (its checks, if any, done): its hold's rest goes back."""
    set_job(db, job.id, now, state=SUCCEEDED)
    drop_checkpoints(db, job.id)
    if not job.parent_id:    # what its checks compared is no longer needed
        db.execute("DELETE FROM artifact_refs WHERE job_id = ? AND role = 'evidence'",
                   [job.id])
    append_event(db, job.id, "succeeded", SUCCEEDED, job.attempt, now,
                 provider_id=job.provider_id or "", message=message)
