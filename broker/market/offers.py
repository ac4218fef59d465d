"""Signed offers as the matcher sees them: the provider's claims, corrected by what the broker
observed (reliability, throughput achieved on real jobs). No grpc here."""

from __future__ import annotations

from gpumarket.broker.market import figures
from gpumarket.broker.market import reliability
from gpumarket.broker.market.matcher import OfferView
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
    """The benchmark's headline matmul FLOP/s of the offer's slowest device; ``capped``:
    no device counted faster than its kind can be (figures.device_bound)."""
    return min((min(d.benchmark.matmul_flops, figures.device_bound(d)) if capped
                else d.benchmark.matmul_flops for d in offer.devices), default=0.0)


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
    devices = list(offer.devices)
    cuda = [d for d in devices if d.accelerator == pb.ACCELERATOR_CUDA]
    accel = pb.ACCELERATOR_CUDA if cuda else pb.ACCELERATOR_CPU
    claimed = claimed_flops(offer) * efficiency
    return OfferView(
        provider_id=offer.provider_id,
        price_per_gpu_hour=offer_price(offer),
        interruptible_price_per_gpu_hour=interruptible_price(offer),
        kinds=frozenset(offer.kinds),
        engines=frozenset(offer.engines),
        models=frozenset(offer.models),
        cached=frozenset(offer.cached),
        device_indices=tuple(d.index for d in devices),
        accelerator=accel,
        device_memory_bytes=min(d.memory_bytes for d in devices),
        compute_capability=min(compute_capability(d) for d in devices),
        gpu_name=devices[0].name if devices else "",
        flops=achieved_flops if achieved_flops > 0 else max(claimed, 1e6),
        claimed_flops=claimed_flops(offer),
        stake=stake,
        reliability=reliability.score(history),
        mtbf_s=reliability.mtbf_s(history),
        policy=Policy.from_message(offer.policy),
        busy=busy,
        load=load,
    )
