"""Provider onboarding: the self-test `gpumarket-provider init` runs on each device, and the
commented config it writes with the devices it found."""

from __future__ import annotations

import time
from dataclasses import dataclass

from gpumarket.proto.jobspec import ACCELERATOR_NAMES
from gpumarket.provider.config import INTERRUPTIBLE_SHARE
from gpumarket.provider.inventory import DeviceInfo

CPU_ALLOCATION_BYTES = 1 << 30      # the CPU device's self-test allocates this much, not "most"
GPU_ALLOCATION_SHARE = 0.9          # of a GPU's free memory


@dataclass(frozen=True)
class SelfTest:
    device: DeviceInfo
    allocated_bytes: int
    matmul_max_error: float          # relative to a float64 reference
    seconds: float
    problem: str = ""                # empty when the device passed

    @property
    def ok(self) -> bool:
        return not self.problem


def self_test(device: DeviceInfo) -> SelfTest:
    """Allocate most of the device's memory (1 GiB on the CPU) and touch it, then check a
    float32 matmul against a float64 reference."""
    import torch

    began = time.perf_counter()
    if device.is_cuda:
        torch_device = torch.device(f"cuda:{device.index}")
        free, _ = torch.cuda.mem_get_info(torch_device)
        size = int(free * GPU_ALLOCATION_SHARE)
    else:
        torch_device = torch.device("cpu")
        size = min(CPU_ALLOCATION_BYTES, device.memory_bytes // 4)
    try:
        block = torch.empty(size // 4, dtype=torch.float32, device=torch_device)
        block.fill_(1.0)
        if float(block[-1]) != 1.0:
            return SelfTest(device, size, float("inf"), time.perf_counter() - began,
                            "memory did not hold what was written")
        del block
    except (RuntimeError, MemoryError) as exc:  # torch's OutOfMemoryError is a RuntimeError
        return SelfTest(device, 0, float("inf"), time.perf_counter() - began,
                        f"could not allocate {size / 2**30:.1f} GiB: {str(exc).splitlines()[0]}")
    finally:
        if device.is_cuda:
            torch.cuda.empty_cache()
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(512, 512, generator=gen, dtype=torch.float64)
    b = torch.randn(512, 512, generator=gen, dtype=torch.float64)
    reference = a @ b
    with torch.no_grad():
        # TF32 would be a legitimate speed-up but not what this checks.
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            got = (a.float().to(torch_device) @ b.float().to(torch_device)).double().cpu()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
    error = float(((got - reference).abs().max() / reference.abs().max()))
    problem = "" if error < 1e-4 else f"matmul is wrong (max relative error {error:.2e})"
    return SelfTest(device, size, error, time.perf_counter() - began, problem)


def config_text(devices: list[DeviceInfo], broker: str, data_dir: str, price: float) -> str:
    """A commented provider config naming the devices found."""
    lines = [
        "# gpumarket provider config, written by `gpumarket-provider init`.",
        "# Run with: gpumarket-provider run --config THIS_FILE",
        "# Command-line options override what is set here.",
        "",
        f'broker = "{broker}"' if broker else '# broker = "broker.example.org:7070"',
        f'data_dir = "{data_dir}"',
        f"price_per_gpu_hour = {price}        # credits per device-hour",
        (f"# interruptible_price_per_gpu_hour = {round(price * INTERRUPTIBLE_SHARE, 6)}"
         "  # a lease that may be preempted (default: this)"),
        'kinds = ["training", "generate", "embed", "render"]  # render needs bpy',
        "max_job_hours = 24               # longest job accepted",
        "allow_clients = []               # client ids; empty = everyone not denied",
        "deny_clients = []",
        "",
        "# Hours of availability, UTC. No [[availability]] table = always available.",
        "# [[availability]]",
        '# days = ["mon", "tue", "wed", "thu", "fri"]',
        '# hours = "18:00-08:00"',
        "",
        "# Devices found on this machine. To price one differently, uncomment its table:",
    ]
    for d in devices:
        lines += [f"# device {d.index}: {d.name}, {ACCELERATOR_NAMES[d.accelerator]},"
                  f" {d.memory_bytes / 2**30:.1f} GiB, {d.uuid}",
                  f"# [devices.{d.index}]", f"# price_per_hour = {price}"]
    return "\n".join(lines) + "\n"
