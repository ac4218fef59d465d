"""What a job holds at submission: its worst-case cost.

    hold = max_price x devices x parts x hold time
    hold time = max(MIN_HOLD_S, HOLD_MARGIN x the calibrated wall time on the slowest of the
                CANDIDATES offers the matcher ranks first), at most max_runtime when the job
                sets one, and at most MAX_HOLD_S;
                the job's max_runtime, or DEFAULT_HOLD_S, when its work is unknown or no offer
                fits it yet

or the job's own ``budget``. A job whose hold runs out is paused, not killed (jobs), and is
leased again only while its hold covers RESUME_FLOOR_S of the lease (``covers_lease``, the
one rule, which placement's plan applies). Plain code; only ``timed`` reads the store.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpumarket.broker.market import calibration
from gpumarket.broker.market import matcher
from gpumarket.broker.market.admission import Needs
from gpumarket.broker.money import ledger
from gpumarket.proto.errors import InvalidArgument
from gpumarket.proto.jobspec import MAX_CREDITS

HOLD_MARGIN = 2.0
MIN_HOLD_S = 300.0
DEFAULT_HOLD_S = 3600.0
MAX_HOLD_S = 7 * 24 * 3600.0     # an estimate beyond this is an offer's absurd figure, not a job
CANDIDATES = 5                   # the offers the matcher ranks first: where the job would go
# No device is slower than this: an offer claiming less (to inflate every job's hold) counts
# as this fast when sizing holds.
MIN_CLAIMED_FLOPS = 1e9


@dataclass(frozen=True)
class Timed:
    """One candidate offer with the calibrated wall time of the job on it."""

    estimate: matcher.Estimate
    raw_s: float
    seconds: float
    basis: str


def raw_seconds(work_flops: float, offer: matcher.OfferView, gpus: int) -> float:
    """The job's work at the offer's benchmark speed (0: unknown work or benchmark)."""
    if work_flops <= 0:
        return 0.0
    return work_flops / (max(offer.claimed_flops, MIN_CLAIMED_FLOPS) * max(gpus, 1))


def timed(db, book: matcher.Book, job: matcher.JobNeeds, found: list[matcher.Estimate]
          ) -> list[Timed]:
    """Calibrated wall times of ``job`` on the candidate offers ``found`` (a store read)."""
    # each on the offer it is for (a slice's own view, at its share of the card's speed)
    views = [book.offers[e.offer_index if e.offer_index >= 0 else book.index[e.provider_id]]
             for e in found]
    fitted = calibration.models(db, {o.provider_id: o.accelerator for o in views}, job.kind)
    out = []
    for e, view in zip(found, views):
        raw = raw_seconds(job.work_flops, view, job.gpus)
        model = fitted[e.provider_id]
        out.append(Timed(e, raw, model.seconds(raw), model.basis))
    return out


MIN_BUDGET_S = 10      # a budget must pay at least this much of every device at max_price
# A job is leased, or a paused one queued again, only while its hold covers at least this much
# of the lease (so no provider works unpaid between the broker's checks of running leases).
RESUME_FLOOR_S = 10


def floor_units(price_per_gpu_hour: float, devices: int) -> int:
    """Units of RESUME_FLOOR_S of a lease of ``devices`` at this price (at least 1)."""
    return max(1, -(-ledger.units(price_per_gpu_hour) * devices * RESUME_FLOOR_S // 3600))


def amount(needs: Needs, parts: int, candidates: list[Timed], budget: float
           ) -> tuple[int, str]:
    """(units to hold, what that rests on); InvalidArgument for a budget too small to pay
    for anything."""
    devices = needs.gpus * max(parts, 1)
    if budget > 0:
        floor = math.ceil(ledger.units(needs.max_price_per_gpu_hour) * devices * MIN_BUDGET_S
                          / 3600)
        if ledger.units(budget) < floor:
            raise InvalidArgument(f"budget: at least {ledger.fmt(floor)} credits ({MIN_BUDGET_S}"
                                  f" s of max_price x {devices} device"
                                  f"{'s' if devices > 1 else ''})")
        return ledger.units(budget), "the job's budget"
    if needs.work_flops > 0 and candidates:
        slowest = max(candidates[:CANDIDATES], key=lambda t: t.seconds)
        seconds = min(MAX_HOLD_S, max(MIN_HOLD_S, HOLD_MARGIN * slowest.seconds))
        why = (f"{seconds:.0f}s: {HOLD_MARGIN:g} x the {slowest.seconds:.0f}s estimated on the"
               f" slowest of the best {CANDIDATES} offers from {slowest.basis}, at least"
               f" {MIN_HOLD_S:.0f}s, at most {MAX_HOLD_S / 86400:.0f} days")
        if needs.max_runtime_s and needs.max_runtime_s < seconds:
            seconds, why = needs.max_runtime_s, f"its max_runtime of {needs.max_runtime_s}s"
    elif needs.max_runtime_s:
        seconds, why = needs.max_runtime_s, f"its max_runtime of {needs.max_runtime_s}s"
    else:
        seconds = DEFAULT_HOLD_S
        why = ("one hour: its work is not known ahead (set max_runtime or budget)"
               if needs.work_flops <= 0 else "one hour: no offer fits it now")
    # Checks the job asks for (verify) replay that share of its work, paid from its hold.
    extra = 1 + needs.verify_rate
    held = math.ceil(ledger.units(needs.max_price_per_gpu_hour) * devices * seconds * extra
                     / 3600)
    held = min(max(held, 1), ledger.units(MAX_CREDITS))
    checks = f", + {needs.verify_rate:.0%} for the checks it asks for" if needs.verify_rate else ""
    return held, (f"{why}, at max_price {needs.max_price_per_gpu_hour:g}/device-hour"
                  f" x {devices} device{'s' if devices > 1 else ''}{checks}")


def covers_lease(hold_left: int | None, price_per_gpu_hour: float, devices: int) -> bool:
    """Whether a hold with ``hold_left`` units left covers RESUME_FLOOR_S of a lease of
    ``devices`` at this price (None: the job does not enforce funds, so any lease is
    covered). A plain function: placement's plan reads ``hold_left`` with the queue."""
    return hold_left is None or hold_left >= floor_units(price_per_gpu_hour, devices)
