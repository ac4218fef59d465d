"""The call_nonces table: each signed call's nonce, kept until its token has expired, so that a
replayed call is refused (broker/api/auth.py checks; the garbage collection forgets)."""

from __future__ import annotations

from sqlite_utils import Database


def use(db: Database, key_id: str, nonce: str, keep_until_ms: int) -> bool:
    """Record a call's nonce; False if it was used before (a replayed call)."""
    cur = db.execute("INSERT INTO call_nonces (key_id, nonce, keep_until_ms)"
                     " VALUES (?, ?, ?) ON CONFLICT DO NOTHING", [key_id, nonce, keep_until_ms])
    return cur.rowcount == 1


def forget(db: Database, now: int) -> int:
    """Drop nonces of tokens that have expired (the time check refuses those anyway); run
    by the broker's garbage collection, not on each call."""
    return db.execute("DELETE FROM call_nonces WHERE keep_until_ms < ?", [now]).rowcount
