"""First-fit matching on hard constraints. Plain code: no grpc, no database.

A job fits an offer when the offer's provider has ``gpus`` free devices of the
asked accelerator with at least ``min_memory_bytes`` each, runs the job's kind,
and asks no more than the job's maximum price.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from gpumarket.proto.v1 import types_pb2 as pb


@dataclass(frozen=True)
class DeviceSlot:
    index: int
    accelerator: int
    memory_bytes: int


@dataclass(frozen=True)
class OfferView:
    """What the matcher needs to know of one live offer."""

    provider_id: str
    price_per_gpu_hour: float
    kinds: frozenset[int]
    devices: tuple[DeviceSlot, ...]
    busy: frozenset[int] = frozenset()   # device indices held by active leases


@dataclass(frozen=True)
class JobNeeds:
    job_id: str
    kind: int
    gpus: int
    min_memory_bytes: int
    accelerator: int                     # ACCELERATOR_UNSPECIFIED = any
    max_price_per_gpu_hour: float


@dataclass(frozen=True)
class Placement:
    provider_id: str
    device_indices: tuple[int, ...]
    price_per_gpu_hour: float


def _suitable(job: JobNeeds, device: DeviceSlot) -> bool:
    if job.accelerator != pb.ACCELERATOR_UNSPECIFIED and device.accelerator != job.accelerator:
        return False
    return device.memory_bytes >= job.min_memory_bytes


def exclusion(job: JobNeeds, offer: OfferView) -> str | None:
    """Return the first hard constraint ``offer`` fails for ``job`` (None if it fits).

    Constraints that can never be met by this provider come before "busy", so the
    reasons shown to a client tell a wait apart from an impossible ask.
    """
    if job.kind not in offer.kinds:
        return "kind"
    if offer.price_per_gpu_hour > job.max_price_per_gpu_hour:
        return "price"
    if len(offer.devices) < job.gpus:
        return "gpus"
    if not any(
        job.accelerator in (pb.ACCELERATOR_UNSPECIFIED, d.accelerator) for d in offer.devices
    ):
        return "accelerator"
    suitable = [d for d in offer.devices if _suitable(job, d)]
    if len(suitable) < job.gpus:
        return "memory"
    if sum(1 for d in suitable if d.index not in offer.busy) < job.gpus:
        return "busy"
    return None


def place(job: JobNeeds, offer: OfferView) -> Placement:
    """Pick the job's devices on an offer it fits (smallest suitable devices first)."""
    free = sorted(
        (d for d in offer.devices if d.index not in offer.busy and _suitable(job, d)),
        key=lambda d: (d.memory_bytes, d.index),
    )
    chosen = tuple(sorted(d.index for d in free[: job.gpus]))
    return Placement(offer.provider_id, chosen, offer.price_per_gpu_hour)


def first_fit(job: JobNeeds, offers: Iterable[OfferView]) -> tuple[Placement | None, Counter]:
    """Return the first offer the job fits, or None and how many offers each constraint excluded."""
    excluded: Counter = Counter()
    for offer in offers:
        reason = exclusion(job, offer)
        if reason is None:
            return place(job, offer), excluded
        excluded[reason] += 1
    return None, excluded


REASON_TEXT = {
    "kind": "do not run this job kind",
    "price": "ask more than max_price_per_gpu_hour",
    "gpus": "have fewer devices than asked",
    "accelerator": "have no device of the asked accelerator",
    "memory": "have too few devices with enough memory",
    "busy": "are busy with other jobs",
}


def explain(excluded: Counter, total: int) -> str:
    """One line saying why no offer was chosen."""
    if total == 0:
        return "waiting: no provider is online"
    parts = [f"{n} {REASON_TEXT[r]}" for r, n in excluded.most_common()]
    return f"waiting: of {total} offers, " + "; ".join(parts)
