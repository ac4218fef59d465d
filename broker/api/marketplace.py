"""Marketplace: what clients call. Thin: decode, call the domain, encode."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict

from gpumarket.broker.api.auth import caller
from gpumarket.broker.api.rpc import streaming, unary
from gpumarket.broker.checks import verification
from gpumarket.broker.jobs import arrays
from gpumarket.broker.jobs import logs
from gpumarket.broker.jobs import endings
from gpumarket.broker.jobs import submit as submission
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs import views
from gpumarket.broker.market import matcher
from gpumarket.broker.market import offers
from gpumarket.broker.market import reliability
from gpumarket.broker.market import standing
from gpumarket.broker.money import ledger
from gpumarket.broker.serving import endpoints
from gpumarket.broker.serving import router as serving
from gpumarket.broker.serving.rows import EndpointKey, Overview
from gpumarket.broker.state import BrokerState
from gpumarket.proto.envelope import open_envelope
from gpumarket.proto.errors import (
    BadSignature, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied,
)
from gpumarket.proto.jobspec import MAX_CREDITS, TERMINAL_STATES, now_ms
from gpumarket.proto.v1 import marketplace_pb2 as mp
from gpumarket.proto.v1 import marketplace_pb2_grpc
from gpumarket.proto.v1 import types_pb2 as pb

log = logging.getLogger(__name__)

MAX_LIST = 1000
CANCEL_ORDER_MAX_AGE_MS = 10 * 60 * 1000
TASK_PAGE_BYTES = 3 << 20     # a ListTasks page (tasks' receipts and outputs): under gRPC's 4 MiB


class MarketplaceServicer(marketplace_pb2_grpc.MarketplaceServicer):
    def __init__(self, state: BrokerState) -> None:
        self.state = state

    @unary
    async def SubmitJob(self, request: mp.SubmitJobRequest, context) -> mp.SubmitJobResponse:
        spec, client_id = open_envelope(request.spec, pb.JobSpec)
        if client_id != caller():
            raise PermissionDenied("job spec is signed by another key than the call")
        job_id = await submission.submit(self.state, request.spec, spec, client_id, now_ms())
        log.info("job %s submitted by %s", job_id, client_id)
        self.state.events.notify()
        self.state.placement.notify()
        return mp.SubmitJobResponse(job_id=job_id, state=pb.JOB_STATE_QUEUED)

    @unary
    async def ListTasks(self, request: mp.ListTasksRequest, context) -> mp.ListTasksResponse:
        job = await self.state.store.read(jobs.job_row, request.job_id)
        own(job.client_id, request.job_id)
        if not job.is_array:
            raise FailedPrecondition(f"job {request.job_id} is not a job array")
        limit = min(request.limit or 1000, 10_000)
        found, after = await self.state.store.read(arrays.tasks, request.job_id,
                                                   request.from_task, limit,
                                                   list(request.states))
        counts = await self.state.store.read(arrays.counts, request.job_id)
        tasks, size = [], 0
        for t in found:
            task = pb.ArrayTask(task=t["task"], state=t["state"], attempts=t["attempts"],
                                provider_id=t["provider_id"], error=t["error"],
                                lease_job_id=t["batch_id"] or "", seconds=t["seconds"],
                                updated_at_ms=t["updated_at_ms"],
                                receipt=pb.Envelope.FromString(t["receipt"])
                                if t["receipt"] else None,
                                receipt_path=bytes(t["receipt_path"] or b""),
                                outputs=[pb.ArtifactRef(**o)
                                         for o in json.loads(t["outputs"] or "[]")])
            size += task.ByteSize()
            if tasks and size > TASK_PAGE_BYTES:    # the rest on the next page
                after = t["task"]
                break
            tasks.append(task)
        return mp.ListTasksResponse(tasks=tasks, next_task=after,
                                    progress=pb.ArrayProgress(tasks=job.tasks, **counts))

    @unary
    async def GetJob(self, request: mp.GetJobRequest, context) -> mp.GetJobResponse:
        job = await self.state.store.read(views.get_job, request.job_id)
        own(job.client_id, request.job_id)
        return mp.GetJobResponse(job=job)

    @unary
    async def ListJobs(self, request: mp.ListJobsRequest, context) -> mp.ListJobsResponse:
        limit = min(request.limit or 100, MAX_LIST)
        if request.client_id and request.client_id != caller():
            raise PermissionDenied("a client may list only its own jobs"
                                   " (operators: gpumarket-broker jobs)")
        found = await self.state.store.read(views.list_jobs, caller(),
                                            list(request.states), limit)
        return mp.ListJobsResponse(jobs=found)

    @streaming
    async def WatchJob(self, request: mp.WatchJobRequest, context):
        store = self.state.store
        own((await store.read(jobs.job_row, request.job_id)).client_id, request.job_id)
        cursor = request.after_seq
        while True:
            seen = self.state.events.seen()
            # Read the state before the events: a terminal state then guarantees that
            # the events read next include the final one.
            state = await store.read(views.job_state, request.job_id)
            events = await store.read(views.events_after, request.job_id, cursor)
            for event in events:
                cursor = event.seq
                yield mp.WatchJobResponse(event=event)
            if events:
                continue
            if state in TERMINAL_STATES:
                return
            await self.state.events.wait(1.0, since=seen)

    @streaming
    async def StreamLogs(self, request: mp.StreamLogsRequest, context):
        store = self.state.store
        own((await store.read(jobs.job_row, request.job_id)).client_id, request.job_id)
        cursor = request.after_seq
        while True:
            seen = self.state.logs.seen()
            state = await store.read(views.job_state, request.job_id)
            lines = await store.read(logs.lines_after, request.job_id, cursor)
            if lines:
                cursor = lines[-1].seq
                yield mp.StreamLogsResponse(lines=lines)
                continue
            if not request.follow or state in TERMINAL_STATES:
                return
            await self.state.logs.wait(1.0, since=seen)

    @unary
    async def ListEndpoints(self, request: mp.ListEndpointsRequest, context):
        store = self.state.store
        tops = await store.read(endpoints.mine, caller())
        infos = [await store.read(endpoints.overview, top, 0) for top in tops]
        return mp.ListEndpointsResponse(endpoints=[endpoint_view(self.state, i) for i in infos])

    @unary
    async def GetEndpoint(self, request: mp.GetEndpointRequest, context):
        store = self.state.store
        top = await store.read(endpoints.find, caller(), request.endpoint)
        info = await store.read(endpoints.overview, top, min(request.events or 50, 1000))
        return mp.GetEndpointResponse(endpoint=endpoint_view(self.state, info))

    @unary
    async def CreateEndpointKey(self, request: mp.EndpointKeyRequest, context):
        key, secret = await self.state.store.write(endpoints.create_key, caller(),
                                                   request.endpoint, now_ms())
        self.state.events.notify()
        return mp.EndpointKeyResponse(secret=secret, key=key_view(key))

    @unary
    async def RevokeEndpointKey(self, request: mp.EndpointKeyRequest, context):
        key = await self.state.store.write(endpoints.revoke_key, caller(), request.endpoint,
                                           request.key_id, now_ms())
        if self.state.serving is not None:
            self.state.serving.forget_keys()     # a revoked key stops working at once
        self.state.events.notify()
        return mp.EndpointKeyResponse(key=key_view(key))

    @unary
    async def GetProvider(self, request: mp.GetProviderRequest, context):
        found = await self.state.store.read(standing.standings, [request.provider_id], now_ms())
        if not found:
            raise NotFound(f"no provider {request.provider_id!r} has connected to this broker")
        return mp.GetProviderResponse(provider=found[0], broker_time_ms=now_ms())

    @unary
    async def CancelJob(self, request: mp.CancelJobRequest, context) -> mp.CancelJobResponse:
        order, client_id = open_envelope(request.order, mp.CancelOrder)
        if client_id != caller():
            raise PermissionDenied("cancel order is signed by another key than the call")
        if abs(now_ms() - order.at_ms) > CANCEL_ORDER_MAX_AGE_MS:
            raise BadSignature("cancel order is dated more than 10 minutes off (check the clock)")
        state, ended = await self.state.store.write(endings.cancel, order.job_id, client_id, now_ms())
        if self.state.serving is not None:     # a deleted endpoint's keys stop at once
            self.state.serving.forget_keys()
            self.state.serving.sync(await self.state.store.read(endpoints.live))
        for lease in ended:
            self.state.stop_lease(lease.job_id, lease.epoch, lease.provider_id,
                                  "cancelled by client")
        if ended:
            self.state.placement.notify()
        self.state.events.notify()
        return mp.CancelJobResponse(state=state)

    @unary
    async def SearchOffers(self, request: mp.SearchOffersRequest, context):
        # The offers of the sessions open now, from memory (each verified when it came);
        # the database only for the standing of the page's providers.
        store = self.state.store
        limit = min(request.limit or 100, MAX_LIST)
        page = [(offer, env) for offer, env in self.state.sessions.listings()
                if _matches(offer, request)][:limit]
        if not page:
            return mp.SearchOffersResponse()
        busy = await self.state.busy_devices()
        achieved = await store.read(views.achieved_flops)
        hist = await store.read(views.histories, [o.provider_id for o, _ in page], now_ms())
        checked = await store.read(verification.standings)
        out = []
        for offer, env in page:
            held = busy.get(offer.provider_id, set())
            free = offers.free_devices(offer, held)
            h = hist[offer.provider_id]
            done = achieved.get((offer.provider_id, pb.JOB_KIND_TRAINING), 0.0)
            judged = offers.check_figures(offer, done, offers.claimed_flops(offer, capped=False))
            out.append(mp.OfferListing(
                offer=env, online=True, free_devices=free,
                reliability=reliability.score(h), mtbf_s=reliability.mtbf_s(h),
                leases_completed=h.leases_completed, leases_lost=reliability.failures(h),
                achieved_flops=done,
                uptime_7d=h.uptime_window_s / h.window_s if h.window_s else 0.0,
                figures=judged.status, figures_detail=judged.detail,
                check_rate=checked.get(offer.provider_id, (verification.rate(0), 0, 0))[0],
                checks_passed=checked.get(offer.provider_id, (1.0, 0, 0))[1],
                standard_price_per_gpu_hour=offers.offer_price(offer),
                interruptible_price_per_gpu_hour=offers.interruptible_price(offer)))
        return mp.SearchOffersResponse(offers=out)

    @unary
    async def Quote(self, request: mp.QuoteRequest, context) -> mp.QuoteResponse:
        q = await submission.quote(self.state, request.spec, caller())
        book = q.book
        out = mp.QuoteResponse(estimated_memory_bytes=q.needs.min_memory_bytes,
                               work_flops=q.work_flops, offers=len(book),
                               excluded={k: v for k, v in q.excluded.items()},
                               hold=q.hold, hold_basis=q.hold_basis)
        for t in q.timed[:min(request.limit or 5, 50)]:
            c = t.estimate
            i = c.offer_index if c.offer_index >= 0 else book.index[c.provider_id]
            o = book.offers[i]
            out.candidates.append(mp.QuoteCandidate(
                standard_price_per_gpu_hour=o.price("standard"),
                interruptible_price_per_gpu_hour=o.price("interruptible"),
                provider_id=c.provider_id, gpu_name=book.offers[i].gpu_name,
                price_per_gpu_hour=c.price_per_gpu_hour, runtime_s=c.runtime_s,
                expected_s=c.expected_s, expected_cost=c.expected_cost,
                p_uninterrupted=c.p_uninterrupted, reliability=c.reliability,
                free_devices=int(book.free[i]), estimated_s=t.seconds,
                estimate_basis=t.basis))
        if not q.timed:
            out.explanation = matcher.explain(q.excluded, len(book))
        return out

    @unary
    async def GetAccount(self, request: mp.GetAccountRequest, context) -> mp.GetAccountResponse:
        found = await self.state.store.read(account_view, caller(), request.job_id[:100],
                                            min(request.limit or 100, MAX_LIST),
                                            min(request.before_seq, 2**63 - 1))
        found.billing = self.state.config.billing
        return found

    @unary
    async def TopUp(self, request: mp.TopUpRequest, context) -> mp.TopUpResponse:
        if not 0 < request.amount <= ledger.units(MAX_CREDITS):
            raise InvalidArgument(f"amount: must be more than 0 and at most {MAX_CREDITS:,}"
                                  " credits")
        if len(request.nonce) not in (0, 16):
            raise InvalidArgument("nonce: 16 random bytes (or none)")
        state = await self.state.store.write(jobs.top_up, request.job_id, caller(),
                                             request.amount, now_ms(), request.nonce.hex())
        self.state.events.notify()
        self.state.placement.notify()
        job = await self.state.store.read(views.get_job, request.job_id)
        return mp.TopUpResponse(state=state, billing=job.billing)


def endpoint_view(state: BrokerState, info: Overview) -> mp.Endpoint:
    """An endpoint as `endpoint list/show` print it: the database's view joined with the
    router's (which replicas serve, their load, the latest TTFT and TPOT)."""
    top, s, usage = info.top, info.settings, info.usage
    live = state.serving.endpoints.get(top.id) if state.serving is not None else None
    base = state.config.public_url.rstrip("/") or state.api_base
    out = mp.Endpoint(
        job_id=top.id, name=top.name, state=top.state, task=s["task"],
        min_replicas=s["min_replicas"], max_replicas=s["max_replicas"], target=s["target"],
        api_base=f"{base}/v1" if base else "", error=top.error or "",
        created_at_ms=top.created_at_ms)
    for r in info.replicas:
        ready = live.replicas.get(r.id) if live is not None else None
        if ready is not None and (r.state != pb.JOB_STATE_RUNNING or ready.epoch != r.epoch
                                  or ready.provider_id != r.provider_id):
            ready = None    # the router still holds a lease the database has ended
        # A replica whose provider is connected to another broker of a shared store: ready
        # as the database says (its engine said so under this lease), its load that broker's.
        elsewhere = (ready is None and state.shared and r.state == pb.JOB_STATE_RUNNING
                     and r.progress_step == 1)
        out.replicas.append(mp.EndpointReplica(
            job_id=r.id, state=r.state, provider_id=r.provider_id or "",
            ready=ready is not None or elsewhere, draining=bool(ready and ready.draining),
            in_flight=ready.in_flight if ready else 0,
            max_concurrency=ready.max_concurrency if ready else 0,
            tpot_ms=(ready.tpot_s * 1000) if ready else 0.0,
            requests=ready.requests if ready else 0, engine=ready.engine if ready else ""))
    out.load.CopyFrom(mp.EndpointLoad(
        prompt_tokens=usage.prompt_tokens, output_tokens=usage.output_tokens,
        requests=usage.requests, errors=usage.errors))
    if live is not None:
        out.load.in_flight, out.load.queued = live.in_flight, len(live.waiting)
        out.load.ttft_p50_ms = serving.percentile(live.ttft, 0.5) * 1000
        out.load.ttft_p99_ms = serving.percentile(live.ttft, 0.99) * 1000
        out.load.tpot_p50_ms = serving.percentile(live.tpot, 0.5) * 1000
        out.load.tpot_p99_ms = serving.percentile(live.tpot, 0.99) * 1000
    for k in info.keys:
        out.keys.append(key_view(k))
    for e in info.events:
        out.events.append(pb.JobEvent(seq=e["seq"], job_id=e["job_id"], at_ms=e["at_ms"],
                                      type=e["type"], state=e["state"], attempt=e["attempt"],
                                      provider_id=e["provider_id"], message=e["message"]))
    return out


def key_view(key: EndpointKey) -> mp.EndpointKey:
    """An endpoint's API key as a client reads it (never its secret)."""
    return mp.EndpointKey(key_id=key.key_id, created_at_ms=key.created_at_ms,
                          revoked_at_ms=key.revoked_at_ms)


def account_view(db, key_id: str, job_id: str, limit: int, before_seq: int
                 ) -> mp.GetAccountResponse:
    out = mp.GetAccountResponse(key_id=key_id, **ledger.summary(db, key_id))
    for line in ledger.lines(db, key_id, job_id, limit, before_seq):
        out.lines.append(pb.LedgerLine(**asdict(line)))
    return out


def own(client_id: str, job_id: str) -> None:
    """Raise NotFound unless the caller is the job's client (another client's job answers
    as if it did not exist)."""
    if client_id != caller():
        raise jobs.no_such_job(job_id)


def _matches(offer: pb.Offer, q: mp.SearchOffersRequest) -> bool:
    if q.kind and q.kind not in offer.kinds:
        return False
    if q.HasField("max_price_per_gpu_hour") and offer.price_per_gpu_hour > q.max_price_per_gpu_hour:
        return False
    good = [d for d in offer.devices
            if (not q.accelerator or d.accelerator == q.accelerator)
            and d.memory_bytes >= q.min_memory_bytes]
    return len(good) >= max(q.min_gpus, 1)

