"""The typed broker client: Marketplace and Admin calls, each with a deadline, and the
Artifacts client, over one channel. grpc.aio.AioRpcError becomes a gpumarket error."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gpumarket.link.artifacts import ArtifactsClient
from gpumarket.link.channel import Trust, open_channel, split_brokers
from gpumarket.link.errors import error_of
from gpumarket.proto.artifacts import publish_verified
from gpumarket.proto.envelope import payload_sha256
from gpumarket.proto.errors import GpumarketError, InvalidArgument, Replay, Unavailable
from gpumarket.proto.identity import Identity
from gpumarket.proto.present import unique_prefix
from gpumarket.proto.v1 import admin_pb2 as ad
from gpumarket.proto.v1 import admin_pb2_grpc, marketplace_pb2_grpc
from gpumarket.proto.v1 import marketplace_pb2 as mp
from gpumarket.proto.v1 import types_pb2 as pb


@dataclass(frozen=True)
class Broker:
    """Where a command's calls go: the broker's address and the key it must present."""

    address: str
    trust: Trust

    def client(self, identity: Identity | None, timeout_s: float = 15.0) -> "BrokerClient":
        return BrokerClient(self.address, identity, timeout_s, self.trust)


JOB_ID_CHARS = 16      # a job id: the first 16 hex of its signed spec's sha256
# A watch (or a followed log) waits this long for a broker that went away: a restarted
# broker keeps running leases, so the job goes on meanwhile (docs/recovery.md, Outages).
OUTAGE_WAIT_S = 600.0
# Given several brokers of one market, a connection is taken only once its channel is
# ready within this (a plaintext channel connects lazily: its first call would fail).
READY_WITHIN_S = 5.0


class BrokerClient:
    """``async with BrokerClient("127.0.0.1:7070", identity, trust=Trust(pin=...)) as b:``

    Calls are signed by ``identity`` (None: anonymous, which only offer search allows).
    The channel is TLS to the broker key ``trust`` accepts, unless the address is
    ``plaintext://`` loopback. ``address`` may list the brokers of one market
    (``a:7070,b:7070``): the client uses the first that answers, and where a call finds its
    broker gone (UNAVAILABLE) it moves to the next and makes the call again there.
    """

    def __init__(self, address: str, identity: Identity | None = None, timeout_s: float = 15.0,
                 trust: Trust | None = None) -> None:
        self.addresses = [a.strip() for a in address.split(",") if a.strip()] or [address]
        self.at = 0
        self.address = self.addresses[0]
        self.identity = identity
        self.timeout_s = timeout_s
        self.trust = trust or Trust()
        self.channel: grpc.aio.Channel | None = None
        self.broker_id = ""

    async def __aenter__(self) -> "BrokerClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open a channel to the first of the brokers that answers (from the current one
        on); raises the last one's error where none does."""
        if len(self.addresses) == 1:
            await self._open(self.addresses[0])
            return
        split_brokers(",".join(self.addresses))
        last: GpumarketError | None = None
        for _ in range(len(self.addresses)):
            try:
                await self._open(self.addresses[self.at])
                await asyncio.wait_for(self.channel.channel_ready(),
                                       min(self.timeout_s, READY_WITHIN_S))
                return
            except (Unavailable, TimeoutError) as exc:
                last = exc if isinstance(exc, Unavailable) else Unavailable(
                    f"cannot reach the broker at {self.address} (no answer)")
                await self.close()
                self.at = (self.at + 1) % len(self.addresses)
        raise last

    async def _move(self) -> bool:
        """The broker went away: connect to the next one that answers. Returns False where
        there is no other broker to move to."""
        if len(self.addresses) == 1:
            return False
        await self.close()
        self.at = (self.at + 1) % len(self.addresses)
        await self.connect()
        return True

    async def _open(self, address: str) -> None:
        self.address = address
        opened = await open_channel(address, self.identity, self.trust,
                                    min(self.timeout_s, 10.0))
        self.channel, self.broker_id = opened.channel, opened.broker_id
        self.market = marketplace_pb2_grpc.MarketplaceStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)
        self.artifacts = ArtifactsClient(self.channel, self.address, self.timeout_s)

    async def close(self) -> None:
        if self.channel is not None:
            channel, self.channel = self.channel, None
            await channel.close()

    def _error(self, exc: grpc.aio.AioRpcError) -> GpumarketError:
        return error_of(exc, self.address)

    async def _call(self, method: str, request):
        """The unary call ``method`` ("market.SubmitJob", "admin.Ban") with a deadline;
        where its broker is gone and others were given, made again on the next that
        answers (once each)."""
        stub, name = method.split(".")
        for moves in range(len(self.addresses)):
            try:
                return await getattr(getattr(self, stub), name)(request,
                                                                timeout=self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE \
                        or moves == len(self.addresses) - 1 or not await self._moved():
                    raise self._error(exc) from exc
        raise AssertionError("unreachable")

    async def _moved(self) -> bool:
        try:
            return await self._move()
        except Unavailable:
            return False

    async def job_id(self, prefix: str) -> str:
        """The caller's job whose id starts with ``prefix`` (a whole id is taken as is);
        InvalidArgument if several do."""
        if len(prefix) >= JOB_ID_CHARS:
            return prefix
        return unique_prefix(prefix, [j.job_id for j in await self.list_jobs(limit=1000)],
                             "job id")

    async def submit(self, spec: pb.Envelope) -> mp.SubmitJobResponse:
        """Submit the signed spec. Where the broker went away mid-call and the submission
        was made again on another broker of the market, the first may have been stored:
        the job the spec made is then the answer (its id is the spec's)."""
        moved = self.at
        try:
            return await self._call("market.SubmitJob", mp.SubmitJobRequest(spec=spec))
        except Replay:
            if self.at == moved:
                raise
            job = await self.get_job(payload_sha256(spec)[:JOB_ID_CHARS])
            return mp.SubmitJobResponse(job_id=job.job_id, state=job.state)

    async def get_job(self, job_id: str) -> pb.Job:
        return (await self._call("market.GetJob", mp.GetJobRequest(job_id=job_id))).job

    async def list_jobs(self, client_id: str = "", states: list[int] | None = None,
                        limit: int = 100) -> list[pb.Job]:
        req = mp.ListJobsRequest(client_id=client_id, states=states or [], limit=limit)
        return list((await self._call("market.ListJobs", req)).jobs)

    async def list_tasks(self, job_id: str, from_task: int = 0, limit: int = 0,
                         states: list[int] | None = None) -> mp.ListTasksResponse:
        """One page of a job array's tasks (``next_task``: where the next starts; 0: none)."""
        req = mp.ListTasksRequest(job_id=job_id, from_task=from_task, limit=limit,
                                  states=states or [])
        return await self._call("market.ListTasks", req)

    async def cancel(self, order: pb.Envelope) -> int:
        return (await self._call("market.CancelJob", mp.CancelJobRequest(order=order))).state

    async def search_offers(self, request: mp.SearchOffersRequest) -> list[mp.OfferListing]:
        return list((await self._call("market.SearchOffers", request)).offers)

    async def quote(self, spec: pb.JobSpec, limit: int = 5,
                    client_id: str = "") -> mp.QuoteResponse:
        return await self._call("market.Quote", mp.QuoteRequest(spec=spec, limit=limit,
                                                                   client_id=client_id))

    async def account(self, job_id: str = "", limit: int = 100,
                      before_seq: int = 0) -> mp.GetAccountResponse:
        """The caller's balances and ledger lines (as a client and as a provider)."""
        req = mp.GetAccountRequest(job_id=job_id, limit=limit, before_seq=before_seq)
        return await self._call("market.GetAccount", req)

    async def top_up(self, job_id: str, amount: int) -> mp.TopUpResponse:
        """Add ``amount`` units to the job's hold; the nonce makes a retried call move the
        money once."""
        req = mp.TopUpRequest(job_id=job_id, amount=amount, nonce=os.urandom(16))
        return await self._call("market.TopUp", req)

    async def endpoints(self) -> list[mp.Endpoint]:
        return list((await self._call("market.ListEndpoints",
                                      mp.ListEndpointsRequest())).endpoints)

    async def endpoint(self, name: str, events: int = 50) -> mp.Endpoint:
        req = mp.GetEndpointRequest(endpoint=name, events=events)
        return (await self._call("market.GetEndpoint", req)).endpoint

    async def endpoint_key(self, name: str) -> mp.EndpointKeyResponse:
        return await self._call("market.CreateEndpointKey",
                                mp.EndpointKeyRequest(endpoint=name))

    async def revoke_endpoint_key(self, name: str, key_id: str) -> mp.EndpointKey:
        req = mp.EndpointKeyRequest(endpoint=name, key_id=key_id)
        return (await self._call("market.RevokeEndpointKey", req)).key

    async def get_provider(self, provider_id: str) -> mp.GetProviderResponse:
        req = mp.GetProviderRequest(provider_id=provider_id)
        return await self._call("market.GetProvider", req)

    async def logs(self, job_id: str, follow: bool = False) -> AsyncIterator[pb.LogLine]:
        """Yield the job's log lines (``follow``: until the job ends); resumes after the last
        line it yielded where the stream breaks."""
        open_stream = lambda cursor: self.market.StreamLogs(  # noqa: E731
            mp.StreamLogsRequest(job_id=job_id, after_seq=cursor, follow=follow))
        async for line in self._resuming(open_stream, lambda resp: resp.lines):
            yield line

    async def admin_call(self, method: str, order: pb.Envelope):
        """Call the unary Admin ``method`` with a signed AdminOrder."""
        return await self._call(f"admin.{method}", ad.AdminRequest(order=order))

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
        where it breaks with UNAVAILABLE, reopen it after the last item yielded (backing off
        to every 5 s, for up to OUTAGE_WAIT_S without an answer; ``on_retry`` is told once
        an outage)."""
        retries, lost_since = 0, None
        while True:
            stream = open_stream(cursor)
            try:
                async for resp in stream:
                    retries, lost_since = 0, None
                    for item in items(resp):
                        cursor = item.seq
                        yield item
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or (
                        lost_since is not None
                        and time.monotonic() - lost_since > OUTAGE_WAIT_S):
                    raise self._error(exc) from exc
                if lost_since is None:
                    lost_since = time.monotonic()
                    if on_retry is not None:
                        on_retry(f"lost the broker at {self.address}; reconnecting")
                retries += 1
                if len(self.addresses) > 1 and await self._moved():
                    continue    # another broker of the market: go on there at once
                await asyncio.sleep(min(0.5 * 2 ** retries, 5))
            finally:
                stream.cancel()

    async def upload(self, path: Path | int, name: str,
                     on_bytes: Callable[[int], None] | None = None) -> pb.ArtifactRef:
        """Upload a file unless the broker shows this key holds it; resumes a partial one."""
        return await self.artifacts.upload(path, name, on_bytes)

    async def download(self, ref: pb.ArtifactRef, target: Path) -> None:
        """Download to ``target`` (resuming); it appears only once its sha256 checks out."""
        await self.artifacts.download(ref, target)
