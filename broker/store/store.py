"""The broker's store: one writer thread, reader connections per thread; SQLite through
sqlite-utils (the default), or PostgreSQL (``PgStore``, broker/store/postgres.py) with the same
interface.

Every write is a function run on the writer thread inside ``BEGIN IMMEDIATE`` …
``COMMIT``, so a state change and its event land together or not at all
(the datasette ``execute_write_fn`` pattern). Writes queued while the writer was busy are
committed together (group commit): each in its own savepoint, one fsync for all, every
caller answered once its write is durable.
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

from gpumarket.broker.store.schema import migrations

log = logging.getLogger(__name__)
T = TypeVar("T")

_STOP = object()
MAX_GROUP = 256     # writes committed together at most


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


def vacuum(db: Database) -> None:
    """Rewrite the database compactly and empty its write-ahead log (outside a
    transaction: `admin vacuum`)."""
    db.execute("VACUUM")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def ready_probe(db: Database) -> None:
    """A write that touches no table: whether the database takes writes (/readyz)."""
    db.execute("CREATE TEMP TABLE IF NOT EXISTS _ready (x INTEGER)")


def is_postgres(location: str) -> bool:
    return location.startswith(("postgresql://", "postgres://"))


def open_store(location: str, default: Path) -> Store:
    """The store at ``location`` (``--store``): ``postgresql://…`` a ``PgStore``;
    ``sqlite:///PATH`` or "" (``default``, the data directory's broker.db) SQLite. Not yet
    opened. Raises ValueError for any other form."""
    if is_postgres(location):
        return PgStore(location)
    if not location:
        return Store(default)
    if location.startswith("sqlite:///") and len(location) > len("sqlite:///"):
        return Store(Path(location[len("sqlite://"):]))
    raise ValueError(f"--store {location.split('://')[0]}://…: give postgresql://… or"
                     " sqlite:///PATH")


class Store:
    """The broker's database: ``await write(fn, ...)`` and ``await read(fn, ...)``."""

    dialect = "sqlite"

    def __init__(self, path: Path | None) -> None:
        self.path = path            # the SQLite file (None on PostgreSQL)
        self._queue: queue.Queue[Any] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._local = threading.local()
        self._readers: list[Database] = []
        self._readers_lock = threading.Lock()
        self.groups = 0             # transactions committed, and the writes in them
        self.grouped = 0

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
        """Group commit: the writes queued together run in one transaction, each inside its
        own savepoint (one that raises is rolled back alone, as if it had its own
        transaction), in the order they were queued; one COMMIT (one fsync) makes them all
        durable, and only then is each caller answered."""
        while True:
            batch = [self._queue.get()]
            while len(batch) < MAX_GROUP and batch[-1] is not _STOP and batch[-1][4]:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            group = [item for item in batch if item is not _STOP and item[4]]
            if group:
                self._commit_group(db, group)
            for item in batch:
                if item is _STOP:
                    db.conn.close()
                    return
                if not item[4]:            # VACUUM cannot run inside a transaction
                    fn, args, loop, future, _ = item
                    try:
                        result = fn(db, *args)
                    except BaseException as exc:
                        loop.call_soon_threadsafe(_settle, future, None, exc)
                    else:
                        loop.call_soon_threadsafe(_settle, future, result, None)

    def _commit_group(self, db: Database, group: list) -> None:
        outcomes = []
        try:
            self._begin_write(db)
            for fn, args, _, _, _ in group:
                db.conn.execute("SAVEPOINT write")
                try:
                    outcomes.append((fn(db, *args), None))
                except BaseException as exc:
                    db.conn.execute("ROLLBACK TO write")
                    outcomes.append((None, exc))
                db.conn.execute("RELEASE write")
            db.conn.execute("COMMIT")
        except BaseException as exc:     # the transaction itself failed: nothing was written
            if db.conn.in_transaction:
                db.conn.execute("ROLLBACK")
            outcomes = [(None, exc)] * len(group)
        self.groups += 1
        self.grouped += len(group)
        for (_, _, loop, future, _), (result, exc) in zip(group, outcomes):
            loop.call_soon_threadsafe(_settle, future, result, exc)

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

    # What differs between the two databases: connections and how a transaction begins.
    def _begin_write(self, db: Database) -> None:
        db.conn.execute("BEGIN IMMEDIATE")

    def _begin_read(self, db: Database) -> None:
        db.conn.execute("BEGIN")

    def _connect_reader(self) -> Database:
        return connect(self.path, readonly=True)

    def _reader(self) -> Database:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._connect_reader()
            self._local.db = db
            with self._readers_lock:
                self._readers.append(db)
        return db

    def read_sync(self, fn: Callable[..., T], *args: Any) -> T:
        db = self._reader()
        self._begin_read(db)
        try:
            return fn(db, *args)
        finally:
            db.conn.execute("ROLLBACK")

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(db, *args)`` on a reader connection in a worker thread (one snapshot)."""
        return await asyncio.to_thread(self.read_sync, fn, *args)


class PgStore(Store):
    """The broker's store on PostgreSQL at ``url`` (broker/store/postgres.py): the same
    group commit on one writer connection, every write transaction under the database-wide
    write lock (so brokers sharing the database write one at a time, as one broker's writes
    do on SQLite); reads in REPEATABLE READ, READ ONLY transactions (one snapshot each).
    A connection the server dropped is opened again for the next transaction."""

    dialect = "postgresql"

    def __init__(self, url: str) -> None:
        super().__init__(None)
        self.url = url

    def open(self) -> None:
        from gpumarket.broker.store import postgres
        from gpumarket.proto.errors import Unavailable

        db = postgres.connect(self.url)     # says so where psycopg is not installed
        import psycopg

        try:
            postgres.migrate(db, migrations)
        except psycopg.Error as exc:
            db.conn.close()
            detail = " ".join(str(exc).split())[:300]
            raise Unavailable(f"cannot migrate the store {postgres.redact(self.url)}:"
                              f" {detail}") from exc
        self._writer = threading.Thread(
            target=self._write_loop, args=(db,), name="store-writer", daemon=True
        )
        self._writer.start()

    def _begin(self, db: Database, sql: str) -> None:
        """Begin a transaction; where the server dropped the connection (a restart, a
        failover) connect again and begin there: nothing of this transaction was sent yet.
        Raises Unavailable where the server cannot be reached."""
        import psycopg

        from gpumarket.broker.store import postgres

        try:
            db.conn.execute(sql)
            return
        except psycopg.OperationalError:
            if not db.conn.closed:
                raise
        log.warning("the store's connection was lost; connecting again")
        db.conn.close()
        db.conn.raw = postgres.connect(self.url).conn.raw
        db.conn.execute(sql)

    def _begin_write(self, db: Database) -> None:
        from gpumarket.broker.store.postgres import WRITE_LOCK

        self._begin(db, "BEGIN")
        db.conn.execute("SELECT pg_advisory_xact_lock(?)", [WRITE_LOCK])

    def _commit_group(self, db: Database, group: list) -> None:
        """The group commit of ``Store``, its statements pipelined (psycopg 3's pipeline
        mode, ``PgConnection.pipelined``): a statement whose result a write does not read
        waits for no answer, so a write costs the round trips of what it reads, plus one at
        its end (``sync``) where the errors of what it sent are raised — in its own savepoint,
        so a write that fails is still rolled back alone and told so. Each caller is answered
        once the COMMIT has been answered (durable, as on SQLite)."""
        import psycopg

        from gpumarket.broker.store.postgres import WRITE_LOCK

        outcomes = []
        try:
            self._begin(db, "BEGIN")    # not pipelined: a dropped connection is opened again
            with db.conn.pipelined() as pipeline:
                db.conn.execute("SELECT pg_advisory_xact_lock(?)", [WRITE_LOCK])
                for fn, args, _, _, _ in group:
                    db.conn.execute("SAVEPOINT write")
                    try:
                        result = fn(db, *args)
                        pipeline.sync()
                    except BaseException as exc:
                        try:
                            pipeline.sync()     # the pipeline takes statements again
                        except psycopg.Error:
                            pass                # what the write's error aborted
                        db.conn.execute("ROLLBACK TO write")
                        outcomes.append((None, exc))
                    else:
                        outcomes.append((result, None))
                    db.conn.execute("RELEASE write")
                db.conn.execute("COMMIT")
                pipeline.sync()
        except BaseException as exc:     # the transaction itself failed: nothing was written
            try:
                if db.conn.in_transaction:
                    db.conn.execute("ROLLBACK")
            except psycopg.Error:
                log.warning("the store's connection failed; it is opened again for the"
                            " next transaction")
            outcomes = [(None, exc)] * len(group)
        self.groups += 1
        self.grouped += len(group)
        for (_, _, loop, future, _), (result, exc) in zip(group, outcomes):
            loop.call_soon_threadsafe(_settle, future, result, exc)

    def _begin_read(self, db: Database) -> None:
        self._begin(db, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")

    def _connect_reader(self) -> Database:
        from gpumarket.broker.store import postgres

        return postgres.connect(self.url)

    def backup_to(self, target: Path) -> None:
        raise NotImplementedError("the store is PostgreSQL: back it up with pg_dump"
                                  " (docs/deploy.md)")


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
