"""The leadership lease: where several brokers share one database, one of them at a time
holds a role (``scheduler``: placing jobs, the background loops) under a lease with an epoch.

The epoch is raised at every takeover and never reused; it is the fencing token of the
leader's writes: a write made through ``fenced(db, epoch, fn, ...)`` first claims the role's
row for that epoch in the same transaction (a conditional UPDATE), so once another broker has
taken the role the deposed leader's late write is refused whole (``Deposed``), however late
its process wakes up. On PostgreSQL the claim and a takeover are UPDATEs of the same row, so
they serialize on its row lock whatever else runs concurrently: either the write committed
before the takeover (it was the leader's), or it sees the new epoch and is refused.

Times are the calling broker's clock (``now``, ms): a skewed clock can make a lease look
expired early (another broker takes over, and the old leader's writes are then refused) or
late (a takeover waits longer), never let two leaders both write.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from gpumarket.proto.errors import FailedPrecondition

SCHEDULER = "scheduler"
T = TypeVar("T")


class Deposed(FailedPrecondition):
    """The write's epoch is no longer the role's: another broker has taken over."""


def take(db: Any, holder: str, now: int, ttl_ms: int, role: str = SCHEDULER) -> int | None:
    """Hold ``role`` for ``ttl_ms`` from ``now``: renewed where ``holder`` holds it and its
    lease runs; taken, with a new epoch, where it is free (never held, or its lease has run
    out, ours included). Returns the epoch held, or None while another broker's lease runs."""
    db.execute("INSERT INTO leadership (role) VALUES (?) ON CONFLICT DO NOTHING", [role])
    row = db.execute("UPDATE leadership SET expires_at_ms = ? WHERE role = ? AND holder = ?"
                     " AND expires_at_ms > ? RETURNING epoch",
                     [now + ttl_ms, role, holder, now]).fetchone()
    if row is None:
        row = db.execute("UPDATE leadership SET holder = ?, epoch = epoch + 1,"
                         " expires_at_ms = ? WHERE role = ? AND expires_at_ms <= ?"
                         " RETURNING epoch", [holder, now + ttl_ms, role, now]).fetchone()
    return None if row is None else row[0]


def renew(db: Any, holder: str, epoch: int, now: int, ttl_ms: int,
          role: str = SCHEDULER) -> bool:
    """Extend the lease ``holder`` holds at ``epoch``; False where it ran out or was taken
    (the holder must stop leading: its fenced writes will be refused once another takes)."""
    return db.execute("UPDATE leadership SET expires_at_ms = ? WHERE role = ? AND holder = ?"
                      " AND epoch = ? AND expires_at_ms > ?",
                      [now + ttl_ms, role, holder, epoch, now]).rowcount == 1


def release(db: Any, holder: str, epoch: int, role: str = SCHEDULER) -> bool:
    """End the lease ``holder`` holds at ``epoch`` now (a broker stopping: another takes over
    at once, not a ttl later); False where it no longer held it. The epoch stays: the next
    holder raises it."""
    return db.execute("UPDATE leadership SET expires_at_ms = 0 WHERE role = ? AND holder = ?"
                      " AND epoch = ?", [role, holder, epoch]).rowcount == 1


def leader(db: Any, role: str = SCHEDULER) -> tuple[str, int, int] | None:
    """The role's holder, epoch and lease end (ms), or None if it was never held."""
    row = db.execute("SELECT holder, epoch, expires_at_ms FROM leadership WHERE role = ?",
                     [role]).fetchone()
    return None if row is None or not row[0] else (row[0], row[1], row[2])


def fence(db: Any, epoch: int, now: int, role: str = SCHEDULER) -> None:
    """Claim the role's row for ``epoch`` in this transaction; raises Deposed where the role
    has another epoch now."""
    if db.execute("UPDATE leadership SET fenced_at_ms = ? WHERE role = ? AND epoch = ?",
                  [now, role, epoch]).rowcount != 1:
        raise Deposed(f"leadership epoch {epoch} of {role} has been superseded: this broker"
                      " no longer leads, its write is refused")


def fenced(db: Any, epoch: int, now: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(db, *args)`` in the same transaction as ``fence(db, epoch, now)``: the leader's
    write, refused whole (Deposed) once its epoch is superseded
    (``await store.write(fenced, epoch, now, fn, ...)``)."""
    fence(db, epoch, now)
    return fn(db, *args)
