"""Artifacts: chunked, content-addressed upload and download; many small blobs in one call
each way (UploadBlobs, DownloadBlobs)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

from gpumarket.broker.api.auth import caller
from gpumarket.broker.api.rpc import streaming, unary
from gpumarket.broker.jobs import views
from gpumarket.broker.state import BrokerState
from gpumarket.broker.store import blob_holdings
from gpumarket.proto.artifacts import CHUNK_BYTES
from gpumarket.proto.errors import InvalidArgument, PermissionDenied
from gpumarket.proto.jobspec import check_sha256, now_ms
from gpumarket.proto.v1 import artifacts_pb2 as ap
from gpumarket.proto.v1 import artifacts_pb2_grpc

MAX_BLOBS = 1000            # blobs in one UploadBlobs or DownloadBlobs call ...
MAX_BLOBS_BYTES = 32 << 20  # ... and their bytes (each blob at most CHUNK_BYTES)
WRITE_BYTES = 4 << 20       # an upload's blobs are checked and written this many at a time
MESSAGE_BYTES = 3 << 20     # blobs sent in one message (under gRPC's 4 MiB a message)


def _unreadable(db, key: str, shas: list[str]) -> list[str]:
    """Those of ``shas`` that ``key`` may not read (views.may_read)."""
    return [sha for sha in shas if not views.may_read(db, key, sha)]


class ArtifactsServicer(artifacts_pb2_grpc.ArtifactsServicer):
    def __init__(self, state: BrokerState) -> None:
        self.state = state

    # A blob is stat-able and skippable only for those who hold it (blob_holdings.holds); anyone
    # else sees it as absent and must upload every byte (proving they have it) to hold it
    # too. Reading (Download) follows views.may_read, which adds a leased job's blobs.

    async def _check_room(self, key: str, size: int) -> None:
        """Raise unless a new blob of ``size`` bytes fits the limits for ``key``."""
        self.state.artifacts.check_size(size)
        held = await self.state.store.read(blob_holdings.uploaded_bytes, key)
        blob_holdings.check_quota(held, size, self.state.config.max_key_artifact_bytes)

    @unary
    async def StatArtifact(self, request: ap.StatArtifactRequest, context):
        check_sha256(request.sha256, "sha256")
        key = caller()
        if not await self.state.store.read(blob_holdings.holds, key, request.sha256):
            begun = await self.state.store.read(blob_holdings.upload_size, request.sha256, key)
            if request.size_bytes and begun is None:
                await self._check_room(key, request.size_bytes)
            return ap.StatArtifactResponse(
                complete=False, received_bytes=self.state.artifacts.received(request.sha256,
                                                                             key))
        st = self.state.artifacts.stat(request.sha256, key)
        return ap.StatArtifactResponse(complete=st.complete, size_bytes=st.size_bytes,
                                       received_bytes=st.received_bytes)

    @unary
    async def Upload(self, request_iterator, context) -> ap.UploadResponse:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("part") != "header":
            raise InvalidArgument("an upload starts with its header")
        h = first.header
        check_sha256(h.sha256, "header.sha256")
        key, store = caller(), self.state.store
        stored = await store.read(views.artifact_size, h.sha256)
        if stored is not None and await store.read(blob_holdings.holds, key, h.sha256):
            if h.size_bytes != stored:
                raise InvalidArgument(f"artifact {h.sha256[:12]}… is {stored:,} bytes, not"
                                      f" {h.size_bytes:,}")
            async for _ in request_iterator:  # drain what the client already sent
                pass
            await store.write(blob_holdings.record, h.sha256, stored, key, now_ms())
            return ap.UploadResponse(sha256=h.sha256, size_bytes=stored, already_present=True)
        self.state.artifacts.check_size(h.size_bytes)
        await store.write(blob_holdings.reserve, h.sha256, key, h.size_bytes,
                          self.state.config.max_key_artifact_bytes, now_ms())
        upload = self.state.artifacts.begin_upload(h.sha256, h.size_bytes, h.offset, key,
                                                   may_skip=False)
        try:
            async for part in request_iterator:
                if part.WhichOneof("part") != "data":
                    raise InvalidArgument("only data may follow an upload's header")
                upload.write(part.data)
            size = await asyncio.to_thread(upload.finish)
        finally:
            upload.close()
        await store.write(blob_holdings.record, h.sha256, size, key, now_ms())
        return ap.UploadResponse(sha256=h.sha256, size_bytes=size)

    @streaming
    async def Download(self, request: ap.DownloadRequest, context):
        check_sha256(request.sha256, "sha256")
        if not await self.state.store.read(views.may_read, caller(), request.sha256):
            raise PermissionDenied(f"artifact {request.sha256[:12]}… is not yours: you neither"
                                   " uploaded it nor is it part of your jobs or of a job leased"
                                   " to you")
        f = self.state.artifacts.open_read(request.sha256, request.offset)
        try:
            while chunk := await asyncio.to_thread(f.read, CHUNK_BYTES):
                yield ap.DownloadResponse(data=chunk)
        finally:
            f.close()

    @unary
    async def UploadBlobs(self, request_iterator, context) -> ap.UploadBlobsResponse:
        """Whole small blobs, each hash-checked and stored, then held by the caller all at
        once (one transaction), in the order sent. One call for the outputs of many tasks:
        what the per-key call rate protects is calls, not files."""
        key, store, artifacts = caller(), self.state.store, self.state.artifacts
        limit = self.state.config.max_key_artifact_bytes
        held = await store.read(blob_holdings.uploaded_bytes, key)
        sizes: dict[str, int] = {}
        order: list[str] = []
        pending: list[tuple[str, bytes]] = []
        staged: list[tuple[Path, Path]] = []
        pending_bytes = total = 0
        try:
            async for blob in _each_blob(request_iterator):
                where = f"blobs[{len(order)}]"
                if len(order) >= MAX_BLOBS:
                    raise InvalidArgument(f"at most {MAX_BLOBS:,} blobs in one call")
                check_sha256(blob.sha256, f"{where}.sha256")
                if len(blob.data) > CHUNK_BYTES:
                    raise InvalidArgument(f"{where}: a blob sent whole is at most"
                                          f" {CHUNK_BYTES:,} bytes (upload a larger one on"
                                          " its own)")
                artifacts.check_size(len(blob.data))
                order.append(blob.sha256)
                if blob.sha256 in sizes:
                    continue
                sizes[blob.sha256] = len(blob.data)
                total += len(blob.data)
                if total > MAX_BLOBS_BYTES:
                    raise InvalidArgument(f"at most {MAX_BLOBS_BYTES >> 20} MiB of blobs in"
                                          " one call")
                blob_holdings.check_quota(held, total, limit)    # (again, exactly, when recorded)
                pending.append((blob.sha256, blob.data))
                pending_bytes += len(blob.data)
                if pending_bytes >= WRITE_BYTES:
                    staged += await asyncio.to_thread(_stage, artifacts, pending)
                    pending, pending_bytes = [], 0
            if pending:
                staged += await asyncio.to_thread(_stage, artifacts, pending)
            # A blob stored with another size is not what this call sent (a sha256
            # collision): refused, as a single upload's is.
            stored = await store.read(blob_holdings.stored_sizes, list(sizes))
            for sha, size in sizes.items():
                if stored.get(sha, size) != size:
                    raise InvalidArgument(f"artifact {sha[:12]}… is {stored[sha]:,} bytes,"
                                          f" not {size:,}")
            await asyncio.to_thread(artifacts.publish_blobs, staged)
            staged = []
        finally:
            if staged:      # refused: nothing of it stays
                await asyncio.to_thread(artifacts.discard_blobs, staged)
        await store.write(blob_holdings.record_many, list(sizes.items()), key, limit, now_ms())
        return ap.UploadBlobsResponse(blobs=[
            ap.UploadResponse(sha256=sha, size_bytes=sizes[sha], already_present=sha in stored)
            for sha in order])

    @streaming
    async def DownloadBlobs(self, request: ap.DownloadBlobsRequest, context):
        """Whole small blobs the caller may read, in the order asked."""
        shas = list(request.sha256)
        if len(shas) > MAX_BLOBS:
            raise InvalidArgument(f"at most {MAX_BLOBS:,} blobs in one call")
        for i, sha in enumerate(shas):
            check_sha256(sha, f"sha256[{i}]")
        refused = await self.state.store.read(_unreadable, caller(), sorted(set(shas)))
        if refused:
            raise PermissionDenied(f"artifact {refused[0][:12]}… is not yours: you neither"
                                   " uploaded it nor is it part of your jobs or of a job leased"
                                   " to you")
        message, size = ap.Blobs(), 0
        for start in range(0, len(shas), 64):
            batch = shas[start:start + 64]
            found = await asyncio.to_thread(_read_blobs, self.state.artifacts, batch)
            for sha, data in zip(batch, found):
                if message.blobs and size + len(data) > MESSAGE_BYTES:
                    yield message
                    message, size = ap.Blobs(), 0
                message.blobs.add(sha256=sha, data=data)
                size += len(data)
        if message.blobs:
            yield message


def _read_blobs(artifacts, shas: list[str]) -> list[bytes]:
    return [artifacts.read_blob(sha, CHUNK_BYTES) for sha in shas]


async def _each_blob(messages):
    async for message in messages:
        for blob in message.blobs:
            yield blob


def _stage(artifacts, blobs: list[tuple[str, bytes]]) -> list[tuple[Path, Path]]:
    """Stage blobs whose bytes hash to their sha256 (InvalidArgument for the first that
    does not: nothing of this batch is staged then)."""
    for sha, data in blobs:
        if hashlib.sha256(data).hexdigest() != sha:
            raise InvalidArgument(f"blob {sha[:12]}…: its bytes hash to something else")
    return artifacts.stage_blobs(blobs)
