"""How far an offer's figures can be believed: what the broker can check of a provider's
claims without trusting it.

Each device's benchmark is compared with what its device class can do at most (the dense
tensor-core peak of a known GPU, a generous per-core bound for a CPU, a bound above any
single GPU for an unknown one), its memory with the class's largest, and a CPU device may
not carry a GPU's name. Then the offer's benchmark is compared with the speed its receipts
showed on real jobs. An offer's figures are ``measured`` (receipts back them), ``claimed``
(plausible, not yet backed) or ``contradicted`` (with the reason); the matcher never counts
a device faster than its class allows. No grpc here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

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


def check(offer: pb.Offer, achieved_flops: float, claimed_flops: float) -> Figures:
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
