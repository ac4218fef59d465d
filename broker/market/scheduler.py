"""The broker's background loops, one task per concern (``LOOPS``): place queued jobs on live
offers (market/placement), end leases whose heartbeats stopped or that ran past their limits,
decide the verdicts of spot checks, and collect garbage.

Only the broker that leads runs them (``lead``). A broker on SQLite always leads (one process,
one file). Brokers sharing a PostgreSQL store take turns under the leadership lease
(broker/store/leadership.py): the holder of the ``scheduler`` role runs ``LOOPS`` with every
write fenced by its epoch (``FencedStore``: a deposed leader's late write is refused whole),
renews the role every ttl/3 and steps down, its loops cancelled, when a renewal fails or comes
too late; every broker of the store runs ``SHARED_LOOPS`` (its own providers' heartbeats,
the offers of providers connected elsewhere, leases to deliver to its own providers)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import operator
import time
import weakref
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from gpumarket import kinds
from gpumarket.broker.checks import verdicts
from gpumarket.broker.jobs import arrays
from gpumarket.broker.jobs import endings
from gpumarket.broker.jobs import preemption as preempt_rows
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs import views
from gpumarket.broker.jobs.job import Job, set_queue_reasons
from gpumarket.broker.market import deadlines
from gpumarket.broker.market import matcher
from gpumarket.broker.market import placement
from gpumarket.broker.market import preemption
from gpumarket.broker.market import providers
from gpumarket.broker.market.kept_book import KeptBook, KeptHistories
from gpumarket.broker.market.offers import KeptOffers, claim_efficiency
from gpumarket.broker.config import BrokerConfig
from gpumarket.broker import state as shared
from gpumarket.broker.state import BrokerState
from gpumarket.broker.store import blob_holdings
from gpumarket.broker.store import call_nonces
from gpumarket.broker.store import leadership
from gpumarket.broker.store.leadership import Deposed
from gpumarket.proto.envelope import seal
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb

log = logging.getLogger(__name__)
T = TypeVar("T")

ORPHAN_SWEEP_S = 3600     # how often the artifact store is swept for files no row holds
ORPHAN_MIN_AGE_S = 3600   # ... that were last written at least this long ago (whatever the
                          # artifact grace: a file is written a moment before its row)
RUNTIME_GRACE_S = 60      # past a job's max_runtime, before the broker takes the lease back


# The last Book each broker built (``offer_book``), for the submissions' price estimates
# (``recent_book``): at 10,000 offers a Book takes ~100 ms to build, once per Submit RPC
# before (issue 36).
BOOK_REUSE_S = 1.0


@dataclass(frozen=True)
class BuiltBook:
    """A Book with the offers it was built from and when (``time.monotonic``)."""

    book: matcher.Book
    offers: list[pb.Offer]
    built_at: float

    def reusable(self, offers: list[pb.Offer], now: float, max_age_s: float) -> bool:
        """Young enough, and built from the same offers: the same Offer objects in the same
        order — a session opened, closed or drained, or an offer replaced, changes them."""
        return (now - self.built_at < max_age_s and len(offers) == len(self.offers)
                and all(map(operator.is_, offers, self.offers)))


@dataclass
class BookParts:
    """What a broker keeps between Books, for as long as its sessions live: its offers'
    Templates and views (market/offers.KeptOffers: a pass over 10,000 offers makes again
    only those of new or changed offers, or of providers whose observed figures moved), its
    providers' records and the Book's columns (market/kept_book), and the last Book it
    built."""

    templates: KeptOffers = dataclasses.field(default_factory=KeptOffers)
    histories: KeptHistories = dataclasses.field(default_factory=KeptHistories)
    columns: KeptBook = dataclasses.field(default_factory=KeptBook)
    last: BuiltBook | None = None


_parts: weakref.WeakKeyDictionary[Any, BookParts] = weakref.WeakKeyDictionary()


def book_parts(state: BrokerState) -> BookParts:
    """What ``state``'s broker keeps between Books."""
    parts = _parts.get(state.sessions)
    if parts is None:
        parts = _parts[state.sessions] = BookParts()
    return parts


async def recent_book(state: BrokerState, max_age_s: float = BOOK_REUSE_S,
                      clock: Callable[[], float] = time.monotonic) -> matcher.Book:
    """A Book for an estimate (a submission's hold, its array's lanes, its deadline check;
    a quote): the last one built, while younger than ``max_age_s`` and no offer came, went
    or changed since; else a new one (kept for the next). A hold is a bound, not a price:
    the job's max price times twice its wall time on the offers that fit it (money/
    credit_holds), and the job is charged for its real leases; within a second only the
    devices leased or freed and the providers' records can have moved, which change that
    wall time little, and a hold that proves short pauses the job, it does not lose it.
    What must not use a Book this old is anything that leases or takes a lease back: the
    placement pass builds its own each pass (``place_queued``; preemption and the deadline
    promotions use that one) and leaves it here for the submissions."""
    last = book_parts(state).last
    if last is not None and last.reusable(state.sessions.offers(), clock(), max_age_s):
        return last.book
    return await offer_book(state, clock)


async def offer_book(state: BrokerState,
                     clock: Callable[[], float] = time.monotonic) -> matcher.Book:
    """The live offers, corrected by what the broker observed, as one Book (kept for
    ``recent_book``)."""
    store = state.store
    built_at = clock()
    offers = state.sessions.offers()
    now = now_ms()
    busy = await state.busy_devices()
    loads = await store.read(views.active_lease_counts)
    parts = book_parts(state)
    due = parts.histories.due(offers, loads, now)
    read = await store.read(views.histories, due, now) if due else {}
    hist = parts.histories.keep(offers, loads, read, now)
    # Speeds achieved are measured on the kinds sized as training (their runners report
    # tokens a second against the model's size).
    trained = {k.number for k in kinds.all_kinds() if k.sizing == "training"}
    achieved = {p: f for (p, kind), f in (await store.read(views.achieved_flops)).items()
                if kind in trained}
    efficiency = claim_efficiency(offers, achieved)
    stakes = await store.read(views.stakes)
    book = parts.columns.book(parts.templates.views(offers, hist, achieved, busy, loads,
                                                    efficiency, stakes),
                              datetime.now(timezone.utc))
    parts.last = BuiltBook(book, offers, built_at)
    return book


async def place_queued(state: BrokerState) -> int:
    """One placement pass (market/placement: read, plan, apply): lease what fits, record why
    the rest waits. Returns leases made."""
    store, cfg = state.store, state.config
    if not await store.read(views.queued_jobs, 1):
        return 0
    if state.shared:    # the offers of providers connected to other brokers, as of now
        await shared.refresh_offers(state)
    book = await preemption.hold_freed(state, await offer_book(state))
    await deadlines.promote_due(state, book)
    trusted = frozenset(cfg.trusted_checkers)
    scan = placement.QUEUE_SCAN
    queued = await store.read(placement.read_queue, book, now_ms(), trusted, scan)
    running = await store.read(views.running_by_client)
    online = {o.provider_id for o in state.sessions.offers()}
    held = 0
    if cfg.serving_reserve:     # devices a replica may have within a checkpoint (the pass's rule)
        held = sum(len(x.devices) for x in preemption.replica_may_take(
            await store.read(preempt_rows.interruptible_leases, now_ms())))
    plan = placement.plan(queued, book, running, online, int(cfg.accept_within_s * 1000),
                          cfg.serving_reserve, held)
    made = await apply(state, plan)
    if plan.reasons:
        await store.write(set_queue_reasons, plan.reasons)
    if plan.blocked:
        await preemption.preempt_for_waiting(state, book, [needs for _, needs in plan.blocked])
        await ask_to_yield(state, book, plan.blocked, running)
    if made:
        state.events.notify()
        if len(queued) >= scan:
            # The pass read as many queued jobs as it reads at most, and leased some: more
            # may wait behind them, and no submission may come to wake the loop for them
            # (a burst wrote them all before this pass): the next pass comes at once, not a
            # schedule interval later (bench/ha.py: a 1 s gap in 2,000 placements).
            state.placement.notify_here()
    return made


async def apply(state: BrokerState, plan: placement.Plan) -> int:
    """Write the plan's leases (one transaction) and send each to its provider; returns how
    many were made."""
    sessions = {p.terms.provider_id: state.sessions.get(p.terms.provider_id)
                for p in plan.leases}
    leases = [p for p in plan.leases if sessions[p.terms.provider_id] is not None]
    if not leases:
        return 0
    made = await state.store.write(placement.write_leases, leases, now_ms(),
                                   lambda lease: seal(state.identity, lease))
    now = now_ms()
    for planned, envelope in made:
        job, terms = planned.job, planned.terms
        state.metrics.placements.inc()
        state.metrics.queue_wait.observe(max(0, now - job.updated_at_ms) / 1000)
        if job.attempt == 1:
            state.metrics.time_to_lease.observe(max(0, now - job.created_at_ms) / 1000)
        else:
            state.metrics.resumes.inc()
        sessions[terms.provider_id].send(gw.BrokerMessage(lease=envelope))
        log.info("job %s leased to %s on devices %s (%s: expected %.0fs, %.4g credits)",
                 job.id, terms.provider_id, list(terms.device_indices), planned.objective,
                 planned.estimate.expected_s, planned.estimate.expected_cost)
    return len(made)


def fair_share(devices: int, clients: int) -> int:
    """The devices each client with work may hold while others wait (at least one)."""
    return max(1, devices // max(1, clients))


async def ask_to_yield(state: BrokerState, book: matcher.Book,
                       blocked: list[tuple[Job, matcher.JobNeeds]],
                       running: dict[str, int]) -> int:
    """Jobs of clients holding less than their fair share of the devices wait for a busy
    one: ask leases of job arrays of clients holding more than theirs, on providers that fit
    a waiting job, to yield after their current task (broker/jobs/arrays.py yield_lease; the
    rest of their tasks go back to the queue), as many as the waiting need, less those
    asked already. Returns how many were asked."""
    devices = sum(len(o.devices) for o in state.sessions.offers())
    clients = set(running) | {job.client_id for job, _ in blocked}
    share = fair_share(devices, len(clients))
    held = dict(running)
    waiting: dict[str, list[matcher.JobNeeds]] = defaultdict(list)
    for job, needs in blocked:
        if held.get(job.client_id, 0) < share:
            waiting[job.client_id].append(needs)
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
            state.sessions.ask_to_yield(
                lease["provider_id"], lease["id"], lease["epoch"],
                f"a job of another client waits for a device (fair share: {share} devices"
                f" a client)")
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
    await collect_orphans(state, min(cutoff / 1000, time.time() - ORPHAN_MIN_AGE_S))
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


async def collect_orphans(state: BrokerState, before: float) -> int:
    """Delete files under the artifact store that no row holds and that were last written
    before ``before`` (seconds): blobs an UploadBlobs call published and then could not
    record (its key went over quota meanwhile), and what a killed broker left between
    writing a blob and recording it. Without this no one would ever remove them. Looked
    for at most once an hour: it lists every blob."""
    if time.monotonic() < state.artifacts.orphans_due:
        return 0
    state.artifacts.orphans_due = time.monotonic() + ORPHAN_SWEEP_S
    files = await asyncio.to_thread(state.artifacts.old_files, before)
    removed = 0
    for i in range(0, len(files), 1000):
        chunk = files[i:i + 1000]
        named = [sha for sha, _ in chunk if sha]
        orphans = await state.store.read(blob_holdings.unrecorded, named) if named else set()
        for sha, path in chunk:
            if (not sha or sha in orphans) and _older(path, before):
                path.unlink(missing_ok=True)
                removed += 1
    if removed:
        log.warning("removed %d files of the artifact store that no row held", removed)
    return removed


def _older(path: Path, before: float) -> bool:
    try:
        return path.stat().st_mtime < before
    except FileNotFoundError:
        return False


async def forget_garbage(state: BrokerState) -> None:
    """Collect unreferenced blobs and stalled uploads, and forget expired call nonces."""
    await collect_garbage(state)
    await state.store.write(call_nonces.forget, now_ms())


@dataclass(frozen=True)
class Loop:
    """One background concern of the broker: its pass, how often it runs at least, and
    whether a change a placement depends on (``state.placement``) wakes it sooner."""

    name: str
    one_pass: Callable[[BrokerState], Awaitable[object]]
    interval_s: Callable[[BrokerConfig], float]
    woken: bool = True
    # The loops that make or end leases take turns, a pass at a time, so that none reads
    # the devices or leases another is changing (a lease ended here holds its devices only
    # once its write is done: BrokerState.stop_lease).
    takes_turns: bool = True


LOOPS = (
    Loop("placement", place_queued, lambda c: c.schedule_interval_s),
    # Heartbeats heard are written before the leases whose heartbeats stopped are lost.
    Loop("leases", expire, lambda c: c.schedule_interval_s),
    Loop("verdicts", verdicts.decide, lambda c: c.schedule_interval_s),
    Loop("garbage", forget_garbage, lambda c: c.gc_interval_s, woken=False, takes_turns=False),
)


# What every broker of a shared store runs, leader or not: none of it makes or ends a lease.
SHARED_LOOPS = (
    # This broker's providers' heartbeats (the leader's loops read them from the store).
    Loop("heartbeats", write_heartbeats, lambda c: c.schedule_interval_s, woken=False,
         takes_turns=False),
    Loop("offers", shared.refresh_offers, lambda c: c.schedule_interval_s, takes_turns=False),
    Loop("deliveries", shared.deliver_leases, lambda c: c.schedule_interval_s, woken=False,
         takes_turns=False),
)


async def run(state: BrokerState, loops: tuple[Loop, ...] = LOOPS,
              also: tuple[Callable[[BrokerState], Awaitable[object]], ...] = ()) -> None:
    """Run each of ``loops`` as a task of its own (and each of ``also``, given ``state``)
    until cancelled."""
    turns = asyncio.Lock()
    async with asyncio.TaskGroup() as tasks:
        for loop in loops:
            tasks.create_task(repeat(state, loop, turns), name=f"broker {loop.name}")
        for other in also:
            tasks.create_task(other(state))


class FencedStore:
    """The store as the leader's loops see it: every write is made through
    ``leadership.fenced`` with the leader's epoch, in the write's own transaction, so once
    another broker has taken the role it is refused whole (Deposed); reads as the store's."""

    def __init__(self, store: Any, epoch: int) -> None:
        self.store = store
        self.epoch = epoch

    async def write(self, fn: Callable[..., T], *args: Any, transaction: bool = True) -> T:
        return await self.store.write(leadership.fenced, self.epoch, now_ms(), fn, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def as_leader(state: BrokerState, epoch: int) -> BrokerState:
    """``state`` as the loops of the leader at ``epoch`` use it: the same sessions, changes
    and liveness, its writes fenced."""
    return dataclasses.replace(state, store=FencedStore(state.store, epoch))


async def lead(state: BrokerState,
               also: tuple[Callable[[BrokerState], Awaitable[object]], ...] = ()) -> None:
    """Run the loops while this broker leads, until cancelled: on SQLite at once and for
    good; on a shared store each time it takes the scheduler role, until it loses it (and
    ``also``, the leader's other tasks, with them)."""
    if not state.shared:
        state.epoch = 0
        await run(state, LOOPS, also)
        return
    cfg = state.config
    ttl_ms = int(cfg.leader_ttl_s * 1000)
    while True:
        try:
            epoch = await state.store.write(leadership.take, state.holder, now_ms(), ttl_ms)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("could not ask for the scheduler role: %s", exc)
            epoch = None
        if epoch is not None:
            await lead_term(state, epoch, also)
        await asyncio.sleep(cfg.leader_ttl_s / 3)


async def lead_term(state: BrokerState, epoch: int,
                    also: tuple[Callable[[BrokerState], Awaitable[object]], ...] = ()) -> None:
    """Lead at ``epoch`` until the role is lost: take over (every active lease waits for its
    provider from now, as after a restart), run the loops, renew every ttl/3; step down
    (the loops cancelled, in-flight passes with them) when a renewal fails, is refused, or
    has not come back before the lease would run out."""
    cfg = state.config
    ttl_s = cfg.leader_ttl_s
    loop = asyncio.get_running_loop()
    began = loop.time()
    leader = as_leader(state, epoch)
    try:
        kept = await leader.store.write(providers.renew_all_leases, now_ms(),
                                        int(cfg.lease_timeout_s * 1000))
    except Deposed:
        return
    state.epoch = epoch
    log.info("this broker leads (scheduler epoch %d); %d active leases wait for their"
             " providers", epoch, kept)
    state.placement.notify_here()
    loops = asyncio.create_task(run(leader, LOOPS, also), name="broker loops")
    held_until = began + ttl_s
    why = "cancelled"
    try:
        while True:
            done, _ = await asyncio.wait({loops}, timeout=ttl_s / 3)
            if done:
                why = f"its loops ended ({loops.exception()!r})"
                break
            asked = loop.time()
            try:
                renewed = await asyncio.wait_for(
                    state.store.write(leadership.renew, state.holder, epoch, now_ms(),
                                      int(ttl_s * 1000)),
                    max(0.0, held_until - asked - ttl_s / 10))
            except (Exception, TimeoutError) as exc:
                why = f"its renewal failed ({exc!r})"
                break
            if not renewed:
                why = "its renewal was refused"
                break
            held_until = asked + ttl_s
    finally:
        state.epoch = None
        loops.cancel()
        await asyncio.gather(loops, return_exceptions=True)
        if why == "cancelled":      # the broker stops: hand the role on now, not a ttl later
            try:
                await asyncio.wait_for(state.store.write(leadership.release, state.holder,
                                                         epoch), ttl_s)
            except Exception as exc:    # noqa: BLE001 - it runs out by itself all the same
                log.warning("could not hand the scheduler role on: %s", exc)
        log.warning("this broker no longer leads (scheduler epoch %d): %s", epoch, why)


async def repeat(state: BrokerState, loop: Loop, turns: asyncio.Lock) -> None:
    """Run ``loop``'s pass, then wait for its interval (or a change, if it is woken), until
    cancelled; a pass that fails is logged and tried again at the next."""
    while True:
        seen = state.placement.seen()
        try:
            if loop.takes_turns:
                async with turns:
                    await loop.one_pass(state)
            else:
                await loop.one_pass(state)
        except (asyncio.CancelledError, Deposed):
            raise           # deposed: this broker no longer leads (lead_term steps down)
        except Exception:
            log.exception("broker %s pass failed; retrying", loop.name)
        if loop.woken:
            await state.placement.wait(loop.interval_s(state.config), since=seen)
        else:
            await asyncio.sleep(loop.interval_s(state.config))
