"""The provider's settings, built once in main() and passed down."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProviderConfig:
    broker: str                          # broker gRPC address HOST:PORT
    data_dir: Path                       # key, journal, benchmark cache, job work dirs
    price_per_gpu_hour: float = 1.0      # credits per device-hour
    max_runtime_s: int = 24 * 3600       # wall-time limit per job unless the job asks less
    cancel_grace_s: float = 10.0         # SIGTERM, then SIGKILL after this
    drain_timeout_s: float = 120.0       # longest a drain waits for jobs to checkpoint and stop
    progress_interval_s: float = 0.25    # at most this often a progress update goes up
    rpc_timeout_s: float = 30.0          # deadline on each unary call to the broker
    backoff_max_s: float = 30.0          # longest wait between reconnects
    cpu_only: bool = False               # advertise the CPU even where GPUs are present

    @property
    def key_path(self) -> Path:
        return self.data_dir / "provider.key"

    @property
    def jobs_dir(self) -> Path:
        return self.data_dir / "jobs"

    @property
    def cache_dir(self) -> Path:
        return self.data_dir / "cache"
