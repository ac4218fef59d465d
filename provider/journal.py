"""The provider's local journal of its jobs (SQLite), so a restarted daemon can re-attach to
running jobs, finish or report the ones that ended while it was down, and re-send results
the broker has not acknowledged."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Entry:
    job_id: str
    epoch: int
    lease: bytes           # the signed Lease envelope, as received (checked when accepted)
    workdir: str
    pid: int               # 0 until the job process has started
    final: bytes | None    # the serialized final ProviderMessage, once there is one


class Journal:
    """Small and synchronous: the daemon calls it through asyncio.to_thread."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS jobs (job_id TEXT NOT NULL, epoch INTEGER NOT NULL,"
            " lease BLOB NOT NULL, workdir TEXT NOT NULL, pid INTEGER NOT NULL DEFAULT 0,"
            " final BLOB, PRIMARY KEY (job_id, epoch))")

    def add(self, job_id: str, epoch: int, lease: bytes, workdir: str) -> None:
        self.conn.execute("INSERT OR REPLACE INTO jobs (job_id, epoch, lease, workdir)"
                          " VALUES (?, ?, ?, ?)", [job_id, epoch, lease, workdir])

    def set_pid(self, job_id: str, epoch: int, pid: int) -> None:
        self.conn.execute("UPDATE jobs SET pid = ? WHERE job_id = ? AND epoch = ?",
                          [pid, job_id, epoch])

    def set_final(self, job_id: str, epoch: int, final: bytes) -> None:
        self.conn.execute("UPDATE jobs SET final = ? WHERE job_id = ? AND epoch = ?",
                          [final, job_id, epoch])

    def remove(self, job_id: str, epoch: int) -> None:
        self.conn.execute("DELETE FROM jobs WHERE job_id = ? AND epoch = ?", [job_id, epoch])

    def entries(self) -> list[Entry]:
        rows = self.conn.execute(
            "SELECT job_id, epoch, lease, workdir, pid, final FROM jobs ORDER BY rowid").fetchall()
        return [Entry(*r) for r in rows]

    def close(self) -> None:
        self.conn.close()
