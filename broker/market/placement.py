"""Placement as plan then apply (docs/architecture.md, One job, submit to result, step 3).

One pass of the scheduler:

1. **read** (``read_queue``, one read transaction): the queued jobs as ``Job``s, each with
   its stored needs in its placement context — the providers it avoids (tried before, busy
   with a sibling, failed its array's tasks or its endpoint's replicas) or must not go to
   (the work a check replays, a provider a check found wrong) — and what its hold has left;
2. **plan** (``plan``, no store, no clock, no network: tested as a plain function): in
   tier and fair order, the matcher places each on the Book of live offers, and the plan
   says which leases to make (``LeaseTerms``), why the others wait, and which wait for a busy
   device;
3. **apply** (``write_leases``, one write transaction): ``jobs.transitions.create_leases``
   for the leases planned; the scheduler then sends them.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections import defaultdict, deque
from collections.abc import Collection
from dataclasses import dataclass, field

from sqlite_utils import Database

from gpumarket.broker.checks import verification
from gpumarket.broker.jobs import arrays
from gpumarket.broker.jobs import transitions
from gpumarket.broker.jobs import views
from gpumarket.broker.jobs.job import Job, LeaseTerms
from gpumarket.broker.market import deadlines
from gpumarket.broker.market import matcher
from gpumarket.broker.market import preemption
from gpumarket.broker.market import reliability
from gpumarket.broker.market.admission import Needs, needs_of
from gpumarket.broker.money import credit_holds
from gpumarket.broker.money import ledger
from gpumarket.broker.serving import endpoints
from gpumarket.proto.v1 import types_pb2 as pb

QUEUE_SCAN = 1000       # queued jobs read in one pass


@dataclass(frozen=True)
class Queued:
    """One queued job as the plan weighs it."""

    job: Job
    stored: Needs                   # its needs as admission stored them
    needs: matcher.JobNeeds         # the matcher's view: ``stored`` in its placement context
    hold_left: int | None = None    # units left in the hold it draws on (None: it does not
                                    # enforce funds, any lease is covered)


@dataclass(frozen=True)
class PlannedLease:
    """A lease the plan makes: its terms, and the matcher's estimate (for the log)."""

    job: Job
    terms: LeaseTerms
    estimate: matcher.Estimate
    objective: str


@dataclass
class Plan:
    """What one pass decided."""

    leases: list[PlannedLease] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)    # job id: why it waits (changed)
    blocked: list[tuple[Job, matcher.JobNeeds]] = field(default_factory=list)
                                                              # waiting for a busy device


def fair_order(rows: list, running: dict[str, int]) -> list:
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


_checker_draw = secrets.SystemRandom()


def check_needs(db: Database, book: matcher.Book, check_id: str, needs: matcher.JobNeeds,
                trusted_checkers: frozenset[str] = frozenset()) -> matcher.JobNeeds:
    """A spot check's provider is drawn (by stake and record, from a source no provider can
    predict: matcher.Book.drawn), not chosen by price; a tie-break goes only to the
    operator's ``trusted_checkers`` where there are any (docs/verification.md, Who
    checks)."""
    exclude = needs.exclude
    if trusted_checkers and verification.role(db, check_id) == "tiebreak":
        exclude |= {o.provider_id for o in book.offers if o.provider_id not in trusted_checkers}
    return dataclasses.replace(needs, exclude=exclude, draw=_checker_draw.random())


def read_queue(db: Database, book: matcher.Book, now: int,
               trusted_checkers: frozenset[str] = frozenset(),
               limit: int = QUEUE_SCAN) -> list[Queued]:
    """The queued jobs (oldest first, at most ``limit``), each in its placement context, read
    in one transaction."""
    out = []
    fitted: dict = {}       # calibration models by job kind, for the deadlines of this pass
    queued = views.queued_jobs(db, limit)
    # No row of a job goes to a provider a check found wrong on that job (one read a pass).
    found_wrong = verification.found_wrong(db, {job.top_id for job in queued
                                                if not job.check_of})
    for job in queued:
        avoid: frozenset[str] = frozenset()
        if job.attempt > 1:
            # A job that was lost or failed goes elsewhere first; its old provider only if
            # nothing else fits.
            avoid = frozenset(views.previous_providers(db, job.id))
        if job.parent_id:
            # The parts of a split job go to different providers, where there are enough;
            # a job array's tasks that failed run again on another provider first.
            avoid |= views.busy_siblings(db, job.parent_id)
            avoid |= arrays.failed_on(db, job.id)
        # A check never goes to the provider it checks, nor to one in doubt on that job.
        exclude = verification.excluded(db, job.id) if job.check_of \
            else found_wrong.get(job.top_id, frozenset())
        stored = Needs.from_json(job.needs)
        if job.sort == "replica":
            # An endpoint's replicas keep away from the providers failing its replicas.
            failing, left_out = endpoints.steer(db, job.top_id, now)
            avoid, exclude = avoid | failing, exclude | left_out
        needs = needs_of(job, avoid, stored, exclude)
        if deadlines.weighs(stored.tier, stored.deadline_s):
            # Never leased where it would be late from the start, whatever its objective.
            needs = dataclasses.replace(needs, too_slow=deadlines.too_slow(
                db, book, job, needs, fitted))
        if job.sort == "check":
            needs = check_needs(db, book, job.id, needs, trusted_checkers)
        hold_left = None
        if job.enforce_funds:
            hold_left = ledger.balance(db, ledger.escrow(job.pays_from or job.top_id))
        out.append(Queued(job, stored, needs, hold_left))
    return out


def spare_devices(book: matcher.Book, interruptible: int) -> int:
    """Devices a replica could have now or within a checkpoint: the whole devices free in
    ``book`` and the ``interruptible`` ones interruptible leases hold."""
    return int(sum(book.free[i] for i in book.index.values())) + interruptible


def plan(queued: list[Queued], book: matcher.Book, running: dict[str, int],
         online: Collection[str], accept_within_ms: int, reserve: int = 0,
         interruptible: int = 0) -> Plan:
    """Decide one pass: which queued jobs are leased where, on what terms. Higher tiers
    first (serving, standard, interruptible), each in fair order, so that devices an
    interruptible lease gave back go to the job it yielded to. ``book`` is taken from as the
    plan places (its devices are the plan's); ``online``: the providers with a session now.
    Reads no store: everything it weighs is in ``queued``.

    ``reserve`` (config serving_reserve): a standard job is leased devices, or preempts
    interruptible leases for them, only while ``reserve`` devices stay free or held by
    interruptible leases (``interruptible``: how many they hold now) — what an endpoint's
    replicas take at once under a spike, with no standard job's end to wait for. A job its
    deadline promoted to standard is not held back."""
    out = Plan()
    spare = spare_devices(book, interruptible) if reserve else 0
    placed: dict[str, set[str]] = defaultdict(set)     # top job: providers of its planned rows
    by_id = {q.job.id: q for q in queued}
    ordered = sorted(fair_order([q.job for q in queued], running),
                     key=lambda job: preemption.TIER_RANK.get(by_id[job.id].stored.tier, 1))
    for job in ordered:
        q = by_id[job.id]
        needs = q.needs
        if job.parent_id and placed[job.parent_id]:
            # A sibling planned in this pass is busy there now, as one leased before is.
            needs = dataclasses.replace(needs, avoid=needs.avoid | placed[job.parent_id])
        # (a job its deadline promoted is not held back: it is standard to be on time)
        held_back = reserve and q.stored.tier == "standard" and not q.stored.promoted \
            and spare - needs.gpus < reserve
        if held_back:
            reason = (f"waiting: {reserve} devices are kept free or interruptible for endpoint"
                      f" replicas ({spare} are)")
            if reason != job.queue_reason:
                out.reasons[job.id] = reason
            continue
        placement, excluded = book.place(needs)
        if placement is None:
            reason = matcher.explain(excluded, len(book))
            if reason != job.queue_reason:
                out.reasons[job.id] = reason
            if "busy" in excluded:
                out.blocked.append((job, needs))
                if q.stored.tier != "interruptible":
                    spare -= needs.gpus         # what it preempts is no longer spare
            continue
        if placement.provider_id not in online:
            continue
        if not credit_holds.covers_lease(q.hold_left, placement.price_per_gpu_hour,
                                         len(placement.device_indices)):
            book.release(placement.offer_index, placement.device_indices)
            reason = (f"waiting for funds: its hold covers less than"
                      f" {credit_holds.RESUME_FLOOR_S} s of the best offer (gpumarket topup"
                      f" {job.top_id} AMOUNT)")
            if reason != job.queue_reason:
                out.reasons[job.id] = reason
            continue
        offer = book.offers[placement.offer_index]      # the view placed on: a slice's own
        terms = LeaseTerms(
            job_id=job.id, provider_id=placement.provider_id,
            device_indices=tuple(placement.device_indices),
            price_per_gpu_hour=placement.price_per_gpu_hour,
            accept_within_ms=accept_within_ms, checkpoint_every=q.stored.checkpoint_every,
            provider_mtbf_s=offer.mtbf_s,
            checkpoint_interval_s=reliability.checkpoint_interval_s(job.checkpoint_seconds,
                                                                    offer.mtbf_s),
            raw_runtime_s=credit_holds.raw_seconds(q.stored.work_flops, offer, q.stored.gpus),
            accelerator=offer.accelerator)
        out.leases.append(PlannedLease(job, terms, placement.estimate, q.stored.objective))
        if q.stored.tier != "interruptible":
            spare -= len(placement.device_indices)
        if job.parent_id:
            placed[job.parent_id].add(placement.provider_id)
    return out


def write_leases(db: Database, leases: list[PlannedLease], now: int, sign
                 ) -> list[tuple[PlannedLease, pb.Envelope]]:
    """Make the planned leases, in one transaction; return each made with its signed
    envelope (a job cancelled or changed since it was read is left out).

    The planned jobs are read again here, in this transaction, all in one statement (each
    is leased at most once a pass, and a lease changes no other planned job's row); their
    leases are then written together (``transitions.create_leases``: three statements for
    the pass's plain jobs, not three a lease), and none of those writes needs an answer, so
    on PostgreSQL (pipelined: broker/store/postgres.py) a pass costs a few round trips."""
    current = jobs_by_id(db, [planned.terms.job_id for planned in leases])
    found = [planned for planned in leases if planned.terms.job_id in current]
    envelopes = transitions.create_leases(
        db, [(planned.terms, current[planned.terms.job_id]) for planned in found], now, sign)
    return [(planned, envelope) for planned, envelope in zip(found, envelopes)
            if envelope is not None]


def jobs_by_id(db: Database, ids: list[str]) -> dict[str, Job]:
    """The jobs of ``ids`` that exist, by id, read in one statement."""
    cur = db.execute("SELECT * FROM jobs WHERE id IN (SELECT value FROM json_each(?))",
                     [json.dumps(ids)])
    rows = cur.fetchall()       # before the columns: on PostgreSQL one round trip, not two
    cols = [d[0] for d in cur.description]
    return {row["id"]: Job.from_row(row) for row in (dict(zip(cols, r)) for r in rows)}
