"""Copy a broker's SQLite database into a new PostgreSQL store: how a market that began on
one broker moves to several (docs/deploy.md). Offline — the broker is stopped first — and
whole or not at all: every table in one PostgreSQL transaction, into a database that holds
no market yet, then counted on both sides and the ledger audited there."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

from gpumarket.proto.errors import FailedPrecondition, InvalidArgument

BATCH = 1000
# Kept by each side's own migration runner (and the same on both once migrated).
SKIP = ("_sqlite_migrations", "sqlite_sequence")


def copy_to_postgres(source: Path, url: str,
                     said: Callable[[str], None] = lambda line: None) -> dict[str, int]:
    """Copy every table of the SQLite database at ``source`` into the PostgreSQL store at
    ``url``; return the rows copied per table. Both are first brought to this version's
    schema (as a broker starting on each would). Refused, with nothing written, if ``url``
    already holds jobs, providers, keys or postings, or if the ledger copied does not
    audit clean."""
    from gpumarket.broker.money import ledger
    from gpumarket.broker.store import postgres
    from gpumarket.broker.store.schema import migrations
    from gpumarket.broker.store.store import connect

    if not source.is_file():
        raise InvalidArgument(f"{source}: no such database (the broker's data_dir/broker.db)")
    try:
        src = connect(source)
        migrations.apply(src)       # what this version's broker would do on start
    except sqlite3.DatabaseError as exc:
        raise InvalidArgument(f"{source}: not a broker database ({exc})") from exc
    target = postgres.connect(url)
    try:
        postgres.migrate(target, migrations)
        raw = target.conn.raw
        tables = _in_order(src)
        theirs = _columns(raw)
        for table in tables:
            missing = set(_sqlite_columns(src, table)) - set(theirs.get(table, ()))
            if missing:
                raise FailedPrecondition(f"{postgres.redact(url)}: table {table} lacks"
                                         f" {', '.join(sorted(missing))}: not this version's"
                                         f" schema")
        copied: dict[str, int] = {}
        src.execute("BEGIN")        # one snapshot of the source, whatever writes it meanwhile
        before = _fingerprint(src)
        raw.execute("BEGIN")
        try:
            raw.execute("SELECT pg_advisory_xact_lock(%s)", (postgres.WRITE_LOCK,))
            for table in ("jobs", "providers", "ledger_accounts", "ledger_postings"):
                if table in theirs and raw.execute(
                        f"SELECT 1 FROM {postgres._quote(table)} LIMIT 1").fetchone():
                    raise FailedPrecondition(
                        f"{postgres.redact(url)} already holds a market ({table} has rows):"
                        f" copy only into a new, empty database")
            for table in tables:
                copied[table] = _copy_table(src, raw, table)
                said(f"{table}: {copied[table]:,} rows")
            _restart_identities(raw)
            problems = ledger.audit(postgres.PgDatabase(raw))
            if problems:
                raise FailedPrecondition("the ledger copied does not audit clean: "
                                         + "; ".join(problems[:3]))
            for table, n in copied.items():
                there = raw.execute(f"SELECT count(*) FROM {postgres._quote(table)}"
                                    ).fetchone()[0]
                if there != n:
                    raise FailedPrecondition(f"{table}: {n} rows read, {there} there")
            src.execute("COMMIT")
            if _fingerprint(src) != before:
                raise FailedPrecondition(f"{source} changed while it was copied: is its broker"
                                         f" still running? Stop it and copy again")
            raw.execute("COMMIT")
        except BaseException:
            raw.execute("ROLLBACK")
            raise
        return copied
    finally:
        src.conn.close()
        target.conn.close()


def _fingerprint(src) -> tuple:
    """What a running broker changes at every step of a job or of the books."""
    return tuple(src.execute(f'SELECT count(*), max(rowid) FROM "{t}"').fetchone()
                 for t in ("jobs", "events", "leases", "ledger_postings", "providers"))


def _sqlite_columns(src, table: str) -> list[str]:
    return [r[1] for r in src.execute(f'PRAGMA table_info("{table}")').fetchall()]


def _columns(raw) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for table, column in raw.execute(
            "SELECT table_name, column_name FROM information_schema.columns"
            " WHERE table_schema = current_schema() ORDER BY ordinal_position").fetchall():
        found.setdefault(table, []).append(column)
    return found


def _in_order(src) -> list[str]:
    """The tables, each after those its foreign keys name (a table naming itself — a job's
    parent — is handled row by row in _copy_table)."""
    names = [r[0] for r in src.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name").fetchall()
        if r[0] not in SKIP and not r[0].startswith("sqlite_")]
    needs = {t: {r[2] for r in src.execute(f'PRAGMA foreign_key_list("{t}")').fetchall()}
             - {t} for t in names}
    ordered: list[str] = []
    while len(ordered) < len(names):
        ready = [t for t in names if t not in ordered and needs[t] <= set(ordered)]
        if not ready:       # a cycle between tables: not in this schema; copy as listed
            ready = [t for t in names if t not in ordered]
        ordered += ready
    return ordered


def _copy_table(src, raw, table: str) -> int:
    """Copy one table's rows. A column naming a row of its own table (jobs.parent_id) is
    written empty first and set once every row is there."""
    from gpumarket.broker.store.postgres import _quote, _value

    columns = _sqlite_columns(src, table)
    own = [r[3] for r in src.execute(f'PRAGMA foreign_key_list("{table}")').fetchall()
           if r[2] == table]
    keys = [r[1] for r in sorted((r for r in src.execute(f'PRAGMA table_info("{table}")')
                                  if r[5]), key=lambda r: r[5])]
    names = ", ".join(_quote(c) for c in columns)
    insert = (f"INSERT INTO {_quote(table)} ({names}) VALUES"
              f" ({', '.join(['%s'] * len(columns))})")
    later: list[tuple] = []
    n = 0
    cur = src.execute(f'SELECT {", ".join(chr(34) + c + chr(34) for c in columns)}'
                      f' FROM "{table}"')
    with raw.cursor() as out:
        while rows := cur.fetchmany(BATCH):
            batch = []
            for row in rows:
                values = [_value(v) for v in row]
                for col in own:
                    i = columns.index(col)
                    if values[i] is not None:
                        later.append((values[i], *(row[columns.index(k)] for k in keys), col))
                        values[i] = None
                batch.append(values)
            out.executemany(insert, batch)
            n += len(batch)
        where = " AND ".join(f"{_quote(k)} = %s" for k in keys)
        for value, *key, col in later:
            out.execute(f"UPDATE {_quote(table)} SET {_quote(col)} = %s WHERE {where}",
                        (value, *key))
    return n


def _restart_identities(raw) -> None:
    """Identity columns (INTEGER PRIMARY KEY on SQLite) go on after the highest copied."""
    for table, column in raw.execute(
            "SELECT table_name, column_name FROM information_schema.columns"
            " WHERE table_schema = current_schema() AND is_identity = 'YES'").fetchall():
        top = raw.execute(f'SELECT max("{column}") FROM "{table}"').fetchone()[0]
        if top is not None:
            raw.execute(f'ALTER TABLE "{table}" ALTER COLUMN "{column}" RESTART WITH {top + 1}')
