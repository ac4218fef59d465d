"""What devices this host can rent out: NVIDIA GPUs through NVML, else the CPU.

No grpc here; NVML calls block, so the daemon calls detect() in a thread.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from dataclasses import dataclass, replace
from pathlib import Path

from gpumarket.proto.jobspec import ACCELERATOR_NAMES
from gpumarket.proto.slices import blocked, check_shares
from gpumarket.proto.v1 import types_pb2 as pb

log = logging.getLogger(__name__)

MAX_DEVICES = 64    # devices one provider offers, slices and MIG instances counted: a job uid
                    # each (provider/job_uids.RANGE_SIZE)


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
    mig_parent_uuid: str = ""        # a MIG instance: its GPU's uuid (its own is "MIG-…")
    slice_of: int | None = None      # a slice: the index of its card (a whole device here)
    share: float = 0.0               # a slice: its share of its card's memory and compute
    card_uuid: str = ""              # a slice: its card's uuid (what the job's CUDA sees)
    cores: tuple[int, ...] = ()      # the CPU: the host's cores its jobs run on
    mps: bool = False                # a CUDA slice: an MPS daemon holds its compute share

    @property
    def is_cuda(self) -> bool:
        return self.accelerator == pb.ACCELERATOR_CUDA

    @property
    def is_slice(self) -> bool:
        return self.slice_of is not None

    @property
    def visible_id(self) -> str:
        """What CUDA_VISIBLE_DEVICES names for a job on it: its card's uuid for a slice
        (the slice is a share of that card), else its own (a GPU's, or a MIG instance's)."""
        return self.card_uuid or self.uuid

    def message(self, benchmark: pb.Benchmark | None = None) -> pb.Device:
        d = pb.Device(index=self.index, name=self.name, uuid=self.uuid,
                      accelerator=self.accelerator, memory_bytes=self.memory_bytes,
                      compute_capability=self.compute_capability,
                      driver_version=self.driver_version, cuda_version=self.cuda_version,
                      cpu_cores=self.cpu_cores, mig_mode=self.mig_mode,
                      mig_parent_uuid=self.mig_parent_uuid)
        if self.slice_of is not None:
            d.slice_of = self.slice_of
            d.memory_share = d.compute_share = self.share
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
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else list(range(os.cpu_count() or 1))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    host = platform.node().encode()
    uuid = "CPU-" + hashlib.sha256(host + _cpu_name().encode()).hexdigest()[:16]
    count = max(1, count)
    per = max(1, len(usable) // count)
    # Each device its own cores where there are enough (a job's threads are pinned to them:
    # runners/base.apply_share); fewer cores than devices: they share them all.
    return [DeviceInfo(index=i, name=_cpu_name(), uuid=uuid if count == 1 else f"{uuid}-{i}",
                       accelerator=pb.ACCELERATOR_CPU, memory_bytes=memory // count,
                       cpu_cores=per,
                       cores=tuple(usable[i * per:(i + 1) * per]) if len(usable) >= count
                       else tuple(usable))
            for i in range(count)]


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
        migs = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            gpu = DeviceInfo(
                index=i,
                name=_text(pynvml.nvmlDeviceGetName(h)),
                uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                accelerator=pb.ACCELERATOR_CUDA,
                memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                compute_capability=f"{major}.{minor}",
                driver_version=driver,
                cuda_version=cuda_version,
                mig_mode=_mig_mode(pynvml, h),
            )
            instances = _mig_instances(pynvml, h, gpu) if gpu.mig_mode == "enabled" else []
            if instances:
                migs += instances   # a GPU in MIG mode runs CUDA jobs only on its instances
            else:
                devices.append(gpu)
    finally:
        pynvml.nvmlShutdown()
    # MIG instances are devices of their own, numbered after the whole GPUs.
    first = max((d.index for d in devices), default=-1) + 1
    devices += [replace(m, index=first + j) for j, m in enumerate(migs)]
    if not devices:
        raise RuntimeError("NVML found no NVIDIA GPU")
    return devices


def _mig_instances(pynvml, handle, gpu: DeviceInfo) -> list[DeviceInfo]:
    """The MIG instances NVML enumerates on a GPU in MIG mode, each a device of its own
    (CUDA_VISIBLE_DEVICES=MIG-…; its index is set by the caller); [] where there are none
    yet (MIG enabled but no instance made) or the driver cannot list them."""
    out = []
    try:
        count = pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    except pynvml.NVMLError:
        return []
    for j in range(count):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
            uuid = _text(pynvml.nvmlDeviceGetUUID(mig))
            memory = int(pynvml.nvmlDeviceGetMemoryInfo(mig).total)
            name = _text(pynvml.nvmlDeviceGetName(mig))
        except pynvml.NVMLError:
            continue        # no instance in this slot
        out.append(replace(gpu, name=name, uuid=uuid, memory_bytes=memory, mig_mode="",
                           mig_parent_uuid=gpu.uuid))
    return out


def mps_running() -> bool:
    """Whether an NVIDIA MPS control daemon serves this host: its pipe directory
    ($CUDA_MPS_PIPE_DIRECTORY, default /tmp/nvidia-mps) holds its control pipe. Only then
    does a slice's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE hold its compute share."""
    pipes = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")
    return (pipes / "control").exists()


def sliced(devices: list[DeviceInfo], shares: dict[int, tuple[float, ...]],
           mps: bool | None = None) -> list[DeviceInfo]:
    """``devices`` and, after them, the slices ``shares`` asks for (by card index: the
    shares of its slices, checked by proto/slices.check_shares). A slice has its share of
    its card's memory; on the CPU its share of the card's cores (at least one each, never
    one two slices hold), on CUDA the card's uuid (its job sees that card, held to its share
    by runners/base.apply_share) and whether MPS holds its compute share (``mps``: None
    detects it). Raises ValueError for a card that is no whole device here, a CPU with
    fewer cores than its slices ask, or more devices than MAX_DEVICES."""
    if not shares:
        return list(devices)
    by_index = {d.index: d for d in devices}
    out = list(devices)
    index = max(by_index) + 1
    for card_index, parts in sorted(shares.items()):
        card = by_index.get(card_index)
        if card is None or card.is_slice or card.mig_parent_uuid:
            raise ValueError(f"device {card_index}: no whole device of this host to slice"
                             f" (devices: {sorted(by_index)})")
        parts = check_shares(parts, f"device {card_index} slices")
        cores = list(card.cores)
        if not card.is_cuda:
            needed = [max(1, int(s * len(cores) + 1e-9)) for s in parts]
            if sum(needed) > len(cores):
                raise ValueError(f"device {card_index}: its {len(cores)} core(s) cannot give"
                                 f" {len(parts)} slices a core each")
        taken = 0
        for k, share in enumerate(parts):
            extra: dict = {}
            if card.is_cuda:
                extra = {"card_uuid": card.uuid,
                         "mps": mps_running() if mps is None else mps}
            else:
                own = tuple(cores[taken:taken + needed[k]])
                taken += needed[k]
                extra = {"cores": own, "cpu_cores": len(own)}
            out.append(replace(card, index=index, uuid=f"{card.uuid}/slice-{k}",
                               memory_bytes=int(card.memory_bytes * share), slice_of=card.index,
                               share=share, mig_mode="", **extra))
            index += 1
    if len(out) > MAX_DEVICES:
        raise ValueError(f"{len(out)} devices with their slices; a provider offers at most"
                         f" {MAX_DEVICES}")
    return out


def config_slices(devices: list[DeviceInfo], config) -> list[DeviceInfo]:
    """``devices`` with the slices a ProviderConfig asks for; InvalidArgument if it cannot
    (a line saying why)."""
    from gpumarket.proto.errors import InvalidArgument

    try:
        return sliced(devices, config.slice_shares(devices))
    except ValueError as exc:
        raise InvalidArgument(f"slices: {exc}") from None


def busy(devices: list[DeviceInfo], leased: set[int]) -> set[int]:
    """The devices not free while ``leased`` run: those, the card of a slice leased, the
    slices of a card leased whole (proto/slices.blocked)."""
    return blocked([(d.index, d.slice_of) for d in devices], leased)


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


def device_row(d: DeviceInfo) -> dict:
    """One device as `gpumarket-provider devices --json` shows it."""
    return {"index": d.index, "name": d.name, "uuid": d.uuid,
            "accelerator": ACCELERATOR_NAMES[d.accelerator], "memory_bytes": d.memory_bytes,
            "compute_capability": d.compute_capability, "driver_version": d.driver_version,
            "cuda_version": d.cuda_version, "cpu_cores": d.cpu_cores,
            "mig_mode": d.mig_mode, "mig_parent_uuid": d.mig_parent_uuid,
            "slice_of": d.slice_of, "share": d.share, "cores": list(d.cores),
            "compute_held": d.mps if d.is_cuda and d.is_slice else None}


def device_line(r: dict) -> str:
    """One device_row as a line of `gpumarket-provider devices`."""
    extra = (f"cc {r['compute_capability']}, driver {r['driver_version']}, CUDA "
             f"{r['cuda_version']}{', MIG ' + r['mig_mode'] if r['mig_mode'] else ''}"
             f"{', MIG instance of ' + r['mig_parent_uuid'] if r['mig_parent_uuid'] else ''}"
             if r["accelerator"] == "cuda"
             else f"{r['cpu_cores']} cores")
    if r["slice_of"] is not None:
        held = ("" if r["accelerator"] != "cuda" else
                ", compute share held by MPS" if r["compute_held"] else
                ", no MPS daemon: memory share only")
        extra = f"slice {r['share']:.3g} of device {r['slice_of']}, {extra}{held}"
    return (f"{r['index']}  {r['accelerator']:4}  {r['name']}  "
            f"{r['memory_bytes'] / 2**30:.1f} GiB  {extra}  {r['uuid']}")
