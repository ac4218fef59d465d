"""Device speed, measured: dense matmul throughput per dtype the device supports (fp32, tf32,
bf16, fp16, fp8 where present), device memory bandwidth, host-to-device bandwidth, and for CUDA
devices the SM count and the link (PCIe generation and width, NVLink). Results are cached per
device, driver and torch version, and measured again when any of them changes.
Torch is imported here only.
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
CACHE_VERSION = 2
# On a GPU each figure is timed over 20 repeats after a quarter second of the same op: five
# repeats of an 8192 bf16 matmul last ~7 ms on an H100, less than a GPU idling at a few
# hundred MHz takes to raise its clocks (not yet measured on one: make gpu-check's benchmark
# check compares these figures with a longer measurement of its own).
GPU_REPEAT, GPU_WARM_S = 20, 0.25


def _timed(fn, repeat: int, sync, warm_s: float = 0.0) -> float:
    fn()  # warm up
    sync()
    began = time.perf_counter()
    while time.perf_counter() - began < warm_s:   # a GPU raises its clocks under load
        fn()
        sync()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    return (time.perf_counter() - start) / repeat


def _matmul_flops(torch, dev, dtype, n: int, sync, repeat: int = 5, warm_s: float = 0.0
                  ) -> float:
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    return 2 * n**3 / _timed(lambda: torch.mm(a, b), repeat, sync, warm_s)


def _fp8_flops(torch, dev, n: int, sync) -> float:
    """FP8 (e4m3) dense matmul through torch._scaled_mm (Hopper/Ada and later)."""
    a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0, device=dev)
    fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
    return 2 * n**3 / _timed(fn, GPU_REPEAT, sync, GPU_WARM_S)


def _link(index: int) -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            gen = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)
            width = pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)
            links = 0
            for link in range(18):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, link):
                        links += 1
                except pynvml.NVMLError:
                    break
            text = f"PCIe gen{gen} x{width}"
            return f"{text}, NVLink x{links}" if links else text
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML is optional for the figures; the benchmark must not fail on it
        return ""


def measure(device: DeviceInfo) -> pb.Benchmark:
    """Measure one device (a few seconds on a CPU, under a minute on a GPU)."""
    import torch

    figures: dict[str, float] = {}
    h2d = 0.0
    sm_count, link = 0, ""
    if device.is_cuda:
        dev = torch.device("cuda", device.index)
        sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
        props = torch.cuda.get_device_properties(dev)
        sm_count = props.multi_processor_count
        n = 8192
        torch.backends.cuda.matmul.allow_tf32 = False
        gpu = {"repeat": GPU_REPEAT, "warm_s": GPU_WARM_S}
        figures["fp32"] = _matmul_flops(torch, dev, torch.float32, n, sync, **gpu)
        torch.backends.cuda.matmul.allow_tf32 = True
        figures["tf32"] = _matmul_flops(torch, dev, torch.float32, n, sync, **gpu)
        torch.backends.cuda.matmul.allow_tf32 = False
        figures["fp16"] = _matmul_flops(torch, dev, torch.float16, n, sync, **gpu)
        if torch.cuda.is_bf16_supported():
            figures["bf16"] = _matmul_flops(torch, dev, torch.bfloat16, n, sync, **gpu)
        if (props.major, props.minor) >= (8, 9) and hasattr(torch, "float8_e4m3fn"):
            try:
                figures["fp8"] = _fp8_flops(torch, dev, n, sync)
            except RuntimeError as exc:
                log.info("fp8 matmul not measured: %s", str(exc).splitlines()[0])
        copy_bytes = 1 << 30
        host = torch.empty(copy_bytes // 4, dtype=torch.float32).pin_memory()
        target = torch.empty(copy_bytes // 4, dtype=torch.float32, device=dev)
        h2d = copy_bytes / _timed(lambda: target.copy_(host, non_blocking=True), GPU_REPEAT,
                                  sync, GPU_WARM_S)
        link = _link(device.index)
        headline = "bf16" if "bf16" in figures else "fp16"
    else:
        dev = torch.device("cpu")
        sync = lambda: None  # noqa: E731
        figures["fp32"] = _matmul_flops(torch, dev, torch.float32, 1024, sync)
        figures["bf16"] = _matmul_flops(torch, dev, torch.bfloat16, 512, sync, repeat=3)
        copy_bytes = 1 << 27
        headline = "fp32"
    src = torch.empty(copy_bytes // 4, device=dev, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    repeat, warm_s = (GPU_REPEAT, GPU_WARM_S) if device.is_cuda else (5, 0.0)
    bandwidth = 2 * copy_bytes / _timed(lambda: dst.copy_(src), repeat, sync, warm_s)  # r + w
    return pb.Benchmark(
        matmul_flops=figures[headline], matmul_dtype=headline,
        memory_bandwidth_bytes_per_s=bandwidth, measured_at_ms=now_ms(),
        matmul_flops_by_dtype=figures, host_to_device_bytes_per_s=h2d, sm_count=sm_count,
        interconnect=link)


def _key(device: DeviceInfo) -> str:
    return f"{device.uuid}|{device.name}|{device.driver_version}|torch {_torch_version()}"


def _torch_version() -> str:
    """torch's version, from its installed metadata where it has some: importing torch
    only to read it cost every provider start whose figures were cached 1-2 s of CPU."""
    import importlib.metadata

    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        import torch

        return torch.__version__


def _entry(b: pb.Benchmark) -> dict:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(b, preserving_proto_field_name=True)


def cached_benchmarks(devices: list[DeviceInfo], cache: Path, *,
                      refresh: bool = False) -> dict[int, pb.Benchmark]:
    """Return each device's figures, measuring those not cached for this device and driver."""
    from google.protobuf.json_format import ParseDict

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
            entry = _entry(measure(device))
            saved["devices"][key] = entry
            changed = True
        out[device.index] = ParseDict(entry, pb.Benchmark())
    if changed:
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(cache, json.dumps(saved, indent=2).encode())
    return out
