"""The broker's settings, built once in main() and passed down."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BrokerConfig:
    data_dir: Path                         # holds broker.db, broker.key, artifacts/
    listen: str = "127.0.0.1:7070"         # gRPC HOST:PORT; port 0 picks a free port
    http: str = ""                         # HTTP HOST:PORT for health and metrics; "" = none
    lease_timeout_s: float = 15.0          # a lease not renewed by heartbeats this long is lost
    heartbeat_interval_s: float = 3.0      # what providers are told to send
    accept_within_s: float = 60.0          # a provider must accept a lease within this
    max_attempts: int = 5                  # leases a job may lose before it fails
    artifact_grace_s: float = 24 * 3600    # unreferenced blobs older than this are deleted
    gc_interval_s: float = 60.0            # how often to look for them
    max_artifact_bytes: int = 64 << 30     # largest blob accepted
    schedule_interval_s: float = 1.0       # placement pass at least this often
    shutdown_grace_s: float = 5.0          # in-flight RPCs get this long on SIGTERM

    @property
    def db_path(self) -> Path:
        return self.data_dir / "broker.db"

    @property
    def key_path(self) -> Path:
        return self.data_dir / "broker.key"
