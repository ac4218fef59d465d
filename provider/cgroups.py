"""One control group per job: its memory, processes and CPU limited together, and every
process of it killed at once, however it forked or detached.

cgroup v2 where its controllers are there to use. On a hybrid host (v2 mounted beside the v1
controllers, as many distributions and container hosts still are) the v2 hierarchy holds and
kills the job (``cgroup.kill``) and the v1 ``memory``, ``pids`` and ``cpu`` controllers limit
it. Each daemon keeps its jobs under a directory of its own (``gpumarket-<provider>``) below
its own cgroup, so one daemon never touches another's jobs.

The daemon makes the groups and sets the limits; the job process joins them itself (writing
its pid into each ``cgroup.procs``) while still root, before it drops to its uid, so nothing
of the job ever runs outside them. The daemon needs root, or a delegated subtree.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_FS = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000


class CgroupError(Exception):
    pass


@dataclass(frozen=True)
class Limits:
    memory_bytes: int = 0       # 0: no limit
    pids: int = 4096
    cpus: float = 0.0           # CPU time as a number of cores; 0: no limit


def _own_paths() -> dict[str, str]:
    """This process's cgroup per hierarchy: "" for v2, the controller name for v1."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        for name in (names.split(",") if names else [""]):
            out[name] = path
    return out


def _v1_mounts() -> dict[str, Path]:
    """Mount points of v1 controllers, by controller."""
    out = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        head, _, tail = line.partition(" - ")
        fields = tail.split()
        if len(fields) >= 3 and fields[0] == "cgroup":
            for opt in fields[2].split(","):
                if opt in CONTROLLERS:
                    out.setdefault(opt, Path(head.split()[4]))
    return out


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise CgroupError(f"cannot write {value!r} to {path} ({exc.strerror})") from exc


class CgroupHost:
    """Where one daemon makes its jobs' groups: ``v2`` (tracking and killing, and the limits
    where its controllers are enabled) and ``v1`` (controller -> directory) for the limits
    that v2 cannot give here."""

    def __init__(self, v2: Path | None, v1: dict[str, Path], v2_controllers: set[str]) -> None:
        self.v2 = v2
        self.v1 = v1
        self.v2_controllers = v2_controllers

    @classmethod
    def detect(cls, name: str) -> "CgroupHost":
        """Make this daemon's directories; raise CgroupError with the reason if this host
        gives no per-job groups (not root, no cgroup filesystem, nothing delegated)."""
        own = _own_paths()
        if (CGROUP_FS / "cgroup.controllers").exists():
            v2_root = CGROUP_FS                         # unified (v2 only)
        elif (CGROUP_FS / "unified" / "cgroup.controllers").exists():
            v2_root = CGROUP_FS / "unified"             # hybrid
        else:
            v2_root = None
        v2 = v2_controllers = None
        if v2_root is not None and "" in own:
            v2, v2_controllers = _prepare_v2(v2_root, own[""], name)
        v1 = {}
        for controller, mount in _v1_mounts().items():
            if controller in (v2_controllers or set()):
                continue
            base = mount / own.get(controller, "/").lstrip("/") / name
            try:
                base.mkdir(exist_ok=True)
            except OSError as exc:
                raise CgroupError(f"cannot make {base} ({exc.strerror})") from exc
            v1[controller] = base
        if v2 is None and not v1:
            raise CgroupError("no cgroup filesystem to make job groups in")
        missing = [c for c in CONTROLLERS if c not in v1 and c not in (v2_controllers or ())]
        if "memory" in missing or "pids" in missing:
            raise CgroupError(f"no {' and no '.join(missing)} controller for job groups")
        return cls(v2, v1, v2_controllers or set())

    def describe(self) -> str:
        parts = []
        if self.v2 is not None:
            parts.append("cgroup v2" + (f" ({', '.join(sorted(self.v2_controllers))})"
                                        if self.v2_controllers else " (kill, tracking)"))
        if self.v1:
            parts.append(f"v1 {', '.join(sorted(self.v1))}")
        return " + ".join(parts)

    def job(self, key: str) -> "JobCgroup":
        """The group of the job ``key`` (a work directory's name), made if absent."""
        dirs = []
        if self.v2 is not None:
            dirs.append(self.v2 / key)
        dirs += [base / key for base in self.v1.values()]
        for d in dirs:
            try:
                d.mkdir(exist_ok=True)
            except OSError as exc:
                raise CgroupError(f"cannot make {d} ({exc.strerror})") from exc
        return JobCgroup(self, key, dirs)

    def remove(self) -> None:
        """Remove this daemon's (empty) directories."""
        for d in ([self.v2] if self.v2 is not None else []) + list(self.v1.values()):
            try:
                d.rmdir()
            except OSError as exc:
                log.warning("cannot remove cgroup %s (%s)", d, exc.strerror)

    def keys(self) -> set[str]:
        """The jobs that have a group now (after a restart: the ones to account for)."""
        bases = ([self.v2] if self.v2 is not None else []) + list(self.v1.values())
        return {d.name for b in bases if b.is_dir() for d in b.iterdir() if d.is_dir()}


def _prepare_v2(root: Path, own: str, name: str) -> tuple[Path, set[str]]:
    """This daemon's v2 directory, with the controllers it can enable for its jobs. In a
    delegated subtree the daemon moves itself into a leaf first (a group with enabled
    controllers may hold no processes but in its leaves)."""
    here = root / own.lstrip("/")
    available = set((root / "cgroup.controllers").read_text().split()) & set(CONTROLLERS)
    base = here / name
    enabled: set[str] = set()
    if available:
        if own != "/" and (here / "cgroup.procs").read_text().strip():
            leaf = here / "daemon"
            leaf.mkdir(exist_ok=True)
            for pid in (here / "cgroup.procs").read_text().split():
                try:
                    _write(leaf / "cgroup.procs", pid)
                except CgroupError:
                    pass    # gone meanwhile
        wanted = " ".join(f"+{c}" for c in sorted(available))
        try:
            _write(here / "cgroup.subtree_control", wanted)
            base.mkdir(exist_ok=True)
            _write(base / "cgroup.subtree_control", wanted)
            enabled = available
        except (CgroupError, OSError) as exc:
            log.info("cgroup v2 controllers not enabled under %s (%s); using v1 where there",
                     here, exc)
    try:
        base.mkdir(exist_ok=True)
    except OSError as exc:
        raise CgroupError(f"cannot make {base} ({exc.strerror})") from exc
    return base, enabled


class JobCgroup:
    def __init__(self, host: CgroupHost, key: str, dirs: list[Path]) -> None:
        self.host = host
        self.key = key
        self.dirs = dirs
        self.limits = Limits()

    def _dir(self, controller: str) -> Path | None:
        if controller in self.host.v2_controllers:
            return self.host.v2 / self.key
        base = self.host.v1.get(controller)
        return base / self.key if base is not None else None

    def limit(self, limits: Limits) -> None:
        """Set the job's limits (memory without swap, processes, CPU time)."""
        self.limits = limits
        v2 = self.host.v2_controllers
        mem = self._dir("memory")
        if mem is not None and limits.memory_bytes:
            if "memory" in v2:
                _write(mem / "memory.max", str(limits.memory_bytes))
                if (mem / "memory.swap.max").exists():
                    _write(mem / "memory.swap.max", "0")
            else:
                _write(mem / "memory.limit_in_bytes", str(limits.memory_bytes))
                if (mem / "memory.memsw.limit_in_bytes").exists():
                    _write(mem / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        pids = self._dir("pids")
        if pids is not None and limits.pids:
            _write(pids / "pids.max", str(limits.pids))
        cpu = self._dir("cpu")
        if cpu is not None and limits.cpus > 0:
            quota = int(limits.cpus * CPU_PERIOD_US)
            if "cpu" in v2:
                _write(cpu / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            else:
                _write(cpu / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(cpu / "cpu.cfs_quota_us", str(quota))

    @property
    def procs_files(self) -> list[str]:
        """What the job process writes its pid into to join the group."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def pids(self) -> set[int]:
        out: set[int] = set()
        for d in self.dirs:
            try:
                out |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
            except OSError:
                pass
        return out

    def kill(self, timeout_s: float = 10.0) -> int:
        """SIGKILL every process of the job and wait until none is left; return how many
        there were. ``cgroup.kill`` where the kernel has it (atomic: nothing forks past it),
        else kill what is listed until nothing is."""
        found = self.pids()
        kill_file = self.host.v2 / self.key / "cgroup.kill" if self.host.v2 else None
        deadline = time.monotonic() + timeout_s
        while True:
            if kill_file is not None and kill_file.exists():
                _write(kill_file, "1")
            else:
                for pid in self.pids():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            left = self.pids()
            found |= left
            if not left:
                return len(found)
            if time.monotonic() > deadline:
                raise CgroupError(f"{len(left)} processes of job {self.key} survive SIGKILL")
            time.sleep(0.02)

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the job for exceeding its memory."""
        mem = self._dir("memory")
        if mem is None:
            return False
        name = "memory.events" if "memory" in self.host.v2_controllers else "memory.oom_control"
        try:
            text = (mem / name).read_text()
        except OSError:
            return False
        counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(counts.get("oom_kill", 0)) > 0

    def remove(self) -> None:
        """Remove the (empty) group; what cannot be removed now is logged and left."""
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
            else:
                log.warning("cannot remove cgroup %s", d)


def join(procs_files: list[str]) -> None:
    """Move this process into a job's group (call as root, before dropping privileges)."""
    me = str(os.getpid())
    for f in procs_files:
        try:
            with open(f, "w") as out:
                out.write(me)
        except OSError as exc:
            raise CgroupError(f"cannot join {os.path.dirname(f)} ({exc.strerror})") from exc
