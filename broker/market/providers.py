"""Providers and their offers, as the broker stores them: who has connected (and when,
with which key), who is banned, which offer each has out, and each session's span. The only
module that writes the providers, offers and provider_sessions tables. Plain SQL, no grpc."""

from __future__ import annotations

from sqlite_utils import Database

from gpumarket.broker.jobs import endings
from gpumarket.proto.errors import NotFound
from gpumarket.proto.v1 import types_pb2 as pb

# After a restart the broker keeps each active lease for its provider to come back: as long
# as that provider said it takes to reconnect (its hello's reconnect_within_ms, at most
# MAX_RECONNECT_MS; RECONNECT_UNSAID_MS where it said nothing: the 30 s backoff and 20 %
# jitter providers have by default), plus RESTART_MARGIN_MS for the broker's own start (the
# wait counts from before it listens), the handshake and the first heartbeat; and never
# less than the lease timeout.
MAX_RECONNECT_MS = 5 * 60 * 1000
RECONNECT_UNSAID_MS = 36_000
RESTART_MARGIN_MS = 10_000


def online(db: Database, provider_id: str, public_key: bytes, now: int,
           reconnect_within_ms: int = 0) -> bool:
    """Upsert the provider as online, with how long it says it takes to reconnect (bounded
    here: it is the provider's word); return True if it is banned."""
    reconnect = min(max(int(reconnect_within_ms), 0), MAX_RECONNECT_MS)
    row = db.execute("SELECT banned FROM providers WHERE id = ?", [provider_id]).fetchone()
    if row is None:
        db["providers"].insert({"id": provider_id, "public_key": public_key,
                                "first_seen_ms": now, "last_seen_ms": now, "online": 1,
                                "reconnect_within_ms": reconnect})
        return False
    if row[0]:
        return True
    db.execute("UPDATE providers SET online = 1, last_seen_ms = ?, reconnect_within_ms = ?"
               " WHERE id = ?", [now, reconnect, provider_id])
    return False


def store_offer(db: Database, provider_id: str, envelope: bytes, offer: pb.Offer,
                now: int) -> None:
    db["offers"].upsert({"provider_id": provider_id, "envelope": envelope,
                         "price_per_gpu_hour": offer.price_per_gpu_hour,
                         "device_count": len(offer.devices), "created_at_ms": now},
                        pk="provider_id")


def withdraw_offer(db: Database, provider_id: str) -> None:
    db.execute("DELETE FROM offers WHERE provider_id = ?", [provider_id])


def offline(db: Database, provider_id: str, now: int, session_row: int | None = None) -> bool:
    """The session ended: its offer expires. Its leases stay until they miss heartbeats for
    the lease timeout, so a provider that reconnects in time (a restarted daemon, a network
    blip, a restarted broker) re-attaches to its running jobs instead of losing them.

    ``session_row`` (the ended session's provider_sessions row): only while that session is
    still the provider's latest. Brokers sharing a store each end their own sessions; a
    provider that has since opened one on another broker is that broker's, and a broker
    stopping (or losing an old session late) must not take its offer from the market.
    Returns whether the provider was marked offline."""
    latest = ""
    params: list = []
    if session_row is not None:
        latest = (" AND (SELECT max(id) FROM provider_sessions WHERE provider_id = ?) = ?")
        params = [provider_id, session_row]
    if db.execute("UPDATE providers SET online = 0, last_seen_ms = ? WHERE id = ?" + latest,
                  [now, provider_id, *params]).rowcount == 0:
        return False
    withdraw_offer(db, provider_id)
    return True


def heartbeats(db: Database, seen: dict[str, int], running: dict[str, list[tuple[str, int]]]
               ) -> dict[str, list[tuple[str, int]]]:
    """The heartbeats heard since the last write (broker/state.py, Liveness): each provider was
    alive at ``seen[provider]`` and ran ``running[provider]``; renew those of its leases.
    Return, by provider, the (job, epoch) pairs it runs that are no longer its to run."""
    db.conn.executemany("UPDATE providers SET last_seen_ms = max(last_seen_ms, ?) WHERE id = ?",
                        [(when, provider_id) for provider_id, when in seen.items()])
    stale = {}
    for provider_id, pairs in running.items():
        gone = renew_leases(db, provider_id, pairs, seen[provider_id])
        if gone:
            stale[provider_id] = gone
    return stale


def session_started(db: Database, provider_id: str, now: int) -> int:
    """Record a session of the provider (its row id: the session's place in the provider's
    order of sessions, across the brokers of a store) and mark it online again: a broker
    whose older session of it ended between ``online`` and here marked it offline."""
    db.execute("UPDATE providers SET online = 1 WHERE id = ?", [provider_id])
    return db["provider_sessions"].insert({"provider_id": provider_id, "started_ms": now}).last_pk


def session_ended(db: Database, row_id: int, now: int, reason: str) -> None:
    db.execute("UPDATE provider_sessions SET ended_ms = ?, end_reason = ? WHERE id = ?"
               " AND ended_ms IS NULL", [now, reason, row_id])


def after_restart(db: Database) -> None:
    """After a (re)start no session is open: every provider is offline, offers are gone."""
    db.execute("UPDATE provider_sessions SET ended_ms = (SELECT last_seen_ms FROM providers p"
               " WHERE p.id = provider_id), end_reason = 'broker restart' WHERE ended_ms IS NULL")
    db.execute("UPDATE providers SET online = 0")
    db.execute("DELETE FROM offers")


def set_banned(db: Database, provider_id: str, banned: bool, reason: str,
               now: int) -> list[tuple[str, int]]:
    """Set the ban flag; banning also withdraws the offer and takes the active leases away
    (their jobs are queued again). Returns the (job, epoch) of those leases."""
    if db.execute("SELECT 1 FROM providers WHERE id = ?", [provider_id]).fetchone() is None:
        raise NotFound(f"no provider {provider_id!r} has connected to this broker")
    db.execute("UPDATE providers SET banned = ? WHERE id = ?", [int(banned), provider_id])
    return take_leases(db, provider_id, reason, now) if banned else []


def take_leases(db: Database, provider_id: str, reason: str, now: int) -> list[tuple[str, int]]:
    """Withdraw the provider's offer and lose its active leases (their jobs are queued
    again); return the (job, epoch) of those leases."""
    withdraw_offer(db, provider_id)
    leases = db.execute("SELECT id, job_id, epoch FROM leases WHERE provider_id = ?"
                        " AND state = 'active'", [provider_id]).fetchall()
    for lease_id, _, _ in leases:
        endings.lose_lease(db, lease_id, reason, now)
    return [(job_id, epoch) for _, job_id, epoch in leases]


def revoke(db: Database, key_id: str, reason: str, now: int) -> list[tuple[str, int]]:
    """Record the revocation of a key; if it is a provider's, its offer goes and its active
    leases are lost. Returns the (job, epoch) of those leases."""
    db.execute("INSERT INTO revoked_keys (key_id, reason, revoked_at_ms) VALUES (?, ?, ?)"
               " ON CONFLICT (key_id) DO UPDATE SET reason = excluded.reason,"
               " revoked_at_ms = excluded.revoked_at_ms", [key_id, reason, now])
    return take_leases(db, key_id, reason, now)


def unrevoke(db: Database, key_id: str) -> None:
    if db.execute("DELETE FROM revoked_keys WHERE key_id = ?", [key_id]).rowcount == 0:
        raise NotFound(f"key {key_id} is not revoked")


def revoked(db: Database) -> list[str]:
    return [row[0] for row in db.execute("SELECT key_id FROM revoked_keys")]


def renew_leases(
    db: Database, provider_id: str, running: list[tuple[str, int]], now: int
) -> list[tuple[str, int]]:
    """Renew the provider's active leases it says it runs (in a heartbeat heard at ``now``);
    return the (job, epoch) pairs it runs that are no longer its to run. A lease that ended
    after the heartbeat was heard is not one of them: the provider ran it then, and its end
    (the final update it sent, or the broker's cancel) is settled already: every array
    lease's end was otherwise followed by a needless cancel."""
    stale = []
    for job_id, epoch in running:
        cur = db.execute(
            "UPDATE leases SET renewed_at_ms = ? WHERE job_id = ? AND epoch = ?"
            " AND provider_id = ? AND state = 'active'",
            [now, job_id, epoch, provider_id],
        )
        if cur.rowcount == 0 and db.execute(
                "SELECT 1 FROM leases WHERE job_id = ? AND epoch = ? AND provider_id = ?"
                " AND ended_at_ms >= ?", [job_id, epoch, provider_id, now]).fetchone() is None:
            stale.append((job_id, epoch))
    return stale


def restart_wait_ms(reconnect_within_ms: int, lease_timeout_ms: int) -> int:
    """How long after a restart a lease waits for its provider, who said it reconnects
    within ``reconnect_within_ms`` (0: said nothing)."""
    said = min(reconnect_within_ms, MAX_RECONNECT_MS) if reconnect_within_ms > 0 \
        else RECONNECT_UNSAID_MS
    return max(lease_timeout_ms, said + RESTART_MARGIN_MS)


def renew_all_leases(db: Database, now: int, lease_timeout_ms: int) -> int:
    """After a broker restart: every active lease waits ``restart_wait_ms`` from ``now`` for
    its provider to reconnect (a lease is lost a lease timeout after ``renewed_at_ms``, so
    that may lie in the future until the provider's first heartbeat); return how many
    there are."""
    leases = db.execute(
        "SELECT l.id, coalesce(p.reconnect_within_ms, 0) FROM leases l"
        " LEFT JOIN providers p ON p.id = l.provider_id WHERE l.state = 'active'").fetchall()
    db.conn.executemany(
        "UPDATE leases SET renewed_at_ms = ? WHERE id = ?",
        [(now + restart_wait_ms(said, lease_timeout_ms) - lease_timeout_ms, lease_id)
         for lease_id, said in leases])
    return len(leases)
