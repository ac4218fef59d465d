"""The broker's store on PostgreSQL (psycopg 3), beside SQLite: the same ``Store`` interface,
the same migrations, the same module SQL.

The domain modules are written against the small part of sqlite-utils' ``Database`` they use;
``PgDatabase`` gives psycopg that part and nothing more:

- ``db.execute(sql, params)``, ``db.conn.execute``, ``db.conn.executemany`` (a cursor with
  ``fetchone``, ``fetchall``, ``rowcount``, ``description``, iteration), ``db.query`` (dicts);
- ``db[table].insert(row)`` (with ``last_pk``), ``.insert_all(rows)``, ``.upsert(row, pk=…)``.

The SQL is the modules' own: ``?`` placeholders become psycopg's ``%s`` (``translate``), and the
few SQLite functions the modules call whose PostgreSQL spelling differs (two-argument
``max``/``min``, ``json_extract``) exist on PostgreSQL as functions of the same name
(``SHIMS``). Values cross as SQLite's would: a Python bool is stored as 0/1 (the columns are
integers on both), a numeric result (``SUM`` of integers) comes back as an int, and a NUL in a
string (which PostgreSQL's text cannot hold) is stored as U+FFFD.

The schema has one source, the migrations in ``schema.py``: on PostgreSQL each migration's DDL
is translated as it runs (``translate_ddl``: integer types to BIGINT, REAL to DOUBLE PRECISION,
BLOB to BYTEA, a rowid key to an identity column, SQLite's RAISE triggers to a trigger
function), and applied migrations are recorded in ``_gpumarket_migrations``.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

MIGRATIONS_TABLE = "_gpumarket_migrations"
# Every write transaction holds this transaction-level advisory lock: the writes of every
# broker on the database are serialized as SQLite's single writer serializes one broker's, so
# a domain function's read-then-write holds on PostgreSQL as it does on SQLite. (Row locks and
# SKIP LOCKED, where placement needs more than one writer, are the next step: issue 36.)
WRITE_LOCK = 0x67707574_6d6b7431   # "gputmkt1"

SHIMS = (
    # SQLite's scalar max()/min() of two values (PostgreSQL's GREATEST/LEAST; the one-argument
    # aggregates are untouched: overloads by argument count).
    "CREATE OR REPLACE FUNCTION max(a INTEGER, b INTEGER) RETURNS INTEGER"
    " LANGUAGE sql IMMUTABLE AS 'SELECT GREATEST(a, b)'",
    "CREATE OR REPLACE FUNCTION min(a INTEGER, b INTEGER) RETURNS INTEGER"
    " LANGUAGE sql IMMUTABLE AS 'SELECT LEAST(a, b)'",
    "CREATE OR REPLACE FUNCTION max(a BIGINT, b BIGINT) RETURNS BIGINT"
    " LANGUAGE sql IMMUTABLE AS 'SELECT GREATEST(a, b)'",
    "CREATE OR REPLACE FUNCTION min(a BIGINT, b BIGINT) RETURNS BIGINT"
    " LANGUAGE sql IMMUTABLE AS 'SELECT LEAST(a, b)'",
    "CREATE OR REPLACE FUNCTION max(a DOUBLE PRECISION, b DOUBLE PRECISION)"
    " RETURNS DOUBLE PRECISION LANGUAGE sql IMMUTABLE AS 'SELECT GREATEST(a, b)'",
    "CREATE OR REPLACE FUNCTION min(a DOUBLE PRECISION, b DOUBLE PRECISION)"
    " RETURNS DOUBLE PRECISION LANGUAGE sql IMMUTABLE AS 'SELECT LEAST(a, b)'",
    # json_extract(doc, '$.a.b') of a JSON object's member, as text (NULL where absent); a
    # number compared as one is CAST in the module's SQL, which both dialects read alike.
    # json_each(?) of a JSON array (the modules pass lists of ids so): its elements as text.
    "CREATE OR REPLACE FUNCTION json_each(doc TEXT) RETURNS TABLE (key BIGINT, value TEXT)"
    " LANGUAGE sql IMMUTABLE AS"
    " $$SELECT n - 1, v FROM jsonb_array_elements_text(doc::jsonb) WITH ORDINALITY AS e(v, n)$$",
    "CREATE OR REPLACE FUNCTION json_extract(doc TEXT, path TEXT) RETURNS TEXT"
    " LANGUAGE sql IMMUTABLE AS"
    " $$SELECT jsonb_extract_path_text(doc::jsonb,"
    " VARIADIC string_to_array(substr(path, 3), '.'))$$",
)


@functools.lru_cache(maxsize=4096)
def translate(sql: str, named: bool = False) -> str:
    """The module's SQL with its placeholders as psycopg's: ``?`` as ``%s`` (``named``:
    ``:name`` as ``%(name)s``), and a literal ``%`` as ``%%``; inside a quoted string nothing
    is a placeholder."""
    parts = re.split(r"('(?:[^']|'')*')", sql)
    out = []
    for i, part in enumerate(parts):
        part = part.replace("%", "%%")
        if not i % 2:
            part = (_NAMED.sub(r"%(\1)s", part) if named else part.replace("?", "%s"))
        out.append(part)
    return "".join(out)


_NAMED = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


def _bind(sql: str, params: Sequence[Any] | Mapping[str, Any] | None) -> tuple[str, Any]:
    if params is None:      # no placeholders: psycopg reads the SQL as it is (% included)
        return sql, None
    if isinstance(params, Mapping):
        return translate(sql, True), {k: _value(v) for k, v in params.items()}
    return translate(sql), _params(params)


_TRIGGER = re.compile(
    r"CREATE TRIGGER (\w+) (BEFORE|AFTER) (UPDATE|DELETE|INSERT) ON (\w+)"
    r" BEGIN SELECT RAISE\(ABORT, '([^']*)'\); END", re.S)
_DDL_TYPES = (
    (re.compile(r"\bINTEGER PRIMARY KEY( AUTOINCREMENT)?\b"),
     "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"),
    (re.compile(r"\bINTEGER\b"), "BIGINT"),
    (re.compile(r"\bREAL\b"), "DOUBLE PRECISION"),
    (re.compile(r"\bBLOB\b"), "BYTEA"),
    (re.compile(r"\)\s*WITHOUT ROWID\s*$"), ")"),
)


def translate_ddl(sql: str) -> list[str]:
    """A migration's statement as the PostgreSQL statements that do the same (the statement
    itself where it is not DDL)."""
    head = sql.lstrip()[:40].upper()
    trigger = _TRIGGER.fullmatch(sql.strip())
    if trigger:
        name, when, action, table, message = trigger.groups()
        return [f"CREATE OR REPLACE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql"
                f" AS $$BEGIN RAISE EXCEPTION '{message}'; END$$",
                f"CREATE TRIGGER {name} {when} {action} ON {table}"
                f" FOR EACH ROW EXECUTE FUNCTION {name}()"]
    if head.startswith(("CREATE TABLE", "ALTER TABLE")):
        for pattern, replacement in _DDL_TYPES:
            sql = pattern.sub(replacement, sql)
    return [sql]


def _value(v: Any) -> Any:
    t = type(v)
    if t is str:
        # PostgreSQL's text cannot hold NUL, SQLite's can: a stranger's string with one (a
        # provider's log line or error) must not fail the write that carries it.
        return v.replace("\x00", "\ufffd") if "\x00" in v else v
    if t is bool:
        return int(v)
    if t.__module__ == "numpy":
        return v.item()
    return v


def _params(params: Sequence[Any] | None) -> tuple:
    return tuple(_value(v) for v in params) if params else ()


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


@functools.lru_cache(maxsize=256)
def _insert_sql(table: str, cols: tuple[str, ...]) -> str:
    """An INSERT of a row of ``cols`` into ``table`` (made once: the writes insert the same
    rows again and again)."""
    return (f"INSERT INTO {_quote(table)} ({', '.join(map(_quote, cols))})"
            f" VALUES ({', '.join(['%s'] * len(cols))})")


class PipelinedCursor:
    """The cursor of a statement sent in pipeline mode (``PgConnection.pipelined``): sent,
    not yet answered. Reading its rows waits for them (psycopg flushes the pipeline); so does
    reading ``rowcount`` or ``description``, which psycopg would give before the answer came
    (-1, None): a module's conditional UPDATE (the leader's fence) reads its real rowcount."""

    __slots__ = ("cur", "pipeline")

    def __init__(self, cur: Any, pipeline: Any) -> None:
        self.cur = cur
        self.pipeline = pipeline

    def _answered(self) -> Any:
        if self.cur.pgresult is None:
            self.pipeline.sync()
        return self.cur

    @property
    def rowcount(self) -> int:
        return self._answered().rowcount

    @property
    def description(self) -> Any:
        return self._answered().description

    def fetchone(self) -> Any:
        return self.cur.fetchone()

    def fetchall(self) -> list:
        return self.cur.fetchall()

    def fetchmany(self, size: int = 0) -> list:
        return self.cur.fetchmany(size)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.cur)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._answered(), name)


class PgConnection:
    """What ``db.conn`` is to the modules: execute, executemany, in_transaction, close.

    Inside ``pipelined()`` (the store's write transactions) a statement is sent without
    waiting for its answer: only a statement whose result is read waits, and then for every
    statement sent before it in the same round trip (psycopg 3's pipeline mode). A write's
    INSERTs and UPDATEs whose results nobody reads so cost no round trip of their own."""

    def __init__(self, conn: Any) -> None:
        self.raw = conn
        self.pipeline: Any = None       # psycopg's Pipeline while pipelined

    def execute(self, sql: str, params: Sequence[Any] | Mapping[str, Any] | None = None) -> Any:
        cur = self.raw.execute(*_bind(sql, params))
        return cur if self.pipeline is None else PipelinedCursor(cur, self.pipeline)

    @contextlib.contextmanager
    def pipelined(self) -> Iterator[Any]:
        """Pipeline mode for the block; yields psycopg's Pipeline (``sync()``: send what is
        queued, wait for every answer, raise the first error among them). Leaving the block
        syncs."""
        with self.raw.pipeline() as pipeline:
            self.pipeline = pipeline
            try:
                yield pipeline
            finally:
                self.pipeline = None

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Any:
        cur = self.raw.cursor()
        cur.executemany(translate(sql), [_params(r) for r in rows])
        return cur

    @property
    def in_transaction(self) -> bool:
        from psycopg.pq import TransactionStatus

        return not self.closed and self.raw.info.transaction_status in (
            TransactionStatus.ACTIVE, TransactionStatus.INTRANS, TransactionStatus.INERROR)

    @property
    def closed(self) -> bool:
        return self.raw.closed or self.raw.broken

    def close(self) -> None:
        self.raw.close()


class PgTable:
    """The part of a sqlite-utils ``Table`` the modules use."""

    def __init__(self, db: PgDatabase, name: str) -> None:
        self.db = db
        self.name = name
        self.last_pk: Any = None

    def insert(self, row: dict[str, Any]) -> PgTable:
        keys = self.db.primary_key(self.name)
        sql = _insert_sql(self.name, tuple(row))
        missing = [k for k in keys if k not in row]
        if missing:         # a generated key: what sqlite-utils gives as last_pk (the rowid)
            sql += f" RETURNING {', '.join(map(_quote, keys))}"
        cur = self.db.conn.raw.execute(sql, _params(row.values()))
        got = cur.fetchone() if missing else tuple(row[k] for k in keys)
        self.last_pk = got[0] if len(keys) == 1 else tuple(got)
        return self

    def insert_all(self, rows: Iterable[dict[str, Any]]) -> PgTable:
        """The rows inserted in order, each run of rows with the same columns as one
        executemany: on the store's pipelined connection, one statement prepared once and
        its rows sent without a round trip each (a pass's leases). ``last_pk`` is not set."""
        batch: list[dict[str, Any]] = []
        for row in rows:
            if batch and row.keys() != batch[0].keys():
                self._insert_rows(batch)
                batch = []
            batch.append(row)
        if batch:
            self._insert_rows(batch)
        return self

    def _insert_rows(self, rows: list[dict[str, Any]]) -> None:
        cols = tuple(rows[0])
        self.db.conn.raw.cursor().executemany(_insert_sql(self.name, cols),
                                              [_params([row[c] for c in cols]) for row in rows])

    def upsert(self, row: dict[str, Any], pk: str | Sequence[str] | None = None) -> PgTable:
        keys = [pk] if isinstance(pk, str) else list(pk or self.db.primary_key(self.name))
        cols = list(row)
        rest = [c for c in cols if c not in keys]
        action = (f"DO UPDATE SET {', '.join(f'{_quote(c)} = EXCLUDED.{_quote(c)}' for c in rest)}"
                  if rest else "DO NOTHING")
        self.db.conn.raw.execute(
            f"INSERT INTO {_quote(self.name)} ({', '.join(map(_quote, cols))})"
            f" VALUES ({', '.join(['%s'] * len(cols))})"
            f" ON CONFLICT ({', '.join(map(_quote, keys))}) {action}",
            _params([row[c] for c in cols]))
        self.last_pk = row[keys[0]] if len(keys) == 1 else tuple(row[k] for k in keys)
        return self


class PgDatabase:
    """The part of a sqlite-utils ``Database`` the broker's modules use, on one psycopg
    connection (autocommit: the store issues BEGIN/COMMIT itself, as it does on SQLite)."""

    dialect = "postgresql"

    def __init__(self, conn: Any) -> None:
        self.conn = PgConnection(conn)
        self._keys: dict[str, list[str]] = {}

    def execute(self, sql: str, params: Sequence[Any] | None = None) -> Any:
        return self.conn.execute(sql, params)

    def query(self, sql: str, params: Sequence[Any] | None = None) -> Iterator[dict[str, Any]]:
        cur = self.conn.execute(sql, params)
        cols = [d[0] for d in cur.description]
        for row in cur:
            yield dict(zip(cols, row))

    def __getitem__(self, table: str) -> PgTable:
        return PgTable(self, table)

    def primary_key(self, table: str) -> list[str]:
        keys = self._keys.get(table)
        if keys is None:
            keys = [r[0] for r in self.conn.raw.execute(
                "SELECT a.attname FROM pg_index i JOIN pg_attribute a"
                " ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)"
                " WHERE i.indrelid = %s::regclass AND i.indisprimary"
                " ORDER BY array_position(i.indkey, a.attnum)", (table,)).fetchall()]
            self._keys[table] = keys
        return keys


class MigratingDatabase(PgDatabase):
    """A ``PgDatabase`` whose statements are a migration's: DDL is translated first."""

    def execute(self, sql: str, params: Sequence[Any] | None = None) -> Any:
        cur = None
        for statement in translate_ddl(sql):
            cur = self.conn.execute(statement, params)
        return cur


def redact(url: str) -> str:
    """``url`` without the password it may carry (for messages and logs)."""
    return re.sub(r"(://[^:@/]*):[^@]*@", r"\1:***@", url)


def connect(url: str) -> PgDatabase:
    """A connection to the database at ``url`` (a libpq URL or conninfo string), autocommit,
    with numeric results loaded as SQLite gives them (an int where integral, else a float).
    Raises Unavailable (one line, no password) where it cannot connect."""
    from gpumarket.proto.errors import Unavailable

    try:
        import psycopg
        from psycopg.types.numeric import NumericLoader
    except ImportError as exc:
        raise Unavailable("the store is PostgreSQL but psycopg is not installed"
                          " (pip install 'gpumarket[postgresql]')") from exc

    class Number(NumericLoader):
        def load(self, data: Any) -> Any:
            d = super().load(data)
            return int(d) if d == d.to_integral_value() else float(d)

    try:
        conn = psycopg.connect(url, autocommit=True, connect_timeout=30)
    except psycopg.Error as exc:
        detail = " ".join(str(exc).split())[:300]
        raise Unavailable(f"cannot connect to the store {redact(url)}: {detail}") from exc
    conn.adapters.register_loader("numeric", Number)
    return PgDatabase(conn)


def migrate(db: PgDatabase, migrations: Any) -> list[str]:
    """Apply the migrations ``db`` has not had, each in its own transaction, under the write
    lock (brokers starting together migrate once); return the names applied."""
    raw = db.conn.raw
    raw.execute("BEGIN")    # brokers starting together: CREATE OR REPLACE would race
    try:
        raw.execute("SELECT pg_advisory_xact_lock(%s)", (WRITE_LOCK,))
        for statement in SHIMS:
            raw.execute(statement)
        raw.execute(f"CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE}"
                    " (name TEXT PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())")
        raw.execute("COMMIT")
    except BaseException:
        raw.execute("ROLLBACK")
        raise
    steps = MigratingDatabase(raw)
    applied = []
    # sqlite-utils keeps its registered migrations in order in ``_migrations`` (name, fn).
    for migration in migrations._migrations:
        raw.execute("BEGIN")
        try:
            raw.execute("SELECT pg_advisory_xact_lock(%s)", (WRITE_LOCK,))
            done = raw.execute(f"SELECT 1 FROM {MIGRATIONS_TABLE} WHERE name = %s",
                               (migration.name,)).fetchone()
            if not done:
                migration.fn(steps)
                raw.execute(f"INSERT INTO {MIGRATIONS_TABLE} (name) VALUES (%s)",
                            (migration.name,))
                applied.append(migration.name)
            raw.execute("COMMIT")
        except BaseException:
            raw.execute("ROLLBACK")
            raise
    return applied

