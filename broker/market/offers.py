"""Signed offers as the matcher sees them: the provider's claims, corrected by what the broker
observed (reliability, throughput achieved on real jobs). No grpc here."""

from __future__ import annotations

import dataclasses

from gpumarket.broker.market import figures
from gpumarket.broker.market import reliability
from gpumarket.broker.market.matcher import OfferView
from gpumarket.proto import slices
from gpumarket.proto.errors import InvalidArgument
from gpumarket.proto.money import offer_prices
from gpumarket.proto.policy import Policy
from gpumarket.proto.v1 import types_pb2 as pb

# Share of the benchmark's dense-matmul FLOP/s a training job is assumed to reach until its
# receipts say otherwise.
CLAIM_EFFICIENCY = 0.35


def offer_price(offer: pb.Offer) -> float:
    """The price the matcher charges a standard (or serving) lease for any device of the
    offer: the highest of the offer's and its devices' own prices (never more than the
    provider asks for one of them)."""
    return offer_prices(offer)[0]


def interruptible_price(offer: pb.Offer) -> float:
    """The price an interruptible lease pays for any device of the offer
    (proto/money.offer_prices: the offer's interruptible share applied to ``offer_price``)."""
    return offer_prices(offer)[1]


def compute_capability(d: pb.Device) -> float:
    try:
        return float(d.compute_capability) if d.compute_capability else 0.0
    except ValueError:
        return 0.0


def claimed_flops(offer: pb.Offer, capped: bool = True) -> float:
    """The benchmark's headline matmul FLOP/s of the offer's slowest whole device (a slice
    is not measured: it has its share of its card's); ``capped``: no device counted faster
    than its kind can be (figures.device_bound)."""
    return min((min(d.benchmark.matmul_flops, figures.device_bound(d)) if capped
                else d.benchmark.matmul_flops for d in whole_devices(offer)), default=0.0)


def whole_devices(offer: pb.Offer) -> list[pb.Device]:
    """The offer's devices that are no slice of another."""
    return [d for d in offer.devices if not d.HasField("slice_of")]


def check_slices(offer: pb.Offer) -> None:
    """Raise InvalidArgument if the offer's slices break a rule (proto/slices.check_offer:
    at most MAX_SLICES of a card, shares in range summing to at most 1, a slice's card a
    whole device of the offer, no more memory than its share)."""
    try:
        slices.check_offer(offer.devices)
    except slices.SliceError as exc:
        raise InvalidArgument(str(exc)) from None


def cards(offer: pb.Offer) -> tuple[tuple[int, int | None], ...]:
    """(index, the card it is a slice of or None) of each device: () where none is a slice."""
    if not any(d.HasField("slice_of") for d in offer.devices):
        return ()
    return tuple((d.index, d.slice_of if d.HasField("slice_of") else None)
                 for d in offer.devices)


def free_devices(offer: pb.Offer, leased: set[int]) -> int:
    """How many of the offer's devices (slices counted) may be leased while ``leased`` are:
    a card with a slice leased is not free, nor are the slices of a card leased whole."""
    taken = slices.blocked(cards(offer), leased) if cards(offer) else leased
    return sum(1 for d in offer.devices if d.index not in taken)


def claim_efficiency(offers: list[pb.Offer], achieved: dict[str, float]) -> float:
    """The share of their claimed FLOP/s that providers with finished jobs really reached
    (median), to discount the claims of those without: CLAIM_EFFICIENCY until there is any."""
    ratios = sorted(achieved[o.provider_id] / claimed_flops(o) for o in offers
                    if o.provider_id in achieved and claimed_flops(o) > 0)
    if not ratios:
        return CLAIM_EFFICIENCY
    return ratios[len(ratios) // 2]


def offer_view(offer: pb.Offer, history: reliability.ProviderHistory, achieved_flops: float,
               busy: frozenset[int] = frozenset(), load: int = 0,
               efficiency: float = CLAIM_EFFICIENCY, stake: int = 0) -> OfferView:
    """The matcher's view of the offer's whole devices (``offer_views`` adds its slices)."""
    return offer_views(offer, history, achieved_flops, busy, load, efficiency, stake)[0]


def offer_views(offer: pb.Offer, history: reliability.ProviderHistory, achieved_flops: float,
                busy: frozenset[int] = frozenset(), load: int = 0,
                efficiency: float = CLAIM_EFFICIENCY, stake: int = 0) -> list[OfferView]:
    """The matcher's views of one offer: its whole devices first, then its slices, one
    view for each share (the matcher takes a view's devices as alike). A slice view is for
    jobs of one device; its memory is the slices', its speed its compute share of its
    card's, its prices its memory share of the card's (the provider's rule too:
    provider/offering.py). ``busy``: the devices leased; every view knows the offer's
    slices (``cards``), so a card with a slice leased is busy, and so are the slices of a
    card leased whole."""
    whole = whole_devices(offer)
    cuda = [d for d in whole if d.accelerator == pb.ACCELERATOR_CUDA]
    accel = pb.ACCELERATOR_CUDA if cuda else pb.ACCELERATOR_CPU
    claimed = claimed_flops(offer)
    base = OfferView(
        provider_id=offer.provider_id,
        price_per_gpu_hour=offer_price(offer),
        interruptible_price_per_gpu_hour=interruptible_price(offer),
        kinds=frozenset(offer.kinds),
        engines=frozenset(offer.engines),
        models=frozenset(offer.models),
        cached=frozenset(offer.cached),
        device_indices=tuple(d.index for d in whole),
        accelerator=accel,
        device_memory_bytes=min(d.memory_bytes for d in whole),
        compute_capability=min(compute_capability(d) for d in whole),
        gpu_name=whole[0].name if whole else "",
        flops=achieved_flops if achieved_flops > 0 else max(claimed * efficiency, 1e6),
        claimed_flops=claimed,
        stake=stake,
        reliability=reliability.score(history),
        mtbf_s=reliability.mtbf_s(history),
        policy=Policy.from_message(offer.policy),
        busy=busy,
        load=load,
        cards=cards(offer),
    )
    views = [base]
    groups: dict[tuple[float, float], list[pb.Device]] = {}
    for d in offer.devices:
        if d.HasField("slice_of"):
            groups.setdefault((d.memory_share, d.compute_share), []).append(d)
    for (memory, compute), group in sorted(groups.items(), reverse=True):
        views.append(dataclasses.replace(
            base,
            price_per_gpu_hour=base.price_per_gpu_hour * memory,
            interruptible_price_per_gpu_hour=base.interruptible_price_per_gpu_hour * memory,
            device_indices=tuple(d.index for d in group),
            device_memory_bytes=min(d.memory_bytes for d in group),
            compute_capability=min(compute_capability(d) for d in group),
            flops=max(base.flops * compute, 1e6),
            claimed_flops=claimed * compute,
            slices=True))
    return views
