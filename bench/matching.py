"""Matching benchmark: 10,000 synthetic offers with realistic spreads of GPUs, prices and
reliabilities; 100,000 jobs placed one at a time (jobs end as others arrive, so the market
stays about 70 % busy). Prints placements per second on one core and the p50/p99 decision
latency, next to a naive baseline (filter + sort by price, in plain Python) measured in the
same run. The last line is one JSON object.

    .venv/bin/python bench/matching.py [--offers 10000] [--jobs 100000] [--baseline-jobs 3000]
"""

from __future__ import annotations

import os

# One core, as the target says: pin before numpy starts its thread pools.
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from gpumarket.broker.market.matcher import OBJECTIVES, Book, JobNeeds, OfferView  # noqa: E402
from gpumarket.proto.policy import Policy, Window  # noqa: E402
from gpumarket.proto.v1 import types_pb2 as pb  # noqa: E402

GiB = 2**30
# name, GiB, compute capability, dense bf16 TFLOP/s, typical price per GPU-hour
GPUS = [
    ("NVIDIA H200", 141, 9.0, 990, 3.2), ("NVIDIA H100 80GB HBM3", 80, 9.0, 990, 2.4),
    ("NVIDIA A100-SXM4-80GB", 80, 8.0, 312, 1.5), ("NVIDIA A100-PCIE-40GB", 40, 8.0, 312, 1.1),
    ("NVIDIA L40S", 48, 8.9, 362, 0.9), ("NVIDIA RTX 6000 Ada", 48, 8.9, 364, 0.8),
    ("NVIDIA GeForce RTX 4090", 24, 8.9, 165, 0.4), ("NVIDIA GeForce RTX 3090", 24, 8.6, 71, 0.22),
    ("NVIDIA A10", 24, 8.6, 125, 0.55), ("Tesla V100-SXM2-32GB", 32, 7.0, 125, 0.45),
]
GPU_WEIGHTS = [2, 8, 8, 6, 6, 4, 25, 20, 8, 5]


def make_offers(n: int, rng: random.Random, now: datetime) -> list[OfferView]:
    offers = []
    for i in range(n):
        name, mem, cc, tflops, price = rng.choices(GPUS, GPU_WEIGHTS)[0]
        count = rng.choices([1, 2, 4, 8], [50, 25, 15, 10])[0]
        policy = Policy()
        r = rng.random()
        if r < 0.05:
            policy = Policy(denied_clients=frozenset({f"client-{rng.randrange(50)}"}))
        elif r < 0.15:
            start = rng.randrange(0, 24) * 60
            policy = Policy(windows=(Window(frozenset(range(7)), start, (start + 12 * 60) % 1440),))
        elif r < 0.25:
            policy = Policy(max_job_s=rng.choice([3600, 6 * 3600, 24 * 3600]))
        offers.append(OfferView(
            provider_id=f"provider-{i}",
            price_per_gpu_hour=round(price * rng.lognormvariate(0, 0.3), 3),
            kinds=frozenset({pb.JOB_KIND_TRAINING} | ({pb.JOB_KIND_GENERATE}
                                                      if rng.random() < 0.6 else set())),
            device_indices=tuple(range(count)),
            accelerator=pb.ACCELERATOR_CUDA,
            device_memory_bytes=mem * GiB,
            compute_capability=cc,
            gpu_name=name,
            flops=tflops * 1e12 * rng.uniform(0.25, 0.45),
            reliability=rng.betavariate(8, 2),
            mtbf_s=3600 * rng.lognormvariate(3.5, 1.0),
            policy=policy,
        ))
    return offers


def make_jobs(n: int, rng: random.Random) -> list[JobNeeds]:
    jobs = []
    for i in range(n):
        gpus = rng.choices([1, 2, 4, 8], [60, 20, 12, 8])[0]
        objective = rng.choices(OBJECTIVES, [50, 25, 15, 10])[0]
        work = 10 ** rng.uniform(15, 19)
        jobs.append(JobNeeds(
            job_id=f"job-{i}", kind=rng.choices([pb.JOB_KIND_TRAINING, pb.JOB_KIND_GENERATE],
                                                [70, 30])[0],
            gpus=gpus, min_memory_bytes=rng.choice([8, 16, 24, 40, 80]) * GiB,
            accelerator=rng.choice([pb.ACCELERATOR_UNSPECIFIED, pb.ACCELERATOR_CUDA]),
            max_price_per_gpu_hour=rng.choice([0.5, 1.0, 2.0, 3.0, 5.0]),
            client_id=f"client-{rng.randrange(50)}",
            min_compute_capability=rng.choice([0.0, 0.0, 8.0]),
            min_reliability=rng.choice([0.0, 0.0, 0.8, 0.9]),
            work_flops=work, objective=objective,
            deadline_s=rng.choice([3600, 6 * 3600, 24 * 3600]),
        ))
    return jobs


def naive_place(job: JobNeeds, offers: list[OfferView], free: list[int]) -> int | None:
    """The baseline: filter on the hard constraints, sort by price, take the first."""
    feasible = [i for i, o in enumerate(offers)
                if job.kind in o.kinds and o.price_per_gpu_hour <= job.max_price_per_gpu_hour
                and free[i] >= job.gpus and o.device_memory_bytes >= job.min_memory_bytes
                and o.compute_capability >= job.min_compute_capability
                and o.reliability >= job.min_reliability and o.policy.accepts(job.client_id)]
    feasible.sort(key=lambda i: offers[i].price_per_gpu_hour)
    return feasible[0] if feasible else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--offers", type=int, default=10_000)
    ap.add_argument("--jobs", type=int, default=100_000)
    ap.add_argument("--baseline-jobs", type=int, default=3_000)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    rng = random.Random(args.seed)
    now = datetime(2026, 11, 23, 15, 0, tzinfo=timezone.utc)
    offers = make_offers(args.offers, rng, now)
    jobs = make_jobs(args.jobs, rng)
    devices = sum(len(o.device_indices) for o in offers)
    print(f"{len(offers)} offers, {devices} devices; placing {len(jobs)} jobs")

    built = time.perf_counter()
    book = Book(offers, now)
    build_s = time.perf_counter() - built
    active: list[tuple[int, tuple[int, ...], int]] = []
    busy_devices = 0
    latencies = np.empty(len(jobs))
    placed = queued = 0
    t0 = time.perf_counter()
    for k, job in enumerate(jobs):
        # jobs end as new ones arrive: keep the market about 70 % busy
        while busy_devices > 0.7 * devices:
            i, devs, n = active.pop(rng.randrange(len(active)))
            book.release(i, devs)
            busy_devices -= n
        s = time.perf_counter_ns()
        placement, _ = book.place(job)
        latencies[k] = time.perf_counter_ns() - s
        if placement is None:
            queued += 1
            continue
        placed += 1
        i = book.index[placement.provider_id]
        active.append((i, placement.device_indices, job.gpus))
        busy_devices += job.gpus
    elapsed = time.perf_counter() - t0
    rate = len(jobs) / elapsed
    p50, p99 = np.percentile(latencies, [50, 99]) / 1e6
    print(f"matcher: {rate:,.0f} decisions/s ({placed} placed, {queued} left queued), "
          f"p50 {p50:.3f} ms, p99 {p99:.3f} ms; book built in {build_s * 1000:.0f} ms")

    free = [len(o.device_indices) for o in offers]
    base_active: list[tuple[int, int]] = []
    base_busy = 0
    base_lat = np.empty(args.baseline_jobs)
    t0 = time.perf_counter()
    for k, job in enumerate(jobs[: args.baseline_jobs]):
        while base_busy > 0.7 * devices:
            i, n = base_active.pop(rng.randrange(len(base_active)))
            free[i] += n
            base_busy -= n
        s = time.perf_counter_ns()
        i = naive_place(job, offers, free)
        base_lat[k] = time.perf_counter_ns() - s
        if i is not None:
            free[i] -= job.gpus
            base_active.append((i, job.gpus))
            base_busy += job.gpus
    base_elapsed = time.perf_counter() - t0
    base_rate = args.baseline_jobs / base_elapsed
    b50, b99 = np.percentile(base_lat, [50, 99]) / 1e6
    print(f"baseline (filter + sort by price, plain Python): {base_rate:,.0f} decisions/s over "
          f"{args.baseline_jobs} jobs, p50 {b50:.3f} ms, p99 {b99:.3f} ms")
    print(f"ratio: {rate / base_rate:.1f}x the baseline's rate")
    print(json.dumps({
        "placements_per_s": round(rate), "p50_ms": round(p50, 4), "p99_ms": round(p99, 4),
        "placed": placed, "queued": queued,
        "baseline_placements_per_s": round(base_rate), "baseline_p50_ms": round(b50, 4),
        "baseline_p99_ms": round(b99, 4), "ratio": round(rate / base_rate, 2),
        "offers": len(offers), "jobs": len(jobs),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
