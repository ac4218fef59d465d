"""A job's outputs and the receipt for them: the files it left go up to the broker's
artifact store (only the job's own plain files, read through descriptors, each content
once), and the provider signs a receipt naming them. Used by an attempt for its whole job,
and by task_results for each update of a job array's task results (one receipt over its
tasks' outputs, kinds/receipt_tree.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from pathlib import Path
from typing import Protocol

from gpumarket.kinds import arrays
from gpumarket.proto.artifacts import sha256_file
from gpumarket.proto.envelope import seal
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider import jobfiles
from gpumarket.provider.leases import Assignment

UPLOADS_AT_ONCE = 8        # a lease's output files in flight at once
FILES_AT_ONCE = 256        # a lease's output files open at once (beyond one directory's)


class Uploader(Protocol):
    """What uploading outputs asks of the daemon: its artifact store client."""

    async def upload(self, source: Path | int, name: str,
                     digest: tuple[str, int] | None = None) -> pb.ArtifactRef: ...


def sign(identity: Identity, a: Assignment, outputs: list[pb.ArtifactRef],
         wall_seconds: float, metrics: dict[str, float] | None = None,
         tasks_root: bytes = b"") -> pb.Envelope:
    """The receipt for ``outputs`` of the lease ``a``, sealed by this provider's ``identity``
    (device seconds: the wall time on each of the lease's devices); with ``tasks_root``,
    for a task results update's tasks instead (kinds/receipt_tree.py)."""
    receipt = pb.Receipt(
        job_id=a.lease.job_id, lease_id=a.lease.lease_id, attempt=a.lease.attempt,
        epoch=a.lease.epoch, provider_id=provider_id(identity), spec_sha256=a.spec_sha256,
        outputs=outputs, wall_seconds=wall_seconds,
        device_seconds=wall_seconds * len(a.lease.device_indices),
        metrics=metrics or {}, finished_at_ms=now_ms(), tasks_root=tasks_root)
    return seal(identity, receipt)


@functools.lru_cache(maxsize=8)
def provider_id(identity: Identity) -> str:
    """The identity's id, worked out once (a hash of its public key: as much CPU as a
    receipt's signature, signed for every task results update of an array)."""
    return identity.id


async def upload_all(host: Uploader, files: list[tuple[int, str]]) -> list[pb.ArtifactRef]:
    """Upload open files (descriptor, name), UPLOADS_AT_ONCE at a time and each content
    once (an array's tasks write many files alike); their references, in order. Every
    upload has ended when this returns or raises: the descriptors are the caller's."""
    digests = await asyncio.to_thread(lambda: [sha256_file(fd) for fd, _ in files])
    first: dict[tuple[str, int], tuple[int, str]] = {}
    for file, digest in zip(files, digests):
        first.setdefault(digest, file)
    gate = asyncio.Semaphore(UPLOADS_AT_ONCE)

    async def send(file: tuple[int, str], digest: tuple[str, int]) -> pb.ArtifactRef:
        async with gate:
            return await host.upload(*file, digest)

    ended = await asyncio.gather(*(send(f, d) for d, f in first.items()),
                                 return_exceptions=True)
    for result in ended:
        if isinstance(result, BaseException):
            raise result
    sent = dict(zip(first, ended))    # each content as the broker took it
    return [pb.ArtifactRef(name=name, sha256=sent[d].sha256, size_bytes=sent[d].size_bytes)
            for (_, name), d in zip(files, digests)]


async def upload_outputs(host: Uploader, workdir: Path, owner: int,
                         dirs: list[tuple[str, int | None]]) -> list[pb.ArtifactRef]:
    """Upload the files of ``dirs`` (in ``workdir``; a task's named by its task). The job
    may have swapped a directory or a file in it for a link to anything the daemon can
    read: only plain files of ``owner`` (the job's uid) are taken, read through descriptors
    (JobFileError if it left anything else there)."""
    outputs: list[pb.ArtifactRef] = []
    root = jobfiles.open_dir(workdir)
    try:
        # Directories are opened until FILES_AT_ONCE of their files are, then those go up
        # and are closed: a task may leave thousands of files, and the daemon's
        # descriptors are not the job's to use up.
        with contextlib.ExitStack() as opened:
            files: list[tuple[int, str]] = []
            for rel, task in dirs:
                files += [(fd, name if task is None else arrays.output_name(task, name))
                          for name, fd in opened.enter_context(
                              jobfiles.plain_files(root, rel, owner))]
                if len(files) >= FILES_AT_ONCE:
                    outputs += await upload_all(host, files)
                    files = []
                    opened.close()
            outputs += await upload_all(host, files)
    finally:
        os.close(root)
    return outputs
