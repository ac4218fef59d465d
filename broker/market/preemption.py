"""Which interruptible leases yield to a job of a higher tier (docs/broker.md, Preemption).

A standard job or an endpoint's replica that fits no free device, but would fit one provider
if some of its interruptible leases gave theirs back, preempts those leases: each is asked
to checkpoint now and stop (PreemptLease: the same as a drain, with a grace period), ends
PREEMPTED, and its job resumes from that checkpoint; the waiting job is placed on the freed
devices first (the scheduler places higher tiers first). A standard lease is never
preempted, and an interruptible job never preempts anything.

``choose`` is plain code over the matcher's Book; ``preempt_for_waiting`` is the
scheduler's pass.
"""

from __future__ import annotations

import dataclasses
import logging

from gpumarket.broker.jobs import preemption as rows
from gpumarket.broker.jobs.preemption import Interruptible
from gpumarket.broker.market import matcher
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.slices import blocked
from gpumarket.proto.v1 import gateway_pb2 as gw

log = logging.getLogger(__name__)

TIER_RANK = {"serving": 0, "standard": 1, "interruptible": 2}   # placed in this order
SERVING_BACKUP = True  # True: a replica preempts a second set of leases, the first to yield its


def outranks(tier: str) -> bool:
    """Whether a job of ``tier`` may take devices an interruptible lease holds."""
    return tier in ("serving", "standard")


def replica_may_take(leases: list[Interruptible]) -> list[Interruptible]:
    """The interruptible leases whose devices a serving replica may have within a checkpoint:
    those not asked to yield, and those yielding to a job that no longer waits for them (a
    replica's second set, once it took the first device freed: docs/tiers.md). A lease
    yielding to a job still queued is that job's. The one rule of both sides: the serving
    reserve counts these leases' devices as a replica's (scheduler.place_queued), and the
    preemption pass hands a waiting replica the second kind before it preempts anything
    new (``preempt_for_waiting``) — else those devices go back to an interruptible job,
    often the one just preempted from them (bench/tiers.py ``preemptions_undone``). A
    standard job waiting is handed what no replica waits for (a standard job's leftover: it
    was placed elsewhere first), as it would be a lease it preempted itself: the reserve
    lets it preempt only what it could spare anyway (placement.plan)."""
    return [x for x in leases if not x.preempt_for or not x.for_waiting]


def spare_yielding(leases: list[Interruptible]) -> list[Interruptible]:
    """Of ``replica_may_take``'s leases, those yielding already (to a job no longer waiting),
    as ``choose`` weighs them: free to be chosen."""
    return [dataclasses.replace(x, preempt_for="") for x in replica_may_take(leases)
            if x.preempt_for]


def choose(book: matcher.Book, job: matcher.JobNeeds, leases: list[Interruptible]
           ) -> list[Interruptible]:
    """The interruptible leases to preempt so that ``job`` fits one provider, or [] if it
    cannot (or may not preempt). The provider is one whose offer meets every constraint of
    the job but free devices; of those, the one where the fewest leases lose the least
    unsaved work (then the job's own objective: its book order); leases already yielding
    are not counted twice.

    Devices are weighed as proto/slices leases them: a card is free only once every lease
    of its slices has ended, a slice once the lease of its card has, so a whole-card job
    waiting on a card its slices' leases hold frees all of them in one pass, and a job a
    slice is enough for frees one slice (or the card's lease), whichever view of the
    provider (its whole devices, its slices) costs the fewest leases."""
    if not outranks(job.tier) or not leases:
        return []
    views = placeable_views(book, job)
    providers = {book.offers[i].provider_id for i in views}
    by_provider: dict[str, list[Interruptible]] = {}
    for lease in leases:
        if lease.provider_id in providers and not lease.preempt_for:
            by_provider.setdefault(lease.provider_id, []).append(lease)
    best: tuple[tuple, list[Interruptible]] | None = None
    for i in views:
        theirs = by_provider.get(book.offers[i].provider_id)
        if not theirs:
            continue
        picked = _freeing(book.offers[i], book.leased_on(i), theirs, max(1, job.gpus))
        if not picked:
            continue
        key = (len(picked), sum(x.unsaved_ms for x in picked),
               float(book.prices(job.tier)[i]), book.offers[i].provider_id, i)
        if best is None or key < best[0]:
            best = (key, picked)
    return best[1] if best else []


def placeable_views(book: matcher.Book, job: matcher.JobNeeds) -> list[int]:
    """The offers (views) ``job`` would be placed on if enough of their devices were free:
    every constraint but free devices, its deadline included (``too_slow``, and the
    deadline objective's), as the placement pass weighs them. Devices preempted on an offer
    too slow for the deadline were never the job's: they went back to the interruptible job
    just preempted from them, and the job preempted again at the next pass (bench/tiers.py
    ``preemptions_undone_same_job``, 4 simulated days: 78 before, 22 after)."""
    views = [i for i in book.fitting_views(job) if i not in job.too_slow]
    if job.objective == "deadline" and job.deadline_s:
        views = [i for i in views if book.estimate(job, i).expected_s <= job.deadline_s]
    return views


def _freeing(view: matcher.OfferView, leased: set[int], theirs: list[Interruptible],
             wanted: int) -> list[Interruptible]:
    """The fewest of ``theirs`` (the provider's interruptible leases, least unsaved work
    first) that leave ``wanted`` of ``view``'s devices free, or [] if they cannot (a device
    a lease of another tier holds, or one yielding already, stays busy)."""
    cards = view.cards

    def closure(devices) -> set[int]:
        return blocked(cards, devices) if cards else set(devices)

    def free(picked: list[Interruptible]) -> set[int]:
        rest = leased - {d for x in picked for d in x.devices}
        taken = closure(rest)
        return {d for d in view.device_indices if d not in taken}

    holds = {x.lease_id: closure(x.devices) for x in theirs}
    picked: list[Interruptible] = []
    now_free = free(picked)
    while len(now_free) < wanted:
        options = []
        for d in view.device_indices:
            if d in now_free:
                continue
            more = [x for x in theirs if x not in picked and d in holds[x.lease_id]]
            if not more or d not in free(picked + more):
                continue
            options.append(((len(more), sum(x.unsaved_ms for x in more),
                             sorted(x.lease_id for x in more)), more))
        if not options:
            return []
        more = min(options, key=lambda o: o[0])[1]
        picked += sorted(more, key=lambda x: (x.unsaved_ms, x.lease_id))
        now_free = free(picked)
    return picked


async def preempt_for_waiting(state, book: matcher.Book,
                              waiting: list[matcher.JobNeeds]) -> int:
    """For each waiting job of a higher tier (in placement order: replicas first) that no
    lease yields to yet, hand it leases yielding already to a job no longer waiting
    (``spare_yielding``) where those are enough, else preempt the interruptible leases
    ``choose`` names and tell their providers. Returns how many leases were newly asked."""
    waiting = [job for job in waiting if outranks(job.tier)]
    if not waiting:
        return 0
    now = now_ms()
    leases = await state.store.read(rows.interruptible_leases, now)
    if not leases:
        return 0
    served = await state.store.read(rows.waiting_for)
    grace = int(state.config.preempt_grace_s)
    asked = 0
    spare = spare_yielding(leases)
    for job in waiting:
        if job.job_id in served:
            continue        # leases yield to it already: it is placed when they have
        if kept := choose(book, job, spare):
            # Leases yielding already to a job leased since (a replica's second set, a
            # standard job placed elsewhere first): handed on, not a new preemption.
            by_id = {x.lease_id: x for x in leases}
            for lease in kept:
                was = by_id[lease.lease_id].preempt_for
                if await state.store.write(rows.retarget, lease.lease_id, was, job.job_id,
                                           job.tier, now):
                    log.info("lease %s (yielding to %s) now yields to %s job %s",
                             lease.lease_id, was, job.tier, job.job_id)
            taken = {x.lease_id for x in kept}
            spare = [x for x in spare if x.lease_id not in taken]
            leases = [x for x in leases if x.lease_id not in taken]
            continue
        chosen = choose(book, job, leases)
        if chosen and job.tier == "serving" and SERVING_BACKUP:
            # A replica waits for the first of two to yield, not for the slower of them (a
            # big checkpoint on a slow uplink, a job that lets its grace run out): the
            # other's device goes to the next job waiting, the spike's next replica first.
            rest = [x for x in leases if x not in chosen]
            chosen = chosen + choose(book, job, rest)
        for lease in chosen:
            ended = await state.store.write(rows.preempt, lease.lease_id, job.job_id, job.tier,
                                            grace, now)
            if ended is None:
                continue
            asked += 1
            session = state.sessions.get(lease.provider_id)
            if session is not None:
                session.send(gw.BrokerMessage(preempt_lease=gw.PreemptLease(
                    job_id=lease.job_id, epoch=lease.epoch, grace_s=grace,
                    reason=f"preempted by a {job.tier} job")))
            log.info("lease %s (interruptible) preempted for %s job %s", lease.lease_id,
                     job.tier, job.job_id)
        taken = {x.lease_id for x in chosen}
        leases = [x for x in leases if x.lease_id not in taken]
    return asked


def held_since(state) -> int:
    """Since when a preemption's freed devices are still its waiting job's: a grace period
    and a lease timeout ago (past that, ``end_overdue`` has ended the lease)."""
    return now_ms() - int((state.config.preempt_grace_s + state.config.lease_timeout_s)
                          * 1000)


async def hold_freed(state, book: matcher.Book) -> matcher.Book:
    """The Book with the devices that leases preempted for a waiting job have freed kept busy,
    (and that provider's other free devices, which it counted on), while another of that
    provider's leases still yields to it and the job does not fit there yet: they are its,
    not the next interruptible job's. (bench/tiers.py: a 4-device
    standard job preempted four leases; each device freed went back to an interruptible job
    at the next pass, which it preempted again, before start: twice the preemptions, and a
    pass for each release and its timeout; 3,986 preemptions for 910 jobs in 3.6 days.)
    A job that fits there once a device is free (a replica with a second set of leases
    yielding) is not held back; the last lease to yield leaves nothing held, and the pass
    places the job first (a higher tier). Held for a grace period and a lease timeout at
    most: a lease still yielding past that is ended (``end_overdue``)."""
    since = held_since(state)
    freed: dict[tuple[str, str], tuple[set[int], int]] = {}
    for job_id, provider_id, devices, wanted in await state.store.read(
            rows.freed_for_waiting, since):
        freed.setdefault((job_id, provider_id), (set(), wanted))[0].update(devices)
    held: dict[str, set[int]] = {}
    for (_, provider_id), (devices, wanted) in freed.items():
        views = [book.offers[i] for i in book.views.get(provider_id, ())]
        if views and not any(len(v.free) >= max(1, wanted) for v in views):
            # Its provider's other free devices too: the job counted on them when it chose
            # the leases to preempt (it needs more than are free there).
            held.setdefault(provider_id, set()).update(devices, *(v.free for v in views))
    if not held:
        return book
    return matcher.Book([dataclasses.replace(v, busy=frozenset(v.busy | held[v.provider_id]))
                         if v.provider_id in held else v for v in book.offers], book.now)


async def end_overdue(state) -> bool:
    """End the leases asked to yield that did not within their grace period (and the lease
    timeout beyond it): PREEMPTED all the same, their providers told to stop them. Returns
    whether any ended."""
    now = now_ms()
    limit = int((state.config.preempt_grace_s + state.config.lease_timeout_s) * 1000)
    changed = False
    for lease_id, job_id, epoch, provider_id in await state.store.read(rows.overdue,
                                                                       now - limit):
        why = "did not stop within its grace period"
        if await state.store.write(rows.end, lease_id, why, now):
            log.warning("lease %s preempted by the broker: it %s", lease_id, why)
            state.stop_lease(job_id, epoch, provider_id, f"preempted: {why}")
            changed = True
    return changed
