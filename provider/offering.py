"""What a provider sells, as the signed Offer its daemon sends at each session start and
whenever its cache changes."""

from __future__ import annotations

from pathlib import Path

from gpumarket import kinds
from gpumarket.proto import __version__
from gpumarket.proto.envelope import seal
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider.config import ProviderConfig
from gpumarket.provider.inventory import DeviceInfo, local_models

CACHED_LISTED = 256
LIMIT_METHODS = {"none": pb.LIMIT_METHOD_NONE, "cgroup v2": pb.LIMIT_METHOD_CGROUP_V2,
                 "cgroup v1": pb.LIMIT_METHOD_CGROUP_V1, "rlimit": pb.LIMIT_METHOD_RLIMIT}


def runnable_kinds(config: ProviderConfig, engines: frozenset[str]) -> set[int]:
    """The kinds this provider runs: those its operator allows (every kind it knows by
    default, but kinds that run the client's own code only where named), less those
    needing an engine this host lacks (render needs Cycles)."""
    return {k.number for k in kinds.all_kinds()
            if (k.number in config.kinds or not config.kinds and not k.opt_in)
            and (not k.provider_engine or k.provider_engine in engines)}


def build_offer(config: ProviderConfig, identity: Identity, devices: list[DeviceInfo],
                benchmarks: dict[int, pb.Benchmark], kinds: set[int],
                engines: frozenset[str], runs_code: bool | None = None,
                limits: dict[str, str] | None = None) -> pb.Envelope:
    """The signed offer. ``runs_code`` (default: the policy's allow_remote_code) says
    whether jobs' own code is accepted here: off where the host cannot isolate it;
    ``limits`` (Isolation.job_limits) how its jobs' memory, processes and CPU are limited."""
    messages = []
    for d in devices:
        m = d.message(benchmarks.get(d.index))
        m.price_per_hour = config.device_prices.get(d.index, 0.0)
        if d.is_slice:
            # A slice sells for its share of its card's price (the broker charges it so:
            # broker/market/offers.py); its compute share is held by MPS on CUDA, by the
            # job's CPU quota on the CPU.
            card = config.device_prices.get(d.slice_of, config.price_per_gpu_hour)
            m.price_per_hour = round(card * d.share, 6)
            m.compute_held = d.mps if d.is_cuda else \
                (limits or {}).get("cpu", "none") != "none"
        messages.append(m)
    offer = pb.Offer(
        provider_id=identity.id,
        devices=messages,
        price_per_gpu_hour=config.price_per_gpu_hour,
        interruptible_price_per_gpu_hour=config.interruptible_price,
        kinds=sorted(kinds),
        engines=sorted(engines),
        models=sorted(local_models(config.models_dir)),
        cached=cached_artifacts(config.cache_dir),
        software_version=__version__,
        created_at_ms=now_ms(),
        policy=config.policy.message(),
    )
    if runs_code is not None:
        offer.policy.allow_remote_code = runs_code and config.policy.allow_remote_code
    if limits is not None:
        offer.job_limits.CopyFrom(limits_message(limits))
    return seal(identity, offer)


def limits_message(limits: dict[str, str]) -> pb.JobLimits:
    """{"memory", "pids", "cpu"} -> how (cgroups.job_limits) as the offer says it."""
    return pb.JobLimits(**{resource: LIMIT_METHODS[limits.get(resource, "none")]
                           for resource in ("memory", "pids", "cpu")})


def cached_artifacts(cache_dir: Path, limit: int = CACHED_LISTED) -> list[str]:
    """The artifacts this provider has cached, newest first: jobs whose model is among them
    start without a download, so the matcher prefers this provider for them."""
    if not cache_dir.is_dir():
        return []
    files = [(p.stat().st_mtime, p.name) for p in cache_dir.iterdir() if len(p.name) == 64]
    return [name for _, name in sorted(files, reverse=True)[:limit]]
