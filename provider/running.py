"""One leased job as the daemon keeps it: its assignment, work directory, process, and the
state of its checkpoint uploads."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.provider.executor import JobProcess
from gpumarket.provider.leases import Assignment


@dataclass(eq=False)
class RunningJob:
    assignment: Assignment
    workdir: Path
    process: JobProcess | None = None
    cancelled: bool = False
    last_progress: float = 0.0
    task: asyncio.Task | None = field(default=None, repr=False)
    pending_checkpoint: tuple[int, Path, float] | None = None
    uploader: asyncio.Task | None = field(default=None, repr=False)
    uploaded_step: int = 0
    checkpoint_report: gw.ProviderMessage | None = None   # the latest, re-sent on reconnect

    @property
    def key(self) -> tuple[str, int]:
        return self.assignment.lease.job_id, self.assignment.lease.epoch

    @property
    def devices(self) -> set[int]:
        return set(self.assignment.lease.device_indices)
