"""Signed offers as the matcher sees them: the provider's claims, corrected by what the broker
observed (reliability, throughput achieved on real jobs), and judged against what their
devices can do at all. No grpc here.

How far an offer's figures can be believed (``check_figures``): each device's benchmark is
compared with what its device class can do at most (the dense tensor-core peak of a known
GPU, a generous per-core bound for a CPU, a bound above any single GPU for an unknown one),
its memory with the class's largest, and a CPU device may not carry a GPU's name. Then the
offer's benchmark is compared with the speed its receipts showed on real jobs. An offer's
figures are ``measured`` (receipts back them), ``claimed`` (plausible, not yet backed) or
``contradicted`` (with the reason); the matcher never counts a device faster than its class
allows (``device_bound``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from functools import lru_cache

from gpumarket.broker.market import reliability
from gpumarket.broker.market.matcher import OfferView
from gpumarket.proto import slices
from gpumarket.proto.errors import InvalidArgument
from gpumarket.proto.money import offer_prices
from gpumarket.proto.policy import Policy
from gpumarket.proto.v1 import types_pb2 as pb

MARGIN = 1.15                # measurement noise and boost clocks above the datasheet peak
RECEIPTS_FLOOR = 0.01        # receipts below this share of the claim contradict it
UNKNOWN_GPU_FLOPS = 2.5e15   # above any single GPU's dense peak
CPU_CORE_FLOPS = {"fp32": 0.4e12, "tf32": 0.4e12}   # AVX-512, 2 FMA units, 5 GHz, generous
CPU_CORE_FLOPS_LOW_PRECISION = 4e12                  # bf16/fp16/int8 matrix units (AMX)
CPU_CORES_UNKNOWN = 512

# Dense bf16/fp16 tensor peak (FLOP/s, no sparsity) and the most memory of each class (GiB),
# from the vendors' datasheets; the longest matching name wins.
GPU_CLASSES = {
    "B200": (2.25e15, 192), "B100": (1.75e15, 192), "GB200": (2.5e15, 192),
    "H200": (989e12, 141), "GH200": (989e12, 144), "H100": (989e12, 96), "H800": (989e12, 80),
    "H20": (148e12, 96), "A100": (312e12, 80), "A800": (312e12, 80), "A40": (150e12, 48),
    "A30": (165e12, 24), "A10G": (125e12, 24), "A10": (125e12, 24), "L40S": (362e12, 48),
    "L40": (181e12, 48), "L20": (119.5e12, 48), "L4": (121e12, 24), "T4": (65e12, 16),
    "V100": (125e12, 32), "P100": (21.2e12, 16), "RTX 6000 ADA": (364e12, 48),
    "RTX A6000": (155e12, 48), "RTX A5000": (111e12, 24), "RTX 5090": (419e12, 32),
    "RTX 4090": (330e12, 24), "RTX 4080": (195e12, 16), "RTX 3090": (142e12, 24),
    "RTX 3080": (119e12, 12), "TITAN RTX": (130e12, 24),
}
_BY_LENGTH = sorted(GPU_CLASSES, key=len, reverse=True)


def _norm(name: str) -> str:
    return re.sub(r"\s+", " ", name.upper())


@lru_cache(maxsize=4096)      # every placement pass asks it of every offered device
def gpu_class(name: str) -> str | None:
    """The known GPU class a device name names, if any (as a whole word)."""
    text = _norm(name)
    for cls in _BY_LENGTH:
        if re.search(rf"(?<![A-Z0-9]){re.escape(cls)}(?![A-Z0-9])", text):
            return cls
    return None


def device_bound(d: pb.Device) -> float:
    """The most matmul FLOP/s a device of this kind can reach, by what the broker knows."""
    if d.accelerator == pb.ACCELERATOR_CPU:
        cores = d.cpu_cores or CPU_CORES_UNKNOWN
        per_core = CPU_CORE_FLOPS.get(d.benchmark.matmul_dtype, CPU_CORE_FLOPS_LOW_PRECISION)
        return cores * per_core * MARGIN
    cls = gpu_class(d.name)
    return (GPU_CLASSES[cls][0] if cls else UNKNOWN_GPU_FLOPS) * MARGIN


def device_problem(d: pb.Device) -> str:
    """Why this device's figures cannot be right, or ""."""
    label = f"device {d.index} ({d.name or 'unnamed'})"
    if d.accelerator == pb.ACCELERATOR_CPU and gpu_class(d.name):
        return f"{label} is offered as a CPU but named like a {gpu_class(d.name)} GPU"
    bound = device_bound(d)
    if d.benchmark.matmul_flops > bound:
        return (f"{label} claims {d.benchmark.matmul_flops / 1e12:,.1f} TFLOP/s, more than"
                f" its kind can reach ({bound / 1e12:,.1f})")
    cls = gpu_class(d.name) if d.accelerator == pb.ACCELERATOR_CUDA else None
    if cls and d.memory_bytes > GPU_CLASSES[cls][1] * 2**30 * 1.05:
        return (f"{label} claims {d.memory_bytes / 2**30:,.0f} GiB, more than any {cls}"
                f" has ({GPU_CLASSES[cls][1]} GiB)")
    return ""


@dataclass(frozen=True)
class Figures:
    status: int              # pb.OFFER_FIGURES_*
    detail: str


def check_figures(offer: pb.Offer, achieved_flops: float, claimed_flops: float
                  ) -> Figures:
    """Judge an offer's figures: its devices against their kinds, its claimed speed
    (slowest device, FLOP/s) against what its receipts achieved (0 = none yet)."""
    for d in offer.devices:
        problem = device_problem(d)
        if problem:
            return Figures(pb.OFFER_FIGURES_CONTRADICTED, problem)
    if achieved_flops > 0:
        if claimed_flops > 0 and achieved_flops < claimed_flops * RECEIPTS_FLOOR:
            return Figures(pb.OFFER_FIGURES_CONTRADICTED,
                           f"its jobs ran at {achieved_flops / 1e12:.3g} TFLOP/s a device,"
                           f" under {RECEIPTS_FLOOR:.0%} of the"
                           f" {claimed_flops / 1e12:.3g} its benchmark claims")
        return Figures(pb.OFFER_FIGURES_MEASURED,
                       f"its jobs ran at {achieved_flops / 1e12:.3g} TFLOP/s a device")
    return Figures(pb.OFFER_FIGURES_CLAIMED, "benchmark as the provider sent it, within what"
                   " its devices can reach; no receipts yet")


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
    than its kind can be (device_bound)."""
    return min((min(d.benchmark.matmul_flops, device_bound(d)) if capped
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
    return views_of(offer_template(offer), history, achieved_flops, busy, load, efficiency,
                    stake)


@dataclass(frozen=True)
class Template:
    """What an offer's views take from the signed offer alone (devices, prices, kinds,
    policy, slices): most of the cost of ``offer_views``, and unchanged until the provider
    advertises again, so a placement pass over 10,000 offers keeps it (``KeptOffers``)
    and adds only what the broker observed since."""

    base: OfferView             # the whole devices' view, observed figures at their defaults
    claimed: float              # claimed_flops(offer)
    # One entry a slice share, in the views' order: (memory share, compute share, device
    # indices, smallest memory, smallest compute capability).
    shares: tuple[tuple[float, float, tuple[int, ...], int, float], ...]

    @functools.cached_property
    def fields(self) -> dict[str, object]:
        """``base``'s fields that the offer decides, as keywords of OfferView (a view made
        from them costs a third of a ``dataclasses.replace``: 10,000 of them a pass)."""
        return {f.name: getattr(self.base, f.name) for f in dataclasses.fields(OfferView)
                if f.name not in OBSERVED}


# The fields of an OfferView that the broker's observations set (``views_of``).
OBSERVED = frozenset({"flops", "claimed_flops", "stake", "reliability", "mtbf_s", "busy",
                      "load"})


def offer_template(offer: pb.Offer) -> Template:
    """The part of ``offer_views`` that depends on the offer only."""
    whole = whole_devices(offer)
    cuda = [d for d in whole if d.accelerator == pb.ACCELERATOR_CUDA]
    standard, interruptible = offer_prices(offer)
    base = OfferView(
        provider_id=offer.provider_id,
        price_per_gpu_hour=standard,
        interruptible_price_per_gpu_hour=interruptible,
        kinds=frozenset(offer.kinds),
        engines=frozenset(offer.engines),
        models=frozenset(offer.models),
        cached=frozenset(offer.cached),
        device_indices=tuple(d.index for d in whole),
        accelerator=pb.ACCELERATOR_CUDA if cuda else pb.ACCELERATOR_CPU,
        device_memory_bytes=min(d.memory_bytes for d in whole),
        compute_capability=min(compute_capability(d) for d in whole),
        gpu_name=whole[0].name if whole else "",
        policy=Policy.from_message(offer.policy),
        cards=cards(offer),
    )
    groups: dict[tuple[float, float], list[pb.Device]] = {}
    for d in offer.devices:
        if d.HasField("slice_of"):
            groups.setdefault((d.memory_share, d.compute_share), []).append(d)
    shares = tuple((memory, compute, tuple(d.index for d in group),
                    min(d.memory_bytes for d in group),
                    min(compute_capability(d) for d in group))
                   for (memory, compute), group in sorted(groups.items(), reverse=True))
    return Template(base, claimed_flops(offer), shares)


def views_of(template: Template, history: reliability.ProviderHistory,
             achieved_flops: float, busy: frozenset[int] = frozenset(), load: int = 0,
             efficiency: float = CLAIM_EFFICIENCY, stake: int = 0) -> list[OfferView]:
    """``offer_views`` of the offer ``template`` was made from, given what the broker
    observed of its provider."""
    claimed = template.claimed
    base = OfferView(
        **template.fields,
        flops=achieved_flops if achieved_flops > 0 else max(claimed * efficiency, 1e6),
        claimed_flops=claimed,
        stake=stake,
        reliability=reliability.score(history),
        mtbf_s=reliability.mtbf_s(history),
        busy=busy,
        load=load)
    views = [base]
    for memory, compute, indices, memory_bytes, capability in template.shares:
        views.append(dataclasses.replace(
            base,
            price_per_gpu_hour=base.price_per_gpu_hour * memory,
            interruptible_price_per_gpu_hour=base.interruptible_price_per_gpu_hour * memory,
            device_indices=indices,
            device_memory_bytes=memory_bytes,
            compute_capability=capability,
            flops=max(base.flops * compute, 1e6),
            claimed_flops=claimed * compute,
            slices=True))
    return views


class KeptOffers:
    """Each live offer's ``Template``, kept between placement passes and made again only
    for an offer that is new or changed (a provider that connected or advertised again),
    and its views with what the broker had observed when they were made, made again only
    where that changed (the same view objects otherwise: market/kept_book.KeptBook patches
    the Book's rows of the others); an offer gone (its session closed) is forgotten at the
    next pass. So the views are always those ``offer_views`` would make now."""

    def __init__(self) -> None:
        self._by_provider: dict[str, tuple[pb.Offer, Template]] = {}
        # provider: (template, history, achieved, busy, load, efficiency, stake, its views)
        self._views: dict[str, tuple] = {}

    def template(self, offer: pb.Offer) -> Template:
        """``offer``'s Template: the kept one where the offer is the one it was made from
        (the same message, or an equal one: a remote offer read again), else a new one."""
        kept = self._by_provider.get(offer.provider_id)
        if kept is not None and (kept[0] is offer or kept[0] == offer):
            return kept[1]
        made = offer_template(offer)
        self._by_provider[offer.provider_id] = (offer, made)
        return made

    def views(self, offers: list[pb.Offer],
              histories: dict[str, reliability.ProviderHistory],
              achieved: dict[str, float], busy: dict[str, set[int]],
              loads: dict[str, int], efficiency: float,
              stakes: dict[str, int]) -> list[OfferView]:
        """The views of ``offers`` (``offer_views`` of each, in order), forgetting the
        Templates of offers no longer among them."""
        out: list[OfferView] = []
        kept_views = self._views
        none: frozenset[int] = frozenset()
        for o in offers:
            p = o.provider_id
            t = self.template(o)
            h, a, b = histories[p], achieved.get(p, 0.0), busy.get(p, none)
            load, stake = loads.get(p, 0), stakes.get(p, 0)
            kept = kept_views.get(p)
            if kept is None or kept[0] is not t or (kept[1] is not h and kept[1] != h) \
                    or kept[2] != a or kept[3] != b or kept[4] != load \
                    or kept[5] != efficiency or kept[6] != stake:
                b = frozenset(b)
                kept = kept_views[p] = (t, h, a, b, load, efficiency, stake,
                                        views_of(t, h, a, b, load, efficiency, stake))
            out.extend(kept[7])
        if len(self._by_provider) > len(offers) or len(kept_views) > len(offers):
            live = {o.provider_id for o in offers}
            for gone in [p for p in self._by_provider if p not in live]:
                del self._by_provider[gone]
            for gone in [p for p in kept_views if p not in live]:
                del kept_views[gone]
        return out

    def __len__(self) -> int:
        return len(self._by_provider)
