"""The broker's loops: place queued jobs on live offers, and expire overdue leases."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections import defaultdict, deque

from gpumarket import kinds
from gpumarket.broker.checks import verdicts
from gpumarket.broker.checks import verification
from gpumarket.broker.jobs import arrays
from gpumarket.broker.jobs import endings
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs import views
from gpumarket.broker.market import deadlines
from gpumarket.broker.market import matcher
from gpumarket.broker.market import preemption
from gpumarket.broker.market import providers
from gpumarket.broker.market import reliability
from gpumarket.broker.market.admission import Needs, needs_of
from gpumarket.broker.market.offers import claim_efficiency, offer_view
from gpumarket.broker.money import credit_holds
from gpumarket.broker.serving import endpoints
from gpumarket.broker.state import BrokerState
from gpumarket.broker.store import blob_holdings
from gpumarket.broker.store import call_nonces
from gpumarket.proto.envelope import seal
from gpumarket.proto.errors import FailedPrecondition
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import gateway_pb2 as gw

log = logging.getLogger(__name__)

QUEUE_SCAN = 1000
RUNTIME_GRACE_S = 60      # past a job's max_runtime, before the broker takes the lease back


def fair_order(rows: list[dict], running: dict[str, int]) -> list[dict]:
    """Queued jobs in the order to place them: one job per client in turn (clients with
    fewer running jobs first), each client's jobs oldest first, so that one client's thousand
    queued jobs never starve another's one."""
    by_client: dict[str, deque] = defaultdict(deque)
    for row in rows:
        by_client[row["client_id"]].append(row)
    clients = sorted(by_client, key=lambda c: (running.get(c, 0), by_client[c][0]["created_at_ms"]))
    out = []
    while clients:
        for c in list(clients):
            out.append(by_client[c].popleft())
            if not by_client[c]:
                clients.remove(c)
    return out


async def check_needs(state: BrokerState, book: matcher.Book, check_id: str,
                      needs: matcher.JobNeeds) -> matcher.JobNeeds:
    """A spot check's provider is drawn (by stake and record, from a source no provider can
    predict: matcher.Book.drawn), not chosen by price; a tie-break goes only to the
    operator's trusted checkers where there are any (docs/verification.md, Who checks)."""
    exclude = needs.exclude
    trusted = frozenset(state.config.trusted_checkers)
    if trusted and await state.store.read(verification.role, check_id) == "tiebreak":
        exclude |= {o.provider_id for o in book.offers if o.provider_id not in trusted}
    return dataclasses.replace(needs, exclude=exclude, draw=_checker_draw.random())


_checker_draw = secrets.SystemRandom()


async def offer_book(state: BrokerState) -> matcher.Book:
    """The live offers, corrected by what the broker observed, as one Book."""
    store = state.store
    offers = state.sessions.offers()
    now = now_ms()
    busy = await state.busy_devices()
    loads = await store.read(views.active_lease_counts)
    hist = await store.read(views.histories, [o.provider_id for o in offers], now)
    # Speeds achieved are measured on the kinds sized as training (their runners report
    # tokens a second against the model's size).
    trained = {k.number for k in kinds.all_kinds() if k.sizing == "training"}
    achieved = {p: f for (p, kind), f in (await store.read(views.achieved_flops)).items()
                if kind in trained}
    efficiency = claim_efficiency(offers, achieved)
    stakes = await store.read(views.stakes)
    return matcher.Book([
        offer_view(o, hist[o.provider_id], achieved.get(o.provider_id, 0.0),
                   frozenset(busy.get(o.provider_id, ())), loads.get(o.provider_id, 0),
                   efficiency, stakes.get(o.provider_id, 0))
        for o in offers
    ])


async def place_queued(state: BrokerState) -> int:
    """One placement pass: lease what fits, record why the rest waits. Returns leases made."""
    store, cfg = state.store, state.config
    queued = await store.read(views.queued_jobs, QUEUE_SCAN)
    if not queued:
        return 0
    book = await offer_book(state)
    if await deadlines.promote_due(state, book):
        queued = await store.read(views.queued_jobs, QUEUE_SCAN)   # their needs changed
    running = await store.read(views.running_by_client)
    reasons: dict[str, str] = {}
    blocked: list[tuple[dict, matcher.JobNeeds]] = []   # waiting for a device that fits
    made = 0
    stored_needs = {row["id"]: Needs.from_json(row["needs"]) for row in queued}
    # Higher tiers first (serving, standard, interruptible), each in fair order: devices an
    # interruptible lease gave back go to the job it yielded to.
    ordered = sorted(fair_order(queued, running),
                     key=lambda r: preemption.TIER_RANK.get(stored_needs[r["id"]].tier, 1))
    for row in ordered:
        avoid: frozenset[str] = frozenset()
        if row["attempt"] > 1:
            # A job that was lost or failed goes elsewhere first; its old provider only if
            # nothing else fits.
            avoid = frozenset(await store.read(views.previous_providers, row["id"]))
        if row["parent_id"]:
            # The parts of a split job go to different providers, where there are enough;
            # a job array's tasks that failed run again on another provider first.
            avoid |= await store.read(views.busy_siblings, row["parent_id"])
            avoid |= await store.read(arrays.failed_on, row["id"])
        # A check never goes to the provider it checks; no job goes back to a provider a
        # check found wrong on it.
        exclude = await store.read(verification.excluded, row["id"]) \
            if row["check_of"] or row["attempt"] > 1 else frozenset()
        stored = stored_needs[row["id"]]
        if row["parent_id"] and kinds.serves(stored.kind):
            # An endpoint's replicas keep away from the providers failing its replicas.
            failing, left_out = await store.read(endpoints.steer, row["parent_id"], now_ms())
            avoid, exclude = avoid | failing, exclude | left_out
        needs = needs_of(row, avoid, stored, exclude)
        if row["check_of"]:
            needs = await check_needs(state, book, row["id"], needs)
        placement, excluded = book.place(needs)
        if placement is None:
            reason = matcher.explain(excluded, len(book))
            if reason != row["queue_reason"]:
                reasons[row["id"]] = reason
            if "busy" in excluded:
                blocked.append((row, needs))
            continue
        session = state.sessions.get(placement.provider_id)
        if session is None:
            continue
        if not await store.read(credit_holds.covers_lease, row["id"], placement.price_per_gpu_hour,
                                len(placement.device_indices)):
            book.release(book.index[placement.provider_id], placement.device_indices)
            reason = (f"waiting for funds: its hold covers less than {credit_holds.RESUME_FLOOR_S} s"
                      f" of the best offer (gpumarket topup {row['parent_id'] or row['id']}"
                      " AMOUNT)")
            if reason != row["queue_reason"]:
                reasons[row["id"]] = reason
            continue
        offer = book.offers[book.index[placement.provider_id]]   # read with the book
        interval = reliability.checkpoint_interval_s(row["checkpoint_seconds"], offer.mtbf_s)
        raw_s = credit_holds.raw_seconds(stored.work_flops, offer, stored.gpus)
        try:
            envelope = await store.write(
                jobs.create_lease, row["id"], placement.provider_id,
                list(placement.device_indices), placement.price_per_gpu_hour, now_ms(),
                int(cfg.accept_within_s * 1000), stored.checkpoint_every,
                lambda lease: seal(state.identity, lease), offer.mtbf_s, interval, raw_s,
                offer.accelerator,
            )
        except FailedPrecondition:
            continue  # cancelled meanwhile
        made += 1
        now = now_ms()
        state.metrics.placements.inc()
        state.metrics.queue_wait.observe(max(0, now - row["updated_at_ms"]) / 1000)
        if row["attempt"] == 1:
            state.metrics.time_to_lease.observe(max(0, now - row["created_at_ms"]) / 1000)
        else:
            state.metrics.resumes.inc()
        session.send(gw.BrokerMessage(lease=envelope))
        log.info("job %s leased to %s on devices %s (%s: expected %.0fs, %.4g credits)",
                 row["id"], placement.provider_id, list(placement.device_indices),
                 stored.objective, placement.estimate.expected_s,
                 placement.estimate.expected_cost)
    if reasons:
        await store.write(jobs.set_queue_reasons, reasons, now_ms())
    if blocked:
        await preemption.preempt_for_waiting(state, book, [needs for _, needs in blocked])
        await ask_to_yield(state, book, blocked, running)
    if made:
        state.events.notify()
    return made


def fair_share(devices: int, clients: int) -> int:
    """The devices each client with work may hold while others wait (at least one)."""
    return max(1, devices // max(1, clients))


async def ask_to_yield(state: BrokerState, book: matcher.Book,
                       blocked: list[tuple[dict, matcher.JobNeeds]],
                       running: dict[str, int]) -> int:
    """Jobs of clients holding less than their fair share of the devices wait for a busy
    one: ask leases of job arrays of clients holding more than theirs, on providers that fit
    a waiting job, to yield after their current task (broker/jobs/arrays.py yield_lease; the
    rest of their tasks go back to the queue), as many as the waiting need, less those
    asked already. Returns how many were asked."""
    devices = sum(len(o.devices) for o in state.sessions.offers())
    clients = set(running) | {row["client_id"] for row, _ in blocked}
    share = fair_share(devices, len(clients))
    held = dict(running)
    waiting: dict[str, list[matcher.JobNeeds]] = defaultdict(list)
    for row, needs in blocked:
        if held.get(row["client_id"], 0) < share:
            waiting[row["client_id"]].append(needs)
    if not waiting or max(held.values(), default=0) <= share:
        return 0
    leases = await state.store.read(arrays.running_leases)
    wanted = sum(min(len(w), share - held.get(c, 0)) for c, w in waiting.items())
    wanted -= sum(lease["devices"] for lease in leases if lease["yielding"])
    candidates = [lease for lease in leases if not lease["yielding"] and lease["open"] > 1]
    asked = 0
    for client in sorted(waiting, key=lambda c: held.get(c, 0)):
        for needs in waiting[client][:share - held.get(client, 0)]:
            if wanted <= 0:
                return asked
            fits = book.fitting(needs)
            found = [lease for lease in candidates if lease["provider_id"] in fits
                     and lease["client_id"] != client
                     and held.get(lease["client_id"], 0) > share]
            if not found:
                continue
            # From the client furthest over its share, the lease with the most left to run.
            lease = max(found, key=lambda x: (held[x["client_id"]], x["open"]))
            candidates.remove(lease)
            if not await state.store.write(arrays.yield_lease, lease["id"], lease["epoch"],
                                           now_ms()):
                continue
            held[lease["client_id"]] -= 1
            wanted -= lease["devices"]
            asked += 1
            session = state.sessions.get(lease["provider_id"])
            if session is not None:
                session.send(gw.BrokerMessage(yield_lease=gw.YieldLease(
                    job_id=lease["id"], epoch=lease["epoch"],
                    reason=f"a job of another client waits for a device (fair share:"
                           f" {share} devices a client)")))
            log.info("lease %s.%d of client %s asked to yield for client %s", lease["id"],
                     lease["epoch"], lease["client_id"], client)
    return asked


async def write_heartbeats(state: BrokerState) -> None:
    """Write the heartbeats heard since the last pass, in one transaction, and tell each
    provider to stop the leases it said it runs that are no longer its."""
    seen, running = state.liveness.take()
    if not seen:
        return
    try:
        stale = await state.store.write(providers.heartbeats, seen, running)
    except BaseException:
        state.liveness.put_back(seen, running)
        raise
    for provider_id, pairs in stale.items():
        session = state.sessions.get(provider_id)
        if session is None:
            continue
        session.log(log, logging.INFO, "provider %s still runs %d leases that are no longer"
                    " its (job %s, ...); told to stop", provider_id, len(pairs), pairs[0][0])
        # Told, not held: the broker ended each of its own leases through stop_lease, which
        # holds its devices already; what else a heartbeat lists (up to 1,024 pairs, any a
        # hostile provider makes up) must not cost a query each pass.
        for job_id, epoch in pairs:
            session.send(gw.BrokerMessage(cancel=gw.CancelLease(
                job_id=job_id, epoch=epoch, reason="this lease is no longer yours")))


async def expire(state: BrokerState) -> None:
    """Lose leases whose heartbeats stopped (after writing those heard); fail queued jobs
    whose spec expired."""
    await write_heartbeats(state)
    now = now_ms()
    overdue = await state.store.read(
        views.overdue_leases, now - int(state.config.lease_timeout_s * 1000))
    changed = False
    for lease_id in overdue:
        row = await state.store.read(views.lease_holder, lease_id)
        if await state.store.write(endings.lose_lease, lease_id, "missed heartbeats", now):
            log.warning("lease %s lost: missed heartbeats", lease_id)
            state.metrics.lease_expiries.inc()
            changed = True
            # A provider that is late, not gone, may still run it: it is told to stop, and
            # the devices wait for it to say it has (not refused leases meanwhile).
            state.stop_lease(*row, "lease lost: missed heartbeats")
    if await state.store.write(endings.expire_queued, now):
        changed = True
    if await preemption.end_overdue(state):
        changed = True
    for lease_id, limit in await state.store.read(views.leases_past_runtime, now,
                                                  RUNTIME_GRACE_S * 1000):
        row = await state.store.read(views.lease_holder, lease_id)
        if await state.store.write(endings.lose_lease, lease_id,
                                   f"ran past the job's max_runtime of {limit}s", now):
            log.warning("lease %s taken back: it ran past its job's max_runtime", lease_id)
            changed = True
            state.stop_lease(*row, f"ran past the job's max_runtime of {limit}s")
    for lease_id in await state.store.read(views.leases_over_hold, now):
        ended = await state.store.write(jobs.exhaust, lease_id, now)
        if ended is None:
            continue
        log.info("job %s paused: its hold is spent", ended.job_id)
        changed = True
        state.stop_lease(ended.job_id, ended.epoch, ended.provider_id,
                         "paused: the job's hold is spent (its client can top it up)")
    if changed:
        state.events.notify()
        state.placement.notify()


async def collect_garbage(state: BrokerState) -> int:
    """Delete blobs that no job references any more, and uploads that made no progress
    (both after a grace period)."""
    cutoff = now_ms() - int(state.config.artifact_grace_s * 1000)
    for sha, key in await state.store.write(blob_holdings.expired_uploads, cutoff):
        state.artifacts.drop_partial(sha, key)
    shas = await state.store.read(blob_holdings.unreferenced_artifacts, cutoff)
    if not shas:
        return 0
    await state.store.write(blob_holdings.forget_artifacts, shas)
    removed = 0
    for sha in shas:
        st = await state.store.read(views.artifact_size, sha)
        if st is None:  # still unreferenced after the write: the blob can go
            state.artifacts.blob_path(sha).unlink(missing_ok=True)
            removed += 1
    if removed:
        log.info("removed %d unreferenced artifacts", removed)
    return removed


async def run(state: BrokerState) -> None:
    """Place, expire and collect garbage until cancelled."""
    last_gc = 0.0
    while True:
        seen = state.placement.seen()
        try:
            await place_queued(state)
            await expire(state)
            await verdicts.decide(state)
            if time.monotonic() - last_gc >= state.config.gc_interval_s:
                last_gc = time.monotonic()
                await collect_garbage(state)
                await state.store.write(call_nonces.forget, now_ms())
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("scheduler pass failed; retrying")
        await state.placement.wait(state.config.schedule_interval_s, since=seen)
