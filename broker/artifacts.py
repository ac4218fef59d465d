"""Artifacts: chunked, content-addressed upload and download."""

from __future__ import annotations

import asyncio

from gpumarket.broker.rpc import streaming, unary
from gpumarket.broker.state import BrokerState
from gpumarket.proto.artifacts import CHUNK_BYTES
from gpumarket.proto.errors import InvalidArgument
from gpumarket.proto.jobspec import check_sha256, now_ms
from gpumarket.proto.v1 import artifacts_pb2 as ap
from gpumarket.proto.v1 import artifacts_pb2_grpc


def _record(db, sha256: str, size: int, now: int) -> None:
    db["artifacts"].upsert({"sha256": sha256, "size_bytes": size, "created_at_ms": now},
                           pk="sha256")


class ArtifactsServicer(artifacts_pb2_grpc.ArtifactsServicer):
    def __init__(self, state: BrokerState) -> None:
        self.state = state

    @unary
    async def StatArtifact(self, request: ap.StatArtifactRequest, context):
        st = self.state.artifacts.stat(request.sha256)
        return ap.StatArtifactResponse(complete=st.complete, size_bytes=st.size_bytes,
                                       received_bytes=st.received_bytes)

    @unary
    async def Upload(self, request_iterator, context) -> ap.UploadResponse:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("part") != "header":
            raise InvalidArgument("an upload starts with its header")
        h = first.header
        check_sha256(h.sha256, "header.sha256")
        upload = self.state.artifacts.begin_upload(h.sha256, h.size_bytes, h.offset)
        if upload is None:
            async for _ in request_iterator:  # drain what the client already sent
                pass
            await self.state.store.write(_record, h.sha256, h.size_bytes, now_ms())
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
        await self.state.store.write(_record, h.sha256, size, now_ms())
        return ap.UploadResponse(sha256=h.sha256, size_bytes=size)

    @streaming
    async def Download(self, request: ap.DownloadRequest, context):
        f = self.state.artifacts.open_read(request.sha256, request.offset)
        try:
            while chunk := await asyncio.to_thread(f.read, CHUNK_BYTES):
                yield ap.DownloadResponse(data=chunk)
        finally:
            f.close()
