"""The one Artifacts client: content-addressed uploads and downloads, both resumable and
both hash-checked, for clients and providers alike."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import grpc

from gpumarket.link.errors import error_of
from gpumarket.proto.artifacts import (
    CHUNK_BYTES, publish_verified, receive, sha256_file, upload_requests,
)
from gpumarket.proto.errors import FailedPrecondition, Internal, InvalidArgument
from gpumarket.proto.v1 import artifacts_pb2 as ap
from gpumarket.proto.v1 import artifacts_pb2_grpc
from gpumarket.proto.v1 import types_pb2 as pb

BYTES_PER_S = 1e6       # the slowest transfer the deadlines allow for
MESSAGE_BYTES = 3 << 20  # small blobs sent in one message (under gRPC's 4 MiB a message)
RESUME_TRIES = 3        # asks about a partial upload, another of the same bytes moving it
RESUME_WAIT_S = 0.2     # between them, times the try


class ArtifactsClient:
    def __init__(self, channel: grpc.aio.Channel, address: str, timeout_s: float) -> None:
        self.stub = artifacts_pb2_grpc.ArtifactsStub(channel)
        self.address = address
        self.timeout_s = timeout_s

    async def stat(self, sha256: str, size_bytes: int = 0) -> ap.StatArtifactResponse:
        try:
            return await self.stub.StatArtifact(
                ap.StatArtifactRequest(sha256=sha256, size_bytes=size_bytes),
                timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_of(exc, self.address) from exc

    async def upload(self, source: Path | int, name: str,
                     on_bytes: Callable[[int], None] | None = None,
                     digest: tuple[str, int] | None = None) -> pb.ArtifactRef:
        """Upload a file, given by path or as a descriptor the caller keeps open, unless the
        broker shows this key holds it already; a partial upload resumes where the broker's
        copy ends. Returns its reference. ``digest``: its (sha256, size), where the caller
        has it (the broker checks it against the bytes)."""
        sha, size = digest or await asyncio.to_thread(sha256_file, source)
        ref = pb.ArtifactRef(name=name, sha256=sha, size_bytes=size)
        if size <= CHUNK_BYTES:
            # One message: sent at once rather than asked about first (the broker drops it
            # if this key holds the blob already), one round trip instead of two.
            try:
                await self._send(source, sha, size, 0, on_bytes)
                return ref
            except FailedPrecondition:
                pass        # a partial copy of an earlier try is there: continue it
            except Internal:
                # The broker refused at the header (over this key's quota, say) while the
                # data was still being sent: gRPC then reports its own failure to send, not
                # the broker's answer. Asking about the blob gets the refusal, or continues.
                pass
        for attempt in range(1, RESUME_TRIES + 1):
            st = await self.stat(sha, size)
            if st.complete:
                return ref
            try:
                await self._send(source, sha, size, st.received_bytes, on_bytes)
                return ref
            except FailedPrecondition:
                # Another upload of the same bytes by this key (in progress, or ended
                # between the stat and the send) moved the broker's copy: ask again.
                if attempt == RESUME_TRIES:
                    raise
                await asyncio.sleep(RESUME_WAIT_S * attempt)
        return ref

    async def _send(self, source: Path | int, sha: str, size: int, offset: int,
                    on_bytes: Callable[[int], None] | None) -> None:
        try:
            await self.stub.Upload(upload_requests(source, sha, size, offset, on_bytes),
                                   timeout=self.timeout_s + size / BYTES_PER_S)
        except grpc.aio.AioRpcError as exc:
            raise error_of(exc, self.address) from exc

    async def upload_blobs(self, blobs: list[tuple[str, bytes]]) -> list[ap.UploadResponse]:
        """Upload whole small blobs (sha256, bytes; each at most CHUNK_BYTES) in one call:
        the broker checks each against its sha256 and holds them for this key together.
        Returns the broker's answer for each, in order."""
        size = sum(len(data) for _, data in blobs)
        messages, message, held = [], ap.Blobs(), 0
        for sha, data in blobs:
            if message.blobs and held + len(data) > MESSAGE_BYTES:
                messages.append(message)
                message, held = ap.Blobs(), 0
            message.blobs.add(sha256=sha, data=data)
            held += len(data)
        messages.append(message)
        try:
            answer = await self.stub.UploadBlobs(iter(messages),
                                                 timeout=self.timeout_s + size / BYTES_PER_S)
        except grpc.aio.AioRpcError as exc:
            raise error_of(exc, self.address) from exc
        return list(answer.blobs)

    async def download_blobs(self, refs: list[tuple[pb.ArtifactRef, Path]]) -> None:
        """Download small blobs (each at most CHUNK_BYTES) in one call, each to its target
        (written atomically, not synced). A file appears only once its sha256 and size
        check out (else InvalidArgument, and the rest are not written)."""
        wanted = list(dict.fromkeys(ref.sha256 for ref, _ in refs))
        size = sum(ref.size_bytes for ref, _ in refs)
        found: dict[str, bytes] = {}
        try:
            stream = self.stub.DownloadBlobs(ap.DownloadBlobsRequest(sha256=wanted),
                                             timeout=self.timeout_s + size / BYTES_PER_S)
            async for message in stream:
                for blob in message.blobs:
                    if blob.sha256 in wanted and blob.sha256 not in found:
                        found[blob.sha256] = blob.data
        except grpc.aio.AioRpcError as exc:
            raise error_of(exc, self.address) from exc
        await asyncio.to_thread(write_blobs, refs, found)

    async def download(self, ref: pb.ArtifactRef, target: Path) -> None:
        """Download a blob to ``target``; what arrived of a broken download is kept next to
        it and continued. The file appears only once its sha256 and size check out (else
        InvalidArgument, and the partial copy is gone)."""
        partial = target.with_name(f".{target.name}.partial")
        offset = partial.stat().st_size if partial.exists() else 0
        if offset > ref.size_bytes:
            partial.unlink()
            offset = 0
        try:
            stream = self.stub.Download(ap.DownloadRequest(sha256=ref.sha256, offset=offset),
                                        timeout=self.timeout_s + ref.size_bytes / BYTES_PER_S)
            await receive(stream, partial, ref.size_bytes, append=True)
        except grpc.aio.AioRpcError as exc:
            raise error_of(exc, self.address) from exc
        if not await asyncio.to_thread(publish_verified, partial, target, ref.sha256,
                                       ref.size_bytes):
            raise InvalidArgument(f"{ref.name}: downloaded bytes do not match its sha256")


def write_blobs(refs: list[tuple[pb.ArtifactRef, Path]], found: dict[str, bytes]) -> None:
    """Write each blob to its target once its bytes match the reference (InvalidArgument
    for the first that does not)."""
    for ref, target in refs:
        data = found.get(ref.sha256)
        if data is None or len(data) != ref.size_bytes or \
                hashlib.sha256(data).hexdigest() != ref.sha256:
            raise InvalidArgument(f"{ref.name}: downloaded bytes do not match its sha256")
        tmp = target.with_name(f".{target.name}.partial")
        tmp.write_bytes(data)
        os.replace(tmp, target)
