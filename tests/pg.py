"""A throwaway PostgreSQL cluster for the tests: one per test session (per xdist worker), in
a temporary directory, listening only on a unix socket there (no TCP port), fsync off; each
test gets a database of its own (``Cluster.database``), made in milliseconds.

initdb refuses to run as root: as root the cluster runs as ``nobody`` (``runuser``), its
directory owned by that user; the tests connect over the socket as the cluster's superuser
``gpumarket`` with trust authentication (only this machine's users reach the socket, in a
directory nobody else knows).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SUPERUSER = "gpumarket"
RUN_AS = "nobody"


def tools() -> Path | None:
    """The directory holding initdb and pg_ctl, or None where PostgreSQL is not installed."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return versions[-1].parent if versions else None


def missing() -> str:
    """Why the PostgreSQL tests cannot run here ("" where they can)."""
    if tools() is None:
        return "PostgreSQL is not installed (initdb not found; apt-get install postgresql)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install -e '.[postgresql]')"
    return ""


class Cluster:
    """A running cluster; ``url(name)`` addresses one of its databases."""

    def __init__(self, durable: bool = False) -> None:
        """``durable``: fsync on, as a real server (bench/pg_store.py); off for tests."""
        self.dir = Path(tempfile.mkdtemp(prefix="gpumarket-pg-"))
        self.data = self.dir / "data"
        self.socket = self.dir
        self._names = itertools.count(1)
        bindir = tools()
        assert bindir is not None, missing()
        self.bin = bindir
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.dir, RUN_AS)
            self._as_user = ["runuser", "-u", RUN_AS, "--"]
        self._run(str(bindir / "initdb"), "-D", str(self.data), "-U", SUPERUSER,
                  "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C.UTF-8")
        options = (f"-c listen_addresses='' -c unix_socket_directories={self.socket}"
                   " -c max_connections=200 -c shared_buffers=32MB")
        if not durable:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run(str(bindir / "pg_ctl"), "-D", str(self.data), "-o", options,
                  "-l", str(self.dir / "log"), "-w", "-t", "120", "start")

    def _run(self, *cmd: str) -> None:
        done = subprocess.run([*self._as_user, *cmd], capture_output=True, text=True,
                              cwd=self.dir)
        if done.returncode:
            log = (self.dir / "log").read_text() if (self.dir / "log").exists() else ""
            raise RuntimeError(f"{cmd[0]} failed: {done.stdout}{done.stderr}{log}")

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@/{dbname}?host={self.socket}"

    def database(self, template: str = "") -> str:
        """A new database's URL: empty, or a copy of the database named ``template``."""
        import psycopg

        name = f"t{os.getpid()}_{next(self._names)}"
        copy = f" TEMPLATE {template}" if template else ""
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}{copy}")
        return self.url(name)

    def stop(self) -> None:
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                      "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
