"""What this host gives its jobs, decided once at start, and each job's share of it: its
uid, its control group with its limits, and its sandbox (provider/sandbox.py)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from gpumarket.provider import sandbox
from gpumarket.provider.cgroups import (
    PROCESSES,
    CgroupError,
    CgroupHost,
    JobCgroup,
    Limits,
    job_limits,
)
from gpumarket.provider.config import ProviderConfig
from gpumarket.provider.inventory import DeviceInfo
from gpumarket.provider.job_uids import UidRange, UidRangeError, claim

log = logging.getLogger(__name__)


@dataclass
class Isolation:
    features: dict = field(default_factory=dict)   # sandbox.probe(): what this host gives
    uids: UidRange | None = None                   # this daemon's job uids
    cgroups: CgroupHost | None = None              # this daemon's job groups
    isolate: bool = False                          # config.isolate: jobs get a sandbox

    def has(self, feature: str) -> bool:
        return bool(self.features.get(feature, {}).get("available"))

    @classmethod
    def prepare(cls, config: ProviderConfig, owner: str) -> "Isolation":
        """Claim this daemon's job uids and control-group directory (as root), then try
        every protection for real; log what is missing, and what that turns off."""
        iso = cls(isolate=config.isolate)
        if not config.isolate:
            return iso
        if os.geteuid() == 0:
            try:
                iso.uids = claim(owner, config.job_uid_pool)
            except UidRangeError as exc:
                log.warning("no job uid range: %s", exc)
            try:
                iso.cgroups = CgroupHost.detect(f"gpumarket-{owner[:16]}")
            except CgroupError as exc:
                log.warning("no job cgroups: %s", exc)
        iso.features = sandbox.prepare_host(config.data_dir, config.jobs_dir, iso.uids,
                                            iso.cgroups)
        log.info("job isolation: %s", sandbox.summary(iso.features))
        if iso.cgroups is not None:
            for controller, why in iso.cgroups.notes.items():
                log.warning("job cgroups: no %s controller (%s)", controller, why)
        missing = sandbox.missing_for_code(iso.features)
        if config.policy.allow_remote_code and missing:
            if config.unisolated_code:
                log.warning("jobs' own code runs without: %s (unisolated_code = true)",
                            ", ".join(missing))
            else:
                log.warning("jobs' own code (remote code) is refused: this host gives no %s"
                            " (gpumarket-provider doctor; unisolated_code = true to run it"
                            " anyway)", ", ".join(missing))
        return iso

    def runs_code(self, config: ProviderConfig) -> bool:
        """Whether jobs' own code (a model's remote code) runs here: only if the operator
        allows it, and only where the host isolates such a job fully, unless the operator
        opted in to weaker isolation."""
        return config.policy.allow_remote_code and self.isolates_code(config)

    def isolates_code(self, config: ProviderConfig) -> bool:
        """Whether a job's own code may run here: the host isolates it fully, or the
        operator opted in to weaker isolation."""
        return config.unisolated_code or not sandbox.missing_for_code(self.features)

    def job_limits(self, devices: list[DeviceInfo]) -> dict[str, str]:
        """How jobs on these devices have their memory, processes and CPU limited here
        (cgroups.job_limits; all "none" where isolation is off)."""
        if not self.isolate:
            return dict.fromkeys(("memory", "pids", "cpu"), "none")
        return job_limits(self.features, any(d.is_cuda for d in devices))

    def job_uid(self, device_indices: set[int]) -> int:
        """The uid a job on these devices runs as (its files are its, and only those are
        taken from its work directory)."""
        if self.uids is not None and self.has("unprivileged_user"):
            return self.uids.uid(min(device_indices, default=0))
        return os.geteuid()

    def for_job(self, config: ProviderConfig, workdir: Path, devices: list[DeviceInfo],
                host_devices: list[DeviceInfo]) -> tuple[sandbox.Sandbox | None,
                                                         JobCgroup | None]:
        """The sandbox and control group of the job in ``workdir`` on ``devices`` (None,
        None where isolation is off)."""
        if not config.isolate:
            return None, None
        cuda = any(d.is_cuda for d in devices)
        group = None
        if self.cgroups is not None and self.has("job_cgroup"):
            group = self.cgroups.job(workdir.name)
            group.limit(limits(devices, host_devices))
        expose = (str(workdir),) + ((str(config.models_dir),)
                                    if config.models_dir.is_dir() else ())
        if any(d.mps for d in devices):     # a GPU slice reaches the MPS daemon's pipes
            expose += (os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps",)
        box = sandbox.for_job(self.features, self.uids, sorted(d.index for d in devices),
                              int(config.job_disk_gib * 2**30), cuda,
                              sum(d.memory_bytes for d in devices), group, expose)
        return box, group


def limits(devices: list[DeviceInfo], host_devices: list[DeviceInfo]) -> Limits:
    """A job's share of the host: on the CPU, its devices' memory and cores; on GPUs, host
    memory in proportion to the GPUs it leases, and no CPU cap."""
    if any(d.is_cuda for d in devices):
        gpus = [d for d in host_devices if d.is_cuda and not d.is_slice]
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        held = sum(d.share if d.is_slice else 1.0 for d in devices)   # a slice: its share
        return Limits(memory_bytes=int(host * held) // max(len(gpus), 1),
                      pids=PROCESSES)
    return Limits(memory_bytes=sum(d.memory_bytes for d in devices), pids=PROCESSES,
                  cpus=float(sum(d.cpu_cores for d in devices)))
