"""What devices this host can rent out: NVIDIA GPUs through NVML, else the CPU.

No grpc here; NVML calls block, so the daemon calls detect() in a thread.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from gpumarket.proto.v1 import types_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    uuid: str
    accelerator: int                 # pb.ACCELERATOR_CPU or pb.ACCELERATOR_CUDA
    memory_bytes: int
    compute_capability: str = ""     # "9.0"
    driver_version: str = ""
    cuda_version: str = ""           # "12.4"
    cpu_cores: int = 0
    mig_mode: str = ""               # "enabled", "disabled"; "" where the GPU has no MIG

    @property
    def is_cuda(self) -> bool:
        return self.accelerator == pb.ACCELERATOR_CUDA

    def message(self, benchmark: pb.Benchmark | None = None) -> pb.Device:
        d = pb.Device(index=self.index, name=self.name, uuid=self.uuid,
                      accelerator=self.accelerator, memory_bytes=self.memory_bytes,
                      compute_capability=self.compute_capability,
                      driver_version=self.driver_version, cuda_version=self.cuda_version,
                      cpu_cores=self.cpu_cores, mig_mode=self.mig_mode)
        if benchmark is not None:
            d.benchmark.CopyFrom(benchmark)
        return d


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def cpu_devices(count: int = 1) -> list[DeviceInfo]:
    """The host CPU as ``count`` devices (one by default), each with an equal share of its
    usable cores and physical memory: several CPU jobs at once, or one job on several
    processes (torch.distributed with gloo)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    host = platform.node().encode()
    uuid = "CPU-" + hashlib.sha256(host + _cpu_name().encode()).hexdigest()[:16]
    count = max(1, count)
    return [DeviceInfo(index=i, name=_cpu_name(), uuid=uuid if count == 1 else f"{uuid}-{i}",
                       accelerator=pb.ACCELERATOR_CPU, memory_bytes=memory // count,
                       cpu_cores=max(1, (cores or 1) // count)) for i in range(count)]


def cpu_device() -> DeviceInfo:
    """The host CPU as one device: its usable cores and physical memory."""
    return cpu_devices(1)[0]


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _mig_mode(pynvml, handle) -> str:
    """The GPU's current MIG mode: "enabled" or "disabled"; "" where it has none (NVML
    answers NotSupported on GPUs without MIG, and older drivers lack the call)."""
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        return ""
    return "enabled" if current == pynvml.NVML_DEVICE_MIG_ENABLE else "disabled"


def nvidia_devices() -> list[DeviceInfo]:
    """Every NVIDIA GPU NVML sees; raise RuntimeError with a one-line reason if none."""
    try:
        import pynvml
    except ImportError as exc:
        raise RuntimeError("NVML bindings missing: pip install nvidia-ml-py") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound as exc:
        raise RuntimeError("no NVIDIA driver installed (libnvidia-ml.so.1 not found)") from exc
    except pynvml.NVMLError_DriverNotLoaded as exc:
        raise RuntimeError("the NVIDIA driver is installed but not loaded") from exc
    except pynvml.NVMLError as exc:
        raise RuntimeError(f"NVML could not start: {exc}") from exc
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        cuda_version = f"{cuda // 1000}.{cuda % 1000 // 10}"
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            devices.append(DeviceInfo(
                index=i,
                name=_text(pynvml.nvmlDeviceGetName(h)),
                uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                accelerator=pb.ACCELERATOR_CUDA,
                memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                compute_capability=f"{major}.{minor}",
                driver_version=driver,
                cuda_version=cuda_version,
                mig_mode=_mig_mode(pynvml, h),
            ))
    finally:
        pynvml.nvmlShutdown()
    if not devices:
        raise RuntimeError("NVML found no NVIDIA GPU")
    return devices


def detect(cpu_only: bool = False, cpu_count: int = 1) -> tuple[list[DeviceInfo], str | None]:
    """Return (devices, warning): the GPUs, or the CPU (as ``cpu_count`` devices) and one
    line saying why."""
    if cpu_only:
        return cpu_devices(cpu_count), None
    try:
        return nvidia_devices(), None
    except RuntimeError as exc:
        return cpu_devices(cpu_count), (f"no NVIDIA GPU found ({exc}); offering the CPU as a"
                                        " CPU device")


def inference_engines(has_cuda: bool) -> frozenset[str]:
    """The engines this provider can run: transformers always; vLLM where its package is
    installed and there is a CUDA device (it runs on nothing else); Blender's Cycles where
    the bpy package is installed."""
    import importlib.util

    engines = {"transformers"}
    if has_cuda and importlib.util.find_spec("vllm") is not None:
        engines.add("vllm")
    if renderer_available():
        engines.add("cycles")
    return frozenset(engines)


def local_models(models_dir: Path) -> dict[str, Path]:
    """The models a provider holds: each directory under ``models_dir`` with a config.json,
    by its name (plain names only)."""
    from gpumarket.proto.jobspec import NAME_RE

    if not models_dir.is_dir():
        return {}
    return {d.name: d for d in sorted(models_dir.iterdir())
            if d.is_dir() and NAME_RE.match(d.name) and (d / "config.json").is_file()}


def renderer_available() -> bool:
    """Whether render jobs can run here: Blender as the bpy package."""
    import importlib.util

    return importlib.util.find_spec("bpy") is not None
