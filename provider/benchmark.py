"""A short speed measurement of each device, cached per device and driver.

Figures: dense matmul FLOP/s (fp32 on the CPU, bf16 on CUDA devices that have it)
and device memory bandwidth from a large tensor copy. Torch is imported here only.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from gpumarket.proto.artifacts import write_atomically
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider.inventory import DeviceInfo

log = logging.getLogger(__name__)
CACHE_VERSION = 1


def _timed(fn, repeat: int, sync) -> float:
    fn()  # warm up
    sync()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    return (time.perf_counter() - start) / repeat


def measure(device: DeviceInfo) -> pb.Benchmark:
    """Measure one device; takes about a second on a CPU."""
    import torch

    if device.is_cuda:
        dev = torch.device("cuda", device.index)
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        n, copy_bytes = 8192, 1 << 30
        sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
    else:
        dev = torch.device("cpu")
        dtype = torch.float32
        n, copy_bytes = 1024, 1 << 27
        sync = lambda: None  # noqa: E731
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    seconds = _timed(lambda: torch.mm(a, b), 5, sync)
    flops = 2 * n**3 / seconds
    src = torch.empty(copy_bytes // 4, device=dev, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), 5, sync)
    bandwidth = 2 * copy_bytes / seconds  # read + write
    return pb.Benchmark(matmul_flops=flops, matmul_dtype=str(dtype).removeprefix("torch."),
                        memory_bandwidth_bytes_per_s=bandwidth, measured_at_ms=now_ms())


def _key(device: DeviceInfo) -> str:
    import torch

    return f"{device.uuid}|{device.name}|{device.driver_version}|torch {torch.__version__}"


def cached_benchmarks(devices: list[DeviceInfo], cache: Path, *,
                      refresh: bool = False) -> dict[int, pb.Benchmark]:
    """Return each device's figures, measuring those not cached for this device and driver."""
    try:
        saved = json.loads(cache.read_text()) if cache.exists() and not refresh else {}
    except (OSError, ValueError):
        saved = {}
    if saved.get("version") != CACHE_VERSION:
        saved = {"version": CACHE_VERSION, "devices": {}}
    out, changed = {}, False
    for device in devices:
        key = _key(device)
        entry = saved["devices"].get(key)
        if entry is None:
            log.info("measuring %s (%s)", device.name, device.uuid)
            bench = measure(device)
            entry = {"matmul_flops": bench.matmul_flops, "matmul_dtype": bench.matmul_dtype,
                     "memory_bandwidth_bytes_per_s": bench.memory_bandwidth_bytes_per_s,
                     "measured_at_ms": bench.measured_at_ms}
            saved["devices"][key] = entry
            changed = True
        out[device.index] = pb.Benchmark(**entry)
    if changed:
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(cache, json.dumps(saved, indent=2).encode())
    return out
