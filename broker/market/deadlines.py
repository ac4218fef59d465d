"""Deadlines of interruptible jobs (docs/broker.md, Deadlines): an interruptible job whose
time left before its deadline no longer covers what it has left to run — its calibrated wall
time on the best offer for it (on its own provider while it holds a lease), for the share of
its steps not checkpointed yet, times ``MARGIN``, plus ``SLACK_S`` — is moved to the standard
tier, so that it is not preempted, and pays the standard price from then on: a running lease
from its last checkpoint (a job whose max_price is below that price stays interruptible).
Interruptible is cheaper and still on time.

The same estimate keeps it off the offers where it would be late from the start, before
and after its promotion (``too_slow``: placement, whatever its objective); admission
refuses a deadline no offer could meet even now (admission.check_deadline). A standard job
with a deadline is weighed the same way by both (never preempted, it is never promoted).
The rules: docs/tiers.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging

from gpumarket.broker.jobs import preemption as rows
from gpumarket.broker.market import calibration
from gpumarket.broker.market import matcher
from gpumarket.broker.market.admission import needs_of
from gpumarket.broker.money import credit_holds
from gpumarket.proto.jobspec import now_ms

log = logging.getLogger(__name__)

MARGIN = 1.5        # the estimate's error, and a preemption's lost interval and restart
SLACK_S = 60.0      # a lease's start and its last upload


def remaining_s(wall_s: float, done_steps: int, total_steps: int) -> float:
    """What a job of ``wall_s`` (a whole run) has left once ``done_steps`` of
    ``total_steps`` are checkpointed (all of it where its steps are not known)."""
    if total_steps <= 0:
        return wall_s
    return wall_s * max(0.0, 1.0 - min(done_steps, total_steps) / total_steps)


def due(left_s: float, remaining: float) -> bool:
    """Whether a job with ``left_s`` seconds before its deadline and ``remaining`` seconds
    of work must run as standard to finish in time."""
    return left_s < remaining * MARGIN + SLACK_S


def weighs(tier: str, deadline_s: float) -> bool:
    """Whether a job's deadline is weighed (placement, admission): a training job's, of
    either tier; an endpoint's replicas (serving) have none."""
    return deadline_s > 0 and tier in ("interruptible", "standard")


def too_slow(db, book: matcher.Book, job, needs: matcher.JobNeeds,
             fitted: dict | None = None) -> frozenset[int]:
    """The Book's offers (views) on which a ``job`` with a deadline (interruptible or
    standard, promoted or not) would not finish in time — its calibrated wall time there,
    for what it has left, times ``MARGIN`` plus ``SLACK_S``, does not fit before its
    deadline (``due``, the rule that promotes an interruptible job): placement leaves them
    out whatever its objective, so it is never leased where it is late from the start (or
    the cheapest offer takes it, however slow). Where every offer that fits is too slow,
    none is left out: it runs where it can (promoted first where its price allows).
    ``fitted``: calibration models by job kind, shared by one pass."""
    if not weighs(needs.tier, needs.deadline_s):
        return frozenset()
    views = book.fitting_views(needs)
    if not views:
        return frozenset()
    fitted = {} if fitted is None else fitted
    models = fitted.get(needs.kind)
    if models is None:
        models = fitted[needs.kind] = calibration.models(
            db, {o.provider_id: o.accelerator for o in book.offers}, needs.kind)
    out = set()
    for i in views:
        view = book.offers[i]
        seconds = models[view.provider_id].seconds(
            credit_holds.raw_seconds(needs.work_flops, view, needs.gpus))
        if due(needs.deadline_s, remaining_s(seconds, job.checkpoint_step, job.progress_total)):
            out.add(i)
    return frozenset(out) if len(out) < len(views) else frozenset()


async def promote_due(state, book: matcher.Book) -> int:
    """Promote the interruptible jobs whose deadline is near (one pass); returns how many."""
    promoted = 0
    for job_id, why, lease_price in await state.store.read(due_jobs, book):
        if await state.store.write(rows.promote, job_id, why, now_ms(), lease_price):
            log.info("job %s promoted to standard: %s", job_id, why)
            promoted += 1
    return promoted


def due_jobs(db, book: matcher.Book) -> list[tuple[str, str, float | None]]:
    """The interruptible jobs with a deadline that must run as standard now: (job, why, the
    standard price its running lease is charged from now on, or None if it has none). One
    read for all of them: a pass with jobs waiting asks it."""
    out = []
    for job in rows.deadline_jobs(db):
        needs = dataclasses.replace(needs_of(job), tier="standard")
        found, _ = book.candidates(needs, 1)
        if not found:
            continue    # no offer could run it at the standard price: it stays interruptible
        lease_price = None
        if job.lease_id:
            # Its running lease is charged the standard price from now on (from its last
            # checkpoint: the settled cursor), or a deadline would buy standard protection at
            # the interruptible price; not promoted where that price is above its max_price.
            # (on the offer it runs on: a slice's own price where it holds a slice)
            leased = db.execute("SELECT device_indices FROM leases WHERE id = ?",
                                [job.lease_id]).fetchone()
            i = book.view_of(job.provider_id, json.loads(leased[0]) if leased else ())
            if i is None:
                continue    # its provider is not offering now: its lease ends on its own
            lease_price = float(book.prices("standard")[i])
            if lease_price > needs.max_price_per_gpu_hour:
                continue
            # Timed on the device it runs on, which may be much slower than the best offer
            # for it: the one it got was the best free one.
            found = [book.estimate(needs, i)]
        timed = credit_holds.timed(db, book, needs, found)
        left = remaining_s(timed[0].seconds, job.checkpoint_step, job.progress_total)
        if due(needs.deadline_s, left):
            why = (f"{needs.deadline_s:.0f} s left before its deadline, about {left:.0f} s of"
                   f" work left ({timed[0].basis}; x{MARGIN:g} + {SLACK_S:.0f} s)")
            out.append((job.id, why, lease_price))
    return out
