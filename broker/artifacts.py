"""Artifacts: chunked, content-addressed upload and download."""

from __future__ import annotations

import asyncio

from gpumarket.broker import holdings, views
from gpumarket.broker.auth import caller
from gpumarket.broker.rpc import streaming, unary
from gpumarket.broker.state import BrokerState
from gpumarket.proto.artifacts import CHUNK_BYTES
from gpumarket.proto.errors import InvalidArgument, PermissionDenied
from gpumarket.proto.jobspec import check_sha256, now_ms
from gpumarket.proto.v1 import artifacts_pb2 as ap
from gpumarket.proto.v1 import artifacts_pb2_grpc


class ArtifactsServicer(artifacts_pb2_grpc.ArtifactsServicer):
    def __init__(self, state: BrokerState) -> None:
        self.state = state

    # A blob is stat-able and skippable only for those who hold it (holdings.holds); anyone
    # else sees it as absent and must upload every byte (proving they have it) to hold it
    # too. Reading (Download) follows views.may_read, which adds a leased job's blobs.

    async def _check_room(self, key: str, size: int) -> None:
        """Raise unless a new blob of ``size`` bytes fits the limits for ``key``."""
        self.state.artifacts.check_size(size)
        held = await self.state.store.read(holdings.uploaded_bytes, key)
        holdings.check_quota(held, size, self.state.config.max_key_artifact_bytes)

    @unary
    async def StatArtifact(self, request: ap.StatArtifactRequest, context):
        check_sha256(request.sha256, "sha256")
        key = caller()
        if not await self.state.store.read(holdings.holds, key, request.sha256):
            begun = await self.state.store.read(holdings.upload_size, request.sha256, key)
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
        if stored is not None and await store.read(holdings.holds, key, h.sha256):
            if h.size_bytes != stored:
                raise InvalidArgument(f"artifact {h.sha256[:12]}… is {stored:,} bytes, not"
                                      f" {h.size_bytes:,}")
            async for _ in request_iterator:  # drain what the client already sent
                pass
            await store.write(holdings.record, h.sha256, stored, key, now_ms())
            return ap.UploadResponse(sha256=h.sha256, size_bytes=stored, already_present=True)
        self.state.artifacts.check_size(h.size_bytes)
        await store.write(holdings.reserve, h.sha256, key, h.size_bytes,
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
        await store.write(holdings.record, h.sha256, size, key, now_ms())
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
