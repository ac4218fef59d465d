"""The typed broker client: the one place the client touches gRPC stubs.

Every unary call carries a deadline; grpc.aio.AioRpcError becomes a gpumarket error.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from gpumarket.proto.artifacts import publish_verified, receive, sha256_file, upload_requests
from gpumarket.proto.channel import Trust, open_channel
from gpumarket.proto.errors import GpumarketError, InvalidArgument, Unavailable, from_code
from gpumarket.proto.identity import Identity, home_dir
from gpumarket.proto.v1 import artifacts_pb2 as ap
from gpumarket.proto.v1 import admin_pb2 as ad
from gpumarket.proto.v1 import admin_pb2_grpc, artifacts_pb2_grpc, marketplace_pb2_grpc
from gpumarket.proto.v1 import marketplace_pb2 as mp
from gpumarket.proto.v1 import types_pb2 as pb


def default_trust() -> Trust:
    """$GPUMARKET_BROKER_KEY pins the broker's key; else the client's known_brokers file."""
    return Trust(pin=os.environ.get("GPUMARKET_BROKER_KEY", ""),
                 known=home_dir() / "known_brokers")


class BrokerClient:
    """``async with BrokerClient("127.0.0.1:7070", identity) as broker: ...``

    Calls are signed by ``identity`` (None: anonymous, which only offer search allows).
    The channel is TLS to the broker key ``trust`` accepts, unless the address is
    ``plaintext://`` loopback.
    """

    def __init__(self, address: str, identity: Identity | None = None, timeout_s: float = 15.0,
                 trust: Trust | None = None) -> None:
        self.address = address
        self.identity = identity
        self.timeout_s = timeout_s
        self.trust = trust or default_trust()
        self.channel: grpc.aio.Channel | None = None
        self.broker_id = ""

    async def __aenter__(self) -> "BrokerClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        opened = await open_channel(self.address, self.identity, self.trust,
                                    min(self.timeout_s, 10.0))
        self.channel, self.broker_id = opened.channel, opened.broker_id
        self.market = marketplace_pb2_grpc.MarketplaceStub(self.channel)
        self.artifacts = artifacts_pb2_grpc.ArtifactsStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()

    def _error(self, exc: grpc.aio.AioRpcError) -> GpumarketError:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            return Unavailable(f"cannot reach the broker at {self.address}"
                               f" ({(exc.details() or 'no answer').splitlines()[0]})")
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return from_code("DEADLINE_EXCEEDED",
                             f"the broker at {self.address} did not answer in time")
        return from_code(exc.code().name, exc.details() or exc.code().name)

    async def _call(self, method, request):
        try:
            return await method(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from exc

    async def submit(self, spec: pb.Envelope) -> mp.SubmitJobResponse:
        return await self._call(self.market.SubmitJob, mp.SubmitJobRequest(spec=spec))

    async def get_job(self, job_id: str) -> pb.Job:
        return (await self._call(self.market.GetJob, mp.GetJobRequest(job_id=job_id))).job

    async def list_jobs(self, client_id: str = "", states: list[int] | None = None,
                        limit: int = 100) -> list[pb.Job]:
        req = mp.ListJobsRequest(client_id=client_id, states=states or [], limit=limit)
        return list((await self._call(self.market.ListJobs, req)).jobs)

    async def cancel(self, order: pb.Envelope) -> int:
        return (await self._call(self.market.CancelJob, mp.CancelJobRequest(order=order))).state

    async def search_offers(self, request: mp.SearchOffersRequest) -> list[mp.OfferListing]:
        return list((await self._call(self.market.SearchOffers, request)).offers)

    async def quote(self, spec: pb.JobSpec, limit: int = 5,
                    client_id: str = "") -> mp.QuoteResponse:
        return await self._call(self.market.Quote, mp.QuoteRequest(spec=spec, limit=limit,
                                                                   client_id=client_id))

    async def get_provider(self, provider_id: str) -> mp.GetProviderResponse:
        req = mp.GetProviderRequest(provider_id=provider_id)
        return await self._call(self.market.GetProvider, req)

    async def logs(self, job_id: str, follow: bool = False) -> AsyncIterator[pb.LogLine]:
        """Yield the job's log lines (``follow``: until the job ends); resumes after the last
        line it yielded where the stream breaks."""
        open_stream = lambda cursor: self.market.StreamLogs(  # noqa: E731
            mp.StreamLogsRequest(job_id=job_id, after_seq=cursor, follow=follow))
        async for line in self._resuming(open_stream, lambda resp: resp.lines):
            yield line

    async def admin_call(self, method: str, order: pb.Envelope):
        """Call the unary Admin ``method`` with a signed AdminOrder."""
        return await self._call(getattr(self.admin, method), ad.AdminRequest(order=order))

    async def backup(self, order: pb.Envelope, target: Path) -> int:
        """Stream the broker's database backup to ``target`` (published only once its sha256
        checks out); return its size."""
        tmp = target.with_name(f".{target.name}.partial")
        size, digest = 0, ""
        try:
            with open(tmp, "wb") as f:
                async for chunk in self.admin.Backup(ad.AdminRequest(order=order),
                                                     timeout=self.timeout_s * 20):
                    if chunk.sha256:
                        size, digest = chunk.total_bytes, chunk.sha256
                    f.write(chunk.data)
        except grpc.aio.AioRpcError as exc:
            tmp.unlink(missing_ok=True)
            raise self._error(exc) from exc
        if not await asyncio.to_thread(publish_verified, tmp, target, digest, size):
            raise InvalidArgument("the backup arrived damaged (sha256 mismatch); try again")
        return size

    async def watch(self, job_id: str, after_seq: int = 0,
                    on_retry: Callable[[str], None] | None = None) -> AsyncIterator[pb.JobEvent]:
        """Yield the job's events until it ends; reconnects where the stream breaks (calling
        ``on_retry`` with the reason), resuming after the last event it yielded."""
        open_stream = lambda cursor: self.market.WatchJob(  # noqa: E731
            mp.WatchJobRequest(job_id=job_id, after_seq=cursor))
        async for event in self._resuming(open_stream, lambda resp: (resp.event,), after_seq,
                                          on_retry):
            yield event

    async def _resuming(self, open_stream: Callable[[int], Any], items: Callable[[Any], Any],
                        cursor: int = 0, on_retry: Callable[[str], None] | None = None
                        ) -> AsyncIterator[Any]:
        """Yield the items (each with a ``seq``) of the server stream ``open_stream(cursor)``;
        where it breaks with UNAVAILABLE, reopen it after the last item yielded (backing off,
        up to 20 times in a row)."""
        retries = 0
        while True:
            stream = open_stream(cursor)
            try:
                async for resp in stream:
                    retries = 0
                    for item in items(resp):
                        cursor = item.seq
                        yield item
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or retries >= 20:
                    raise self._error(exc) from exc
                retries += 1
                if on_retry is not None:
                    on_retry(f"lost the broker at {self.address}; reconnecting")
                await asyncio.sleep(min(0.5 * 2 ** retries, 5))
            finally:
                stream.cancel()

    async def upload(self, path: Path, name: str,
                     on_bytes: Callable[[int], None] | None = None) -> pb.ArtifactRef:
        """Upload a file unless the broker has it; resumes a partial upload."""
        sha, size = await asyncio.to_thread(sha256_file, path)
        st = await self._call(self.artifacts.StatArtifact,
                              ap.StatArtifactRequest(sha256=sha, size_bytes=size))
        if not st.complete:
            call = self.artifacts.Upload(
                upload_requests(path, sha, size, st.received_bytes, on_bytes),
                timeout=self.timeout_s + size / 1e6)
            try:
                await call
            except grpc.aio.AioRpcError as exc:
                raise self._error(exc) from exc
        return pb.ArtifactRef(name=name, sha256=sha, size_bytes=size)

    async def download(self, ref: pb.ArtifactRef, target: Path) -> None:
        """Download to ``target``; the file appears only once its sha256 checks out."""
        tmp = target.with_name(f".{target.name}.partial")
        try:
            stream = self.artifacts.Download(ap.DownloadRequest(sha256=ref.sha256),
                                             timeout=self.timeout_s + ref.size_bytes / 1e6)
            await receive(stream, tmp, ref.size_bytes, append=False)
        except grpc.aio.AioRpcError as exc:
            tmp.unlink(missing_ok=True)
            raise self._error(exc) from exc
        if not await asyncio.to_thread(publish_verified, tmp, target, ref.sha256,
                                       ref.size_bytes):
            raise InvalidArgument(f"{ref.name}: downloaded bytes do not match the receipt's"
                                  " sha256")
