"""Endpoints in the database (docs/serving.md): an endpoint is a job row of kind endpoint
that stays RUNNING while it serves; each replica is a job row of its own under it
(``parent_id``, ``part`` = its number), leased, lost and requeued like any job, but never
finished by its provider. Its API keys and the tokens its replica leases served live in
their own tables. Each function runs inside one write transaction (Store.write) or is a
read; no grpc here."""

from __future__ import annotations

import hashlib
import secrets

from sqlite_utils import Database

from gpumarket.broker.checks import answers
from gpumarket.broker.checks.policy import OFF
from gpumarket.broker.jobs import endings
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs.job import Job
from gpumarket.broker.money import ledger
from gpumarket.broker.serving.rows import EndpointKey, LiveEndpoint, LiveReplica, Overview, Usage
from gpumarket.kinds import endpoint as endpoint_kind
from gpumarket.kinds.schema import NAME_RE
from gpumarket.proto.errors import FailedPrecondition, InvalidArgument, NotFound
from gpumarket.proto.jobspec import TERMINAL_STATES
from gpumarket.proto.v1 import types_pb2 as pb

KIND = pb.JOB_KIND_ENDPOINT
LIVE = (pb.JOB_STATE_QUEUED, pb.JOB_STATE_LEASED, pb.JOB_STATE_RUNNING, pb.JOB_STATE_PAUSED)
KEY_PREFIX = "gm-"
CRASH_LOOP = 3      # replica failures in a row before serving, on at least ...
CRASH_PROVIDERS = 2     # ... this many providers: the endpoint fails
STEER_WINDOW_S = 3600   # how long a provider's failures of an endpoint's replicas steer them


settings_of = endpoint_kind.settings_of    # the endpoint's settings from its stored spec


def check_name(db: Database, client_id: str, name: str) -> None:
    """An endpoint's name is the model name its API answers to: a plain name, one live
    endpoint of that name per client."""
    if not NAME_RE.match(name):
        raise InvalidArgument(f"name: {name!r} is not a plain name (letters, digits, . _ -);"
                              " an endpoint's name is the model name its API answers to")
    if db.execute(f"SELECT 1 FROM jobs WHERE client_id = ? AND kind = ? AND name = ?"
                  f" AND parent_id IS NULL AND check_of IS NULL"
                  f" AND state NOT IN ({','.join('?' * 3)})",
                  [client_id, KIND, name, *TERMINAL_STATES]).fetchone():
        raise FailedPrecondition(f"you already have a live endpoint named {name!r}"
                                 " (gpumarket endpoint delete it first)")


def created(db: Database, endpoint_id: str, now: int) -> None:
    """A just-submitted endpoint serves (RUNNING) and starts its ``min_replicas``."""
    job = jobs.job_row(db, endpoint_id)
    s = settings_of(job.spec)
    jobs.set_job(db, endpoint_id, now, state=pb.JOB_STATE_RUNNING, parts=s["max_replicas"],
                 progress_total=0)
    jobs.append_event(db, endpoint_id, "serving", pb.JOB_STATE_RUNNING, 1, now,
                      message=f"endpoint {job.name}: {s['min_replicas']} to"
                      f" {s['max_replicas']} replicas, scaling out over {s['target']} requests"
                      f" in flight per replica")
    for _ in range(s["min_replicas"]):
        add_replica(db, endpoint_id, now, "min_replicas")


def add_replica(db: Database, endpoint_id: str, now: int, why: str, limit: int = 0) -> str:
    """A new QUEUED replica row under the endpoint (refused when it has ``limit`` live
    replicas already, 0 = its max_replicas); returns its id."""
    top = jobs.job_row(db, endpoint_id)
    if top.state != pb.JOB_STATE_RUNNING:
        raise FailedPrecondition(f"endpoint {endpoint_id} is not serving")
    limit = limit or settings_of(top.spec)["max_replicas"]
    if len(replicas(db, endpoint_id)) >= limit:
        raise FailedPrecondition(f"endpoint {endpoint_id} has {limit} live replicas already")
    n = db.execute("SELECT coalesce(max(part), 0) + 1 FROM jobs WHERE parent_id = ?",
                   [endpoint_id]).fetchone()[0]
    replica_id = f"{endpoint_id}-r{n}"
    jobs.spawn(db, top, "replica", replica_id, f"{top.name} replica {n}", now, part=n)
    jobs.append_event(db, replica_id, "submitted", pb.JOB_STATE_QUEUED, 1, now,
                      message=f"replica {n} of endpoint {top.name}: {why}")
    jobs.append_event(db, endpoint_id, "scaled", pb.JOB_STATE_RUNNING, top.attempt, now,
                      message=f"replica {n} added: {why}")
    return replica_id


def retire(db: Database, replica_id: str, why: str, now: int) -> jobs.EndedLease | None:
    """Stop a replica for good (scaled in, or moved off a draining provider): its lease is
    paid up to now. Returns the lease to tell its provider about, if it had one."""
    replica = jobs.job_row(db, replica_id)
    if replica.state in TERMINAL_STATES:
        return None
    ended = None
    if replica.state in jobs.ACTIVE_STATES and replica.lease_id:
        jobs.stop_lease(db, replica, "cancelled", why, now)
        ended = jobs.EndedLease(replica.id, replica.epoch, replica.provider_id)
    jobs.set_job(db, replica_id, now, state=pb.JOB_STATE_CANCELLED, error=why)
    jobs.append_event(db, replica_id, "cancelled", pb.JOB_STATE_CANCELLED, replica.attempt, now,
                      message=why)
    return ended


def fail(db: Database, endpoint_id: str, error: str, now: int) -> list[jobs.EndedLease]:
    """The endpoint cannot serve (its replicas keep failing before they are ready): it fails,
    its replicas stop, its hold's rest goes back to its client."""
    ended = [e for r in replicas(db, endpoint_id) if (e := retire(db, r.id, error, now))]
    top = jobs.job_row(db, endpoint_id)
    jobs.set_job(db, endpoint_id, now, state=pb.JOB_STATE_FAILED, error=error)
    jobs.append_event(db, endpoint_id, "failed", pb.JOB_STATE_FAILED, top.attempt, now,
                      message=error)
    return ended


def failures(db: Database, endpoint_id: str) -> list[tuple[str, str]]:
    """(provider, error) of each replica lease of the endpoint that its provider reported
    failed before it was ready, since a replica last became ready (oldest first): who has
    been failing it lately."""
    since = db.execute("SELECT coalesce(max(e.at_ms), -1) FROM jobs j JOIN events e"
                       " ON e.job_id = j.id WHERE j.parent_id = ? AND e.type = 'ready'",
                       [endpoint_id]).fetchone()[0]
    return [tuple(r) for r in db.execute(
        "SELECT l.provider_id, l.reason FROM jobs j JOIN leases l ON l.job_id = j.id"
        " WHERE j.parent_id = ? AND l.state IN ('failed', 'crashed') AND l.ended_at_ms > ?"
        " AND NOT EXISTS (SELECT 1 FROM events e WHERE e.job_id = l.job_id"
        "  AND e.attempt = l.attempt AND e.type = 'ready')"
        " ORDER BY l.ended_at_ms, l.id", [endpoint_id, since]).fetchall()]


def crash_loop(db: Database, endpoint_id: str) -> str:
    """The endpoint's error if its replicas keep failing before they serve: CRASH_LOOP
    failures in a row (since a replica was last ready) reported by at least CRASH_PROVIDERS
    distinct providers, each provider's error named; "" otherwise. However often one
    provider fails its replicas, that provider alone never fails the endpoint (``steer``
    keeps its replicas away from it)."""
    found = failures(db, endpoint_id)
    latest = dict(found)        # each provider's last error
    if len(found) < CRASH_LOOP or len(latest) < CRASH_PROVIDERS:
        return ""
    return (f"replicas failed {len(found)} times in a row before serving, on {len(latest)}"
            f" providers: " + endings.each_error(latest))


def steer(db: Database, endpoint_id: str, now: int) -> tuple[frozenset[str], frozenset[str]]:
    """(providers a new lease of one of the endpoint's replicas goes to only if nothing else
    fits, providers it does not go to): those that reported one of its replicas failed in
    the last STEER_WINDOW_S, and those that did CRASH_LOOP times. So one provider that fails
    every replica it gets can neither churn through them nor, alone, fail the endpoint; it
    gets another chance after the window."""
    count: dict[str, int] = {}
    for (provider_id,) in db.execute(
            "SELECT l.provider_id FROM jobs j JOIN leases l ON l.job_id = j.id"
            " WHERE j.parent_id = ? AND l.state IN ('failed', 'crashed') AND l.ended_at_ms > ?",
            [endpoint_id, now - STEER_WINDOW_S * 1000]).fetchall():
        count[provider_id] = count.get(provider_id, 0) + 1
    return (frozenset(count),
            frozenset(p for p, n in count.items() if n >= CRASH_LOOP))


def mark_ready(db: Database, job_id: str, epoch: int, provider_id: str, engine: str,
               now: int) -> Job:
    """A replica's engine loaded its model (the first time for this lease: an event)."""
    job, _ = jobs.current(db, job_id, epoch, provider_id)
    if job.kind != KIND or not job.parent_id:
        raise InvalidArgument(f"job {job_id} is not an endpoint replica")
    if job.progress_step != 1 or job.state != pb.JOB_STATE_RUNNING:
        if job.state == pb.JOB_STATE_LEASED:
            jobs.set_job(db, job_id, now, state=pb.JOB_STATE_RUNNING)
        jobs.set_job(db, job_id, now, progress_step=1, progress_total=1)
        jobs.append_event(db, job_id, "ready", pb.JOB_STATE_RUNNING, job.attempt, now,
                          provider_id=provider_id, message=f"serving on {provider_id}: {engine}")
    return job


def live(db: Database) -> list[LiveEndpoint]:
    """Every serving endpoint with its settings and its live replicas."""
    tops = db.execute("SELECT id, client_id, name, spec, created_at_ms FROM jobs WHERE kind = ?"
                      " AND parent_id IS NULL AND check_of IS NULL AND state = ?",
                      [KIND, pb.JOB_STATE_RUNNING]).fetchall()
    return [LiveEndpoint(endpoint_id, client_id, name, settings_of(spec), created_ms,
                         tuple(replicas(db, endpoint_id)))
            for endpoint_id, client_id, name, spec, created_ms in tops]


def replicas(db: Database, endpoint_id: str) -> list[LiveReplica]:
    """The endpoint's live replicas, each with its current lease's columns, by number."""
    cur = db.execute(
        f"SELECT {LiveReplica.COLUMNS} FROM jobs j LEFT JOIN leases l ON l.id = j.lease_id"
        f" WHERE j.parent_id = ? AND j.state IN ({','.join('?' * len(LIVE))}) ORDER BY j.part",
        [endpoint_id, *LIVE])
    cols = [d[0] for d in cur.description]
    return [LiveReplica.from_row(dict(zip(cols, r))) for r in cur.fetchall()]


def find(db: Database, client_id: str, name_or_id: str) -> Job:
    """The caller's endpoint of that name (the live one, else the latest) or id."""
    row = db.execute(
        "SELECT id FROM jobs WHERE client_id = ? AND kind = ? AND parent_id IS NULL"
        " AND check_of IS NULL"
        " AND (id = ? OR name = ?) ORDER BY state = ? DESC, created_at_ms DESC LIMIT 1",
        [client_id, KIND, name_or_id, name_or_id, pb.JOB_STATE_RUNNING]).fetchone()
    if row is None:
        raise NotFound(f"no endpoint {name_or_id!r} (gpumarket endpoint list)")
    return jobs.job_row(db, row[0])


def mine(db: Database, client_id: str) -> list[Job]:
    """The client's endpoints, newest first (at most 200)."""
    cur = db.execute("SELECT * FROM jobs WHERE client_id = ? AND kind = ? AND parent_id IS NULL"
                     " AND check_of IS NULL"
                     " ORDER BY created_at_ms DESC LIMIT 200", [client_id, KIND])
    cols = [d[0] for d in cur.description]
    return [Job.from_row(dict(zip(cols, r))) for r in cur.fetchall()]


# -- money and usage ---------------------------------------------------------------------

def settle_running(db: Database, now: int, windows: dict | None = None,
                   policies: dict | None = None) -> int:
    """Pay every running replica lease for its time since its last settlement (replicas have
    no checkpoints to settle at): one settlement a window. A window whose answers were
    sampled (``windows``: answers.WindowBlobs by lease id) has its pay held and a check of
    them queued (broker/checks/answers.py; ``policies``: the checks' Policy by provider) —
    also a lease that ended within the window (its last settlement is the one held).
    Returns how many were paid."""
    windows, policies = windows or {}, policies or {}
    rows = db.execute("SELECT id, lease_id FROM jobs WHERE kind = ? AND parent_id IS NOT NULL"
                      " AND state = ? AND lease_id IS NOT NULL",
                      [KIND, pb.JOB_STATE_RUNNING]).fetchall()
    paid = 0
    for job_id, lease_id in rows:
        job, lease = jobs.job_row(db, job_id), jobs.lease_row(db, lease_id)
        if lease["state"] == "active" and ledger.settle(
                db, job, lease, job.settled_step, now, tag=f"serve{now}").paid:
            paid += 1
    for lease_id, window in windows.items():
        lease = db.execute("SELECT * FROM leases WHERE id = ?", [lease_id]).fetchone()
        if lease is None:
            continue
        lease = jobs.lease_row(db, lease_id)
        seq = ledger.posted(db, f"settle:{lease_id}:serve{now}") or ledger.posted(
            db, f"settle:{lease_id}:end")
        if seq is not None and ledger.posted(db, f"resolve:{seq}") is not None:
            seq = None      # already settled for good (its lease ended long ago)
        answers.check_window(db, policies.get(lease["provider_id"], OFF),
                             jobs.job_row(db, lease["job_id"]), lease, seq, window, now)
    return paid


def record_usage(db: Database, usage: list[tuple], now: int) -> None:
    """Add requests and tokens to their replica leases' rows: (lease id, endpoint id, replica
    job id, provider id, requests, errors, prompt tokens, output tokens)."""
    for lease_id, endpoint_id, job_id, provider_id, requests, errors, prompt, output in usage:
        db.execute(
            "INSERT INTO endpoint_usage (lease_id, endpoint_id, job_id, provider_id, requests,"
            " errors, prompt_tokens, output_tokens, updated_at_ms) VALUES (?,?,?,?,?,?,?,?,?)"
            " ON CONFLICT(lease_id) DO UPDATE"
            " SET requests = endpoint_usage.requests + excluded.requests,"
            " errors = endpoint_usage.errors + excluded.errors,"
            " prompt_tokens = endpoint_usage.prompt_tokens + excluded.prompt_tokens,"
            " output_tokens = endpoint_usage.output_tokens + excluded.output_tokens,"
            " updated_at_ms = excluded.updated_at_ms",
            [lease_id, endpoint_id, job_id, provider_id, requests, errors, prompt, output, now])


def usage_of(db: Database, endpoint_id: str) -> Usage:
    """What the endpoint's replica leases served, over all of them."""
    row = db.execute("SELECT coalesce(sum(requests), 0), coalesce(sum(errors), 0),"
                     " coalesce(sum(prompt_tokens), 0), coalesce(sum(output_tokens), 0)"
                     " FROM endpoint_usage WHERE endpoint_id = ?", [endpoint_id]).fetchone()
    return Usage(*row)


# -- API keys ----------------------------------------------------------------------------

def secret_sha256(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_key(db: Database, client_id: str, name_or_id: str, now: int
               ) -> tuple[EndpointKey, str]:
    """A new bearer key for the caller's live endpoint: (the key, the secret, shown once;
    only its sha256 is kept)."""
    top = find(db, client_id, name_or_id)
    if top.state != pb.JOB_STATE_RUNNING:
        raise FailedPrecondition(f"endpoint {top.name} is not serving")
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    key = EndpointKey("k" + secrets.token_hex(6), now)
    db["endpoint_keys"].insert({"key_id": key.key_id, "secret_sha256": secret_sha256(secret),
                                "endpoint_id": top.id, "client_id": client_id,
                                "created_at_ms": now})
    jobs.append_event(db, top.id, "key", top.state, top.attempt, now,
                      message=f"API key {key.key_id} created")
    return key, secret


def revoke_key(db: Database, client_id: str, name_or_id: str, key_id: str,
               now: int) -> EndpointKey:
    """Revoke one of the caller's endpoint's keys (once: a second revoke changes nothing);
    returns the key as revoked. Raises NotFound if the endpoint has no such key."""
    top = find(db, client_id, name_or_id)
    row = db.execute(f"SELECT {', '.join(EndpointKey.COLUMNS)} FROM endpoint_keys"
                     " WHERE key_id = ? AND endpoint_id = ?", [key_id, top.id]).fetchone()
    if row is None:
        raise NotFound(f"endpoint {top.name} has no key {key_id!r}")
    key = EndpointKey.from_row(dict(zip(EndpointKey.COLUMNS, row)))
    if not key.revoked_at_ms:
        db.execute("UPDATE endpoint_keys SET revoked_at_ms = ? WHERE key_id = ?", [now, key_id])
        jobs.append_event(db, top.id, "key", top.state, top.attempt, now,
                          message=f"API key {key_id} revoked")
        key = EndpointKey(key.key_id, key.created_at_ms, now)
    return key


def keys_of(db: Database, endpoint_id: str) -> tuple[EndpointKey, ...]:
    """The endpoint's API keys, revoked ones too, oldest first."""
    cur = db.execute(f"SELECT {', '.join(EndpointKey.COLUMNS)} FROM endpoint_keys"
                     " WHERE endpoint_id = ? ORDER BY created_at_ms", [endpoint_id])
    return tuple(EndpointKey.from_row(dict(zip(EndpointKey.COLUMNS, r)))
                 for r in cur.fetchall())


def key_endpoint(db: Database, secret: str) -> str | None:
    """The live endpoint a bearer key opens, or None (unknown, revoked, endpoint ended)."""
    row = db.execute("SELECT k.endpoint_id FROM endpoint_keys k JOIN jobs j"
                     " ON j.id = k.endpoint_id WHERE k.secret_sha256 = ?"
                     " AND k.revoked_at_ms IS NULL AND j.state = ?",
                     [secret_sha256(secret), pb.JOB_STATE_RUNNING]).fetchone()
    return row[0] if row else None


def events_of(db: Database, endpoint_id: str, limit: int) -> list[dict]:
    cur = db.execute("SELECT seq, job_id, at_ms, type, state, attempt, provider_id, message"
                     " FROM events WHERE job_id = ? ORDER BY seq DESC LIMIT ?",
                     [endpoint_id, limit])
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in reversed(cur.fetchall())]


def submit(db: Database, job, now: int) -> None:
    """Store a new endpoint (a NewJob of kind endpoint) and start its min_replicas, in one
    transaction."""
    check_name(db, job.client_id, job.name)
    jobs.submit(db, job, now)
    created(db, job.id, now)


def overview(db: Database, top: Job, events: int) -> Overview:
    """What `endpoint show` tells of an endpoint from the database: its settings, live
    replicas, durable usage, keys and latest events (``events`` = 0: neither keys nor
    events)."""
    return Overview(top, settings_of(top.spec), tuple(replicas(db, top.id)),
                    usage_of(db, top.id),
                    keys_of(db, top.id) if events else (),
                    tuple(events_of(db, top.id, events)) if events else ())
