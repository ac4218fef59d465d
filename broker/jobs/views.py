"""Read queries and their protobuf views. No grpc here."""

from __future__ import annotations

import json

from sqlite_utils import Database

from gpumarket.broker.checks import verification
from gpumarket.broker.jobs import arrays
from gpumarket.broker.jobs.job import Job
from gpumarket.broker.jobs.transitions import job_row, parts_of
from gpumarket.broker.market.reliability import WINDOW_S, ProviderHistory
from gpumarket.broker.money import ledger
from gpumarket.proto.v1 import types_pb2 as pb


def _rows(db: Database, sql: str, params: list) -> list[dict]:
    cur = db.execute(sql, params)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def job_message(db: Database, job: Job, *, with_attempts: bool = True) -> pb.Job:
    """A job as its client reads it (with its attempts, unless ``with_attempts`` is False)."""
    out = pb.Job(
        job_id=job.id, name=job.name, kind=job.kind, state=job.state,
        client_id=job.client_id, attempt=job.attempt, provider_id=job.provider_id or "",
        error=job.error, created_at_ms=job.created_at_ms,
        updated_at_ms=job.updated_at_ms, queue_reason=job.queue_reason,
        checkpoint_step=job.checkpoint_step,
        progress=pb.Progress(step=job.progress_step, total=job.progress_total,
                             metrics=json.loads(job.progress_metrics)),
    )
    out.spec.ParseFromString(job.spec)
    if job.sort == "job":
        out.billing.CopyFrom(pb.JobBilling(**ledger.job_money(db, job.id),
                                           basis=job.hold_basis))
        out.verification.CopyFrom(verification.view(db, job.id))
    if job.receipt:
        out.receipt.ParseFromString(job.receipt)
    if job.is_array:
        out.array.CopyFrom(pb.ArrayProgress(tasks=job.tasks, **arrays.counts(db, job.id)))
    if job.parts and not job.part:
        for part in parts_of(db, job.id):
            message = pb.JobPart(
                part=part.part, job_id=part.id, state=part.state,
                attempt=part.attempt, provider_id=part.provider_id or "",
                error=part.error,
                progress=pb.Progress(step=part.progress_step, total=part.progress_total,
                                     metrics=json.loads(part.progress_metrics)))
            if part.receipt:
                message.receipt.ParseFromString(part.receipt)
            out.parts.append(message)
    if with_attempts:
        for lease in _rows(db, "SELECT * FROM leases WHERE job_id = ? ORDER BY epoch", [job.id]):
            out.attempts.append(pb.Attempt(
                attempt=lease["attempt"], epoch=lease["epoch"], provider_id=lease["provider_id"],
                started_at_ms=lease["started_at_ms"] or lease["issued_at_ms"],
                ended_at_ms=lease["ended_at_ms"] or 0,
                outcome=lease["state"], reason=lease["reason"],
            ))
    return out


def get_job(db: Database, job_id: str) -> pb.Job:
    """Return the job with its attempts; raise NotFound."""
    return job_message(db, job_row(db, job_id))


def list_jobs(db: Database, client_id: str, states: list[int], limit: int) -> list[pb.Job]:
    # A split job is listed once; checks are shown with the job they check.
    sql = "SELECT * FROM jobs WHERE parent_id IS NULL AND check_of IS NULL"
    params: list = []
    if client_id:
        sql += " AND client_id = ?"
        params.append(client_id)
    if states:
        sql += f" AND state IN ({', '.join('?' for _ in states)})"
        params += states
    sql += " ORDER BY created_at_ms DESC, id LIMIT ?"
    params.append(limit)
    return [job_message(db, Job.from_row(r), with_attempts=False)
            for r in _rows(db, sql, params)]


def events_after(db: Database, job_id: str, seq: int, limit: int = 500) -> list[pb.JobEvent]:
    out = []
    for r in _rows(db, "SELECT * FROM events WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                   [job_id, seq, limit]):
        ev = pb.JobEvent(seq=r["seq"], job_id=r["job_id"], at_ms=r["at_ms"], type=r["type"],
                         state=r["state"], attempt=r["attempt"], provider_id=r["provider_id"],
                         message=r["message"])
        if r["progress"]:
            progress = json.loads(r["progress"])
            ev.progress.CopyFrom(pb.Progress(step=progress["step"], total=progress["total"],
                                             metrics=progress["metrics"]))
        out.append(ev)
    return out


def queued_count(db: Database, client_id: str) -> int:
    return db.execute("SELECT count(*) FROM jobs WHERE client_id = ? AND state = ?"
                      " AND parent_id IS NULL AND check_of IS NULL",
                      [client_id, pb.JOB_STATE_QUEUED]).fetchone()[0]


def job_state(db: Database, job_id: str) -> int:
    row = db.execute("SELECT state FROM jobs WHERE id = ?", [job_id]).fetchone()
    return row[0] if row else 0


def queued_jobs(db: Database, limit: int) -> list[Job]:
    """The jobs to place, oldest first (a split job's top row is not placed: its parts are)."""
    return [Job.from_row(r) for r in _rows(
        db, "SELECT * FROM jobs WHERE state = ? AND NOT (parts > 0 AND part = 0)"
            " ORDER BY created_at_ms, id LIMIT ?", [pb.JOB_STATE_QUEUED, limit])]


def busy_siblings(db: Database, parent_id: str) -> set[str]:
    """Providers running other parts of a split job now."""
    return {r[0] for r in db.execute(
        "SELECT provider_id FROM jobs WHERE parent_id = ? AND state IN (?, ?)",
        [parent_id, pb.JOB_STATE_LEASED, pb.JOB_STATE_RUNNING]).fetchall()}


def count_in_state(db: Database, state: int) -> int:
    return db.execute("SELECT count(*) FROM jobs WHERE state = ? AND parent_id IS NULL",
                      [state]).fetchone()[0]


def busy_devices(db: Database) -> dict[str, set[int]]:
    busy: dict[str, set[int]] = {}
    for r in _rows(db, "SELECT provider_id, device_indices FROM leases WHERE state = 'active'", []):
        busy.setdefault(r["provider_id"], set()).update(json.loads(r["device_indices"]))
    return busy


def overdue_leases(db: Database, renewed_before_ms: int) -> list[str]:
    return [r[0] for r in db.execute(
        "SELECT id FROM leases WHERE state = 'active' AND renewed_at_ms < ?", [renewed_before_ms]
    ).fetchall()]


def held_devices(db: Database, pairs: dict[str, list[tuple[str, int]]]) -> dict[str, set[int]]:
    """The devices of ended leases that their providers may still run (``pairs``, by
    provider: broker/state.py, Liveness): not free to lease again yet."""
    held: dict[str, set[int]] = {}
    for provider_id, listed in pairs.items():
        for job_id, epoch in listed:
            row = db.execute("SELECT device_indices FROM leases WHERE job_id = ? AND epoch = ?"
                             " AND provider_id = ?", [job_id, epoch, provider_id]).fetchone()
            if row is not None:
                held.setdefault(provider_id, set()).update(json.loads(row[0]))
    return held


def lease_holder(db: Database, lease_id: str) -> tuple[str, int, str]:
    """(job id, epoch, provider id) of a lease."""
    return tuple(db.execute("SELECT job_id, epoch, provider_id FROM leases WHERE id = ?",
                            [lease_id]).fetchone())


def leases_past_runtime(db: Database, now: int, grace_ms: int) -> list[tuple[str, int]]:
    """Active leases that have run longer than their job's max_runtime (from their start)
    plus ``grace_ms``: (lease id, max_runtime_s). An honest provider stops such a job itself;
    the broker does not wait for one that does not (nor pay it for the overrun)."""
    out = []
    for lease_id, started, needs in db.execute(
            "SELECT l.id, l.started_at_ms, j.needs FROM leases l JOIN jobs j ON j.id = l.job_id"
            " WHERE l.state = 'active' AND l.started_at_ms IS NOT NULL").fetchall():
        limit = json.loads(needs).get("max_runtime_s", 0)
        if limit and now - started > limit * 1000 + grace_ms:
            out.append((lease_id, limit))
    return out


def may_read(db: Database, key_id: str, sha256: str) -> bool:
    """Whether ``key_id`` may read the blob: it uploaded it, or the blob belongs to one of
    its jobs (input, checkpoint, output), or to a job it holds an active lease on."""
    return db.execute(
        "SELECT 1 FROM artifact_owners WHERE sha256 = :sha AND owner_id = :key"
        " UNION ALL SELECT 1 FROM artifact_refs r JOIN jobs j ON j.id = r.job_id"
        "  WHERE r.sha256 = :sha AND j.client_id = :key"
        " UNION ALL SELECT 1 FROM artifact_refs r"
        "  JOIN jobs j ON j.id = r.job_id OR j.parent_id = r.job_id"
        "  JOIN leases l ON l.job_id = j.id"
        "  WHERE r.sha256 = :sha AND l.provider_id = :key AND l.state = 'active'"
        "  AND r.role NOT IN ('evidence', 'history')"
        " LIMIT 1", {"sha": sha256, "key": key_id}).fetchone() is not None


def state_counts(db: Database) -> dict[int, int]:
    """Jobs (every sort) by state."""
    return dict(db.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall())


def artifact_size(db: Database, sha256: str) -> int | None:
    row = db.execute("SELECT size_bytes FROM artifacts WHERE sha256 = ?", [sha256]).fetchone()
    return row[0] if row else None


def offers(db: Database) -> list[dict]:
    return _rows(db, "SELECT * FROM offers ORDER BY price_per_gpu_hour, provider_id", [])


def provider_history(db: Database, provider_id: str, now: int) -> ProviderHistory:
    """What the broker saw of a provider: online time (all and in the last 7 days), leases
    completed, lost and failed (by its word alone), and its age."""
    return histories(db, [provider_id], now)[provider_id]


def histories(db: Database, provider_ids: list[str], now: int) -> dict[str, ProviderHistory]:
    """provider_history of many providers in three queries, not three each (a placement
    pass reads every online provider's)."""
    ids = json.dumps(sorted(set(provider_ids)))
    among = "provider_id IN (SELECT value FROM json_each(?))"
    start = now - int(WINDOW_S * 1000)
    online = {r[0]: (r[1], r[2]) for r in db.execute(
        "SELECT provider_id, coalesce(sum(coalesce(ended_ms, ?) - started_ms), 0),"
        " coalesce(sum(max(0, coalesce(ended_ms, ?) - max(started_ms, ?))), 0)"
        f" FROM provider_sessions WHERE {among} GROUP BY provider_id",
        [now, now, start, ids]).fetchall()}
    counts: dict[str, dict[str, int]] = {}
    for provider_id, state, n in db.execute(
            f"SELECT provider_id, state, count(*) FROM leases WHERE {among}"
            " GROUP BY provider_id, state", [ids]).fetchall():
        counts.setdefault(provider_id, {})[state] = n
    first = dict(db.execute("SELECT id, first_seen_ms FROM providers"
                            " WHERE id IN (SELECT value FROM json_each(?))", [ids]).fetchall())
    out = {}
    for provider_id in provider_ids:
        uptime_ms, window_ms = online.get(provider_id, (0, 0))
        seen = counts.get(provider_id, {})
        age_ms = max(0, now - first[provider_id]) if provider_id in first else 0
        out[provider_id] = ProviderHistory(
            uptime_s=uptime_ms / 1000, leases_lost=seen.get("lost", 0),
            leases_completed=seen.get("succeeded", 0), leases_failed=seen.get("failed", 0),
            uptime_window_s=window_ms / 1000,
            window_s=min(age_ms, WINDOW_S * 1000) / 1000, age_s=age_ms / 1000)
    return out


def achieved_flops(db: Database) -> dict[tuple[str, int], float]:
    return {(r[0], r[1]): r[2] for r in db.execute(
        "SELECT provider_id, kind, flops_per_device FROM throughput").fetchall()}


def active_lease_counts(db: Database) -> dict[str, int]:
    return dict(db.execute(
        "SELECT provider_id, count(*) FROM leases WHERE state = 'active' GROUP BY provider_id"
    ).fetchall())


def running_by_client(db: Database) -> dict[str, int]:
    return dict(db.execute(
        "SELECT client_id, count(*) FROM jobs WHERE state IN (?, ?)"
        " AND NOT (parts > 0 AND part = 0) GROUP BY client_id",
        [pb.JOB_STATE_LEASED, pb.JOB_STATE_RUNNING]).fetchall())


def stakes(db: Database) -> dict[str, int]:
    """Units each provider has staked (the ledger's stake accounts)."""
    return dict(db.execute(f"SELECT owner, balance FROM ({ledger.LATEST} WHERE a.type ="
                           " 'stake') AS latest WHERE balance > 0").fetchall())


def leases_over_hold(db: Database, now: int) -> list[str]:
    """Active leases whose cost since their last settlement (with their sibling parts', for a
    split job) has reached what their job's hold has left (jobs that enforce funds only)."""
    rows = _rows(db, "SELECT l.id, l.price_per_gpu_hour, l.device_indices, j.settled_to_ms,"
                 " coalesce(j.parent_id, j.id) AS top FROM leases l JOIN jobs j ON j.id ="
                 " l.job_id AND j.lease_id = l.id WHERE l.state = 'active'"
                 " AND j.settled_to_ms IS NOT NULL AND j.enforce_funds != 0"
                 " AND j.check_of IS NULL", [])   # a check is paid up to the hold, not paused
    by_top: dict[str, list[dict]] = {}
    for r in rows:      # the parts of a split job draw on one hold: count them together
        by_top.setdefault(r["top"], []).append(r)
    return [r["id"] for top, group in by_top.items()
            if sum(ledger.cost_since(r, r["settled_to_ms"], now) for r in group)
            >= ledger.balance(db, ledger.escrow(top)) for r in group]


def previous_providers(db: Database, job_id: str) -> set[str]:
    """Providers that lost, released, refused or failed this job before."""
    return {r[0] for r in db.execute(
        "SELECT provider_id FROM leases WHERE job_id = ?"
        " AND state IN ('lost', 'released', 'rejected', 'failed')",
        [job_id]).fetchall()}
