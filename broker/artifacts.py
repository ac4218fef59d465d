"""Artifacts: chunked, content-addressed upload and download."""

from __future__ import annotations

import asyncio

from gpumarket.broker import views
from gpumarket.broker.auth import caller
from gpumarket.broker.rpc import streaming, unary
from gpumarket.broker.state import BrokerState
from gpumarket.proto.artifacts import CHUNK_BYTES
from gpumarket.proto.errors import InvalidArgument, PermissionDenied, ResourceExhausted
from gpumarket.proto.jobspec import check_sha256, now_ms
from gpumarket.proto.v1 import artifacts_pb2 as ap
from gpumarket.proto.v1 import artifacts_pb2_grpc


def _record(db, sha256: str, size: int, owner: str, now: int) -> None:
    db["artifacts"].upsert({"sha256": sha256, "size_bytes": size, "created_at_ms": now},
                           pk="sha256")
    db["artifact_owners"].upsert({"sha256": sha256, "owner_id": owner, "size_bytes": size,
                                  "created_at_ms": now}, pk=("sha256", "owner_id"))


class ArtifactsServicer(artifacts_pb2_grpc.ArtifactsServicer):
    def __init__(self, state: BrokerState) -> None:
        self.state = state

    # A blob is visible only to those who may read it (views.may_read); anyone else sees
    # it as absent and must upload every byte (proving they have it) to own it too.

    async def _check_room(self, key: str, size: int) -> None:
        """Raise unless a new blob of ``size`` bytes fits the limits for ``key``."""
        self.state.artifacts.check_size(size)
        held = await self.state.store.read(views.uploaded_bytes, key)
        limit = self.state.config.max_key_artifact_bytes
        if held + size > limit:
            raise ResourceExhausted(
                f"this upload ({size:,} bytes) would take your artifacts to"
                f" {held + size:,} bytes, over this broker's limit of {limit:,} per key",
                reason="quota")

    @unary
    async def StatArtifact(self, request: ap.StatArtifactRequest, context):
        check_sha256(request.sha256, "sha256")
        readable = await self.state.store.read(views.may_read, caller(), request.sha256)
        if not readable:
            if request.size_bytes:
                await self._check_room(caller(), request.size_bytes)
            return ap.StatArtifactResponse(
                complete=False, received_bytes=self.state.artifacts.received(request.sha256,
                                                                             caller()))
        st = self.state.artifacts.stat(request.sha256, caller())
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
        readable = await store.read(views.may_read, key, h.sha256)
        if not readable:
            await self._check_room(key, h.size_bytes)
        upload = self.state.artifacts.begin_upload(h.sha256, h.size_bytes, h.offset, key,
                                                   readable)
        if upload is None:
            async for _ in request_iterator:  # drain what the client already sent
                pass
            await store.write(_record, h.sha256, h.size_bytes, key, now_ms())
            return ap.UploadResponse(sha256=h.sha256, size_bytes=h.size_bytes,
                                     already_present=True)
        try:
            async for part in request_iterator:
                if part.WhichOneof("part") != "data":
                    raise InvalidArgument("only data may follow an upload's header")
                upload.write(part.data)
            size = await asyncio.to_thread(upload.finish)
        finally:
            upload.close()
        await store.write(_record, h.sha256, size, key, now_ms())
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
