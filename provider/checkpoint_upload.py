"""A running job's checkpoints on their way to the broker: the newest one it reported is
packed (walked without following links: the job's files are hostile), uploaded to the
artifact store and reported; older ones are skipped and, once a newer one is up, removed."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Protocol

from gpumarket.proto.errors import GpumarketError
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider import checkpoints, jobfiles

log = logging.getLogger(__name__)


class Store(Protocol):
    """What checkpoint uploads ask of the daemon: the session to the broker and its
    artifact store."""

    def send(self, message: gw.ProviderMessage) -> None: ...
    async def upload(self, source: Path | int, name: str,
                     digest: tuple[str, int] | None = None) -> pb.ArtifactRef: ...


class CheckpointUploads:
    """One lease's checkpoints. ``update`` makes the lease's JobUpdate message of its
    fields; ``owner`` is the job's uid (only its files are packed); ``step`` the step the
    lease resumed from (nothing at or before it goes up again)."""

    def __init__(self, workdir: Path, owner: int, host: Store,
                 update: Callable[..., gw.ProviderMessage], step: int = 0) -> None:
        self.workdir = workdir
        self.owner = owner
        self.host = host
        self.update = update
        self.uploaded_step = step
        self.pending: tuple[int, str, float] | None = None    # the newest not yet up
        self.report: gw.ProviderMessage | None = None     # the latest sent, re-sent on resume
        self.task: asyncio.Task | None = None

    def reported(self, step: int, path: str, write_seconds: float) -> None:
        """The job wrote checkpoint ``path`` (relative to its work dir) at ``step``: it goes
        up after the one going up now, unless a newer one comes first."""
        self.pending = (step, path, write_seconds)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self.upload())

    def cancel(self) -> None:
        """Stop uploading (the job ended without needing its checkpoints)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()

    async def finish(self) -> None:
        """Wait for the upload in flight (and any pending after it) to end."""
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)

    async def upload(self) -> None:
        """Upload the newest pending checkpoint (older pending ones are skipped)."""
        while self.pending is not None:
            step, path, write_s = self.pending
            self.pending = None
            if step <= self.uploaded_step:
                continue
            upload_dir = self.workdir / "upload"
            upload_dir.mkdir(exist_ok=True)
            tar = upload_dir / f"step-{step:08d}.tar"
            try:
                await asyncio.to_thread(self.pack, path, tar)
                ref = await self.host.upload(tar, "checkpoint.tar")
            except (GpumarketError, OSError) as exc:    # the job's files: anything goes
                log.warning("lease %s: checkpoint at step %d not uploaded: %s",
                            self.workdir.name, step, exc)
                continue
            finally:
                tar.unlink(missing_ok=True)
            self.uploaded_step = step
            self.report = self.update(checkpoint=gw.CheckpointReport(
                step=step, artifact=ref, write_seconds=write_s))
            self.host.send(self.report)
            await asyncio.to_thread(self.drop_older, path)

    def pack(self, rel: str, tar: Path) -> None:
        """Pack the job's checkpoint ``rel`` (walked from the work directory without
        following links: the job may have swapped it for a link since it reported it)."""
        ckpt = jobfiles.open_under(self.workdir, rel, directory=True)
        try:
            checkpoints.pack(ckpt, tar, self.owner, PurePosixPath(rel).name)
        finally:
            os.close(ckpt)

    def drop_older(self, rel: str) -> None:
        """Remove the job's checkpoints older than the one just uploaded (names sort by
        step; newer ones may be in progress), inside its own checkpoints directory only."""
        newest = PurePosixPath(rel)
        try:
            parent = jobfiles.open_under(self.workdir, str(newest.parent), directory=True)
        except (OSError, jobfiles.JobFileError):
            return
        try:
            for name in os.listdir(parent):
                if name.startswith("step-") and name < newest.name:
                    shutil.rmtree(name, ignore_errors=True, dir_fd=parent)
        finally:
            os.close(parent)
