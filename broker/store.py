"""SQLite through sqlite-utils: one writer thread, reader connections per thread.

Every write is a function run on the writer thread inside ``BEGIN IMMEDIATE`` …
``COMMIT``, so a state change and its event land together or not at all
(the datasette ``execute_write_fn`` pattern).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sqlite_utils import Database

from gpumarket.broker.schema import migrations

log = logging.getLogger(__name__)
T = TypeVar("T")

_STOP = object()


def connect(path: Path, *, readonly: bool = False) -> Database:
    """Open the database at ``path`` with the pragmas every connection needs."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    # Leases, nonces and events are ledger-like: an acknowledged write survives power loss.
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA busy_timeout=30000")
    if readonly:
        conn.execute("PRAGMA query_only=ON")
    return Database(conn)


class Store:
    """The broker's database: ``await write(fn, ...)`` and ``await read(fn, ...)``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._queue: queue.Queue[Any] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._local = threading.local()
        self._readers: list[Database] = []
        self._readers_lock = threading.Lock()

    def open(self) -> None:
        """Apply migrations and start the writer thread."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = connect(self.path)
        migrations.apply(db)
        self._writer = threading.Thread(
            target=self._write_loop, args=(db,), name="store-writer", daemon=True
        )
        self._writer.start()

    def close(self) -> None:
        if self._writer is not None:
            self._queue.put(_STOP)
            self._writer.join(timeout=30)
            self._writer = None
        with self._readers_lock:
            for db in self._readers:
                db.conn.close()
            self._readers.clear()

    def _write_loop(self, db: Database) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                db.conn.close()
                return
            fn, args, loop, future, transaction = item
            try:
                if not transaction:  # VACUUM cannot run inside a transaction
                    result = fn(db, *args)
                else:
                    db.conn.execute("BEGIN IMMEDIATE")
                    try:
                        result = fn(db, *args)
                    except BaseException:
                        db.conn.execute("ROLLBACK")
                        raise
                    db.conn.execute("COMMIT")
            except BaseException as exc:  # handed to the awaiting coroutine
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

    async def write(self, fn: Callable[..., T], *args: Any, transaction: bool = True) -> T:
        """Run ``fn(db, *args)`` in one IMMEDIATE transaction on the writer thread
        (``transaction=False``: outside one, for VACUUM)."""
        if self._writer is None:
            raise RuntimeError("store is not open")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put((fn, args, loop, future, transaction))
        return await future

    def backup_to(self, target: Path) -> None:
        """Copy the database to ``target`` with SQLite's online backup: a consistent
        snapshot, taken while writes go on (run it in a worker thread)."""
        source = sqlite3.connect(self.path, timeout=30)
        copy = sqlite3.connect(target)
        try:
            source.backup(copy)  # one step: a WAL reader never blocks the writer
        finally:
            copy.close()
            source.close()

    def _reader(self) -> Database:
        db = getattr(self._local, "db", None)
        if db is None:
            db = connect(self.path, readonly=True)
            self._local.db = db
            with self._readers_lock:
                self._readers.append(db)
        return db

    def read_sync(self, fn: Callable[..., T], *args: Any) -> T:
        db = self._reader()
        db.conn.execute("BEGIN")
        try:
            return fn(db, *args)
        finally:
            db.conn.execute("ROLLBACK")

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(db, *args)`` on a reader connection in a worker thread (one snapshot)."""
        return await asyncio.to_thread(self.read_sync, fn, *args)


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
