"""The provider's typed access to the broker's Artifacts service.

Every call has a deadline; grpc errors become gpumarket errors.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from gpumarket.proto.artifacts import publish_verified, receive, sha256_file, upload_requests
from gpumarket.proto.errors import GpumarketError, InvalidArgument, Unavailable, from_code
from gpumarket.proto.v1 import artifacts_pb2 as ap
from gpumarket.proto.v1 import artifacts_pb2_grpc, types_pb2 as pb


def as_error(exc: grpc.aio.AioRpcError, what: str) -> GpumarketError:
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"{what}: broker unreachable ({exc.details()})")
    return from_code(code.name, f"{what}: {exc.details()}")


class ArtifactLink:
    def __init__(self, channel: grpc.aio.Channel, timeout_s: float) -> None:
        self.stub = artifacts_pb2_grpc.ArtifactsStub(channel)
        self.timeout_s = timeout_s

    async def upload(self, path: Path | int, name: str) -> pb.ArtifactRef:
        """Upload a file, given by path or as a descriptor the caller keeps open (resuming
        a partial upload); return its reference."""
        sha, size = await asyncio.to_thread(sha256_file, path)
        try:
            st = await self.stub.StatArtifact(ap.StatArtifactRequest(sha256=sha, size_bytes=size),
                                              timeout=self.timeout_s)
            if not st.complete:
                await self.stub.Upload(upload_requests(path, sha, size, st.received_bytes),
                                       timeout=self.timeout_s + size / 1e6)
        except grpc.aio.AioRpcError as exc:
            raise as_error(exc, f"upload of {name}") from exc
        return pb.ArtifactRef(name=name, sha256=sha, size_bytes=size)

    async def download(self, ref: pb.ArtifactRef, target: Path) -> None:
        """Download a blob to ``target`` (resuming), verifying its sha256 before it lands."""
        partial = target.with_name(target.name + ".partial")
        offset = partial.stat().st_size if partial.exists() else 0
        try:
            stream = self.stub.Download(ap.DownloadRequest(sha256=ref.sha256, offset=offset),
                                        timeout=self.timeout_s + ref.size_bytes / 1e6)
            await receive(stream, partial, ref.size_bytes, append=True)
        except grpc.aio.AioRpcError as exc:
            raise as_error(exc, f"download of {ref.name}") from exc
        if not await asyncio.to_thread(publish_verified, partial, target, ref.sha256,
                                       ref.size_bytes):
            raise InvalidArgument(f"input {ref.name}: downloaded bytes do not match its sha256")
