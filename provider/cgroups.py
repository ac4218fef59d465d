"""One control group per job: every process of it tracked and killed at once, however it
forked or detached, and its memory, processes and CPU limited by whichever controllers this
host gives the daemon.

The daemon uses what its OWN cgroup was delegated, one controller at a time: a host that
delegates ``memory`` only (a common v2 host) still limits each job's memory, and the limits
it lacks fall back elsewhere (sandbox.for_job: RLIMIT_NPROC of the job's own uid for
processes, no CPU cap). cgroup v2 where its controllers are there to use; on a hybrid host (v2
mounted beside the v1 controllers, as many distributions and container hosts still are) the
v2 hierarchy holds and kills the job (``cgroup.kill``) and the v1 controllers limit it. Each
daemon keeps its jobs under a directory of its own (``gpumarket-<provider>``) beside its own
cgroup's leaf, so one daemon never touches another's jobs.

The v2 layout, in the cgroup the daemon was started in (P)::

    P/                       controllers enabled for its children, one write each
    P/daemon/                every process that was in P (a v2 group with enabled
                             controllers holds processes only in its leaves)
    P/gpumarket-<provider>/  one daemon's jobs, each a group of its own below

A daemon started again (or a second daemon started by the first one's tools) finds itself in
``P/daemon`` and uses P again: nothing nests, and each provider's directory is a sibling.

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

PROC_SELF = Path("/proc/self")
CONTROLLERS = ("memory", "pids", "cpu")
LEAF = "daemon"            # the leaf of P that P's own processes move into (see above)
PROCESSES = 4096           # a job's processes: pids.max of its group, RLIMIT_NPROC of its uid
CPU_PERIOD_US = 100_000
V2, V1 = "cgroup v2", "cgroup v1"


class CgroupError(Exception):
    pass


@dataclass(frozen=True)
class Limits:
    memory_bytes: int = 0       # 0: no limit
    pids: int = PROCESSES
    cpus: float = 0.0           # CPU time as a number of cores; 0: no limit


@dataclass(frozen=True)
class Mount:
    path: Path                  # where it is mounted
    root: str                   # the cgroup shown at ``path`` ("/" unless a bind of a subtree)

    def dir(self, cgroup: str) -> Path:
        """The directory of ``cgroup`` (a path as /proc/self/cgroup gives it) here."""
        root = self.root.rstrip("/")
        if root and (cgroup == root or cgroup.startswith(root + "/")):
            cgroup = cgroup[len(root):]
        return self.path / cgroup.lstrip("/")


class CgroupFs:
    """The cgroup filesystems as this process sees them: where they are mounted
    (``proc``/mountinfo), which group it is in (``proc``/cgroup), and the reads, writes and
    directories of their files. Tests give a tree of their own that acts like cgroupfs for
    these files (tests/test_cgroups.py)."""

    def __init__(self, proc: Path = PROC_SELF) -> None:
        self.proc = proc

    def own_paths(self) -> dict[str, str]:
        """This process's cgroup per hierarchy: "" for v2, the controller name for v1."""
        out = {}
        for line in (self.proc / "cgroup").read_text().splitlines():
            _, names, path = line.split(":", 2)
            for name in (names.split(",") if names else [""]):
                out[name] = path
        return out

    def mounts(self) -> tuple[Mount | None, dict[str, Mount]]:
        """The v2 mount (the first; None where there is none) and each v1 controller's."""
        v2, v1 = None, {}
        for line in (self.proc / "mountinfo").read_text().splitlines():
            head, _, tail = line.partition(" - ")
            fields, fs = head.split(), tail.split()
            if len(fields) < 5 or len(fs) < 3:
                continue
            mount = Mount(Path(_unescape(fields[4])), _unescape(fields[3]))
            if fs[0] == "cgroup2" and v2 is None:
                v2 = mount
            elif fs[0] == "cgroup":
                for opt in fs[2].split(","):
                    if opt in CONTROLLERS:
                        v1.setdefault(opt, mount)
        return v2, v1

    def read(self, path: Path) -> str:
        try:
            return path.read_text()
        except OSError as exc:
            raise CgroupError(f"cannot read {path} ({exc.strerror})") from exc

    def words(self, path: Path) -> set[str]:
        return set(self.read(path).split())

    def write(self, path: Path, value: str) -> None:
        try:
            with open(path, "w") as f:
                f.write(value)
        except OSError as exc:
            raise CgroupError(f"cannot write {value!r} to {path} ({exc.strerror})") from exc

    def mkdir(self, path: Path) -> None:
        try:
            path.mkdir(exist_ok=True)
        except OSError as exc:
            raise CgroupError(f"cannot make {path} ({exc.strerror})") from exc

    def rmdir(self, path: Path) -> None:
        path.rmdir()


def _unescape(field: str) -> str:
    """A mountinfo path: space, tab, newline and backslash are octal escapes there."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


class CgroupHost:
    """Where one daemon makes its jobs' groups: ``v2`` (tracking and killing, and the limits
    of the controllers enabled there) and ``v1`` (controller -> directory) for the limits
    that v2 does not give here; ``notes`` says, per controller this host does not give, why."""

    def __init__(self, v2: Path | None, v1: dict[str, Path], v2_controllers: set[str],
                 notes: dict[str, str] | None = None, fs: CgroupFs | None = None) -> None:
        self.v2 = v2
        self.v1 = v1
        self.v2_controllers = v2_controllers
        self.notes = notes or {}
        self.fs = fs or CgroupFs()

    @classmethod
    def detect(cls, name: str, fs: CgroupFs | None = None) -> "CgroupHost":
        """Make this daemon's directories (``name`` below its own cgroup in each hierarchy it
        uses) with every controller it can have, each on its own: one that is not delegated
        or is refused is noted (``notes``) and the others kept. Raise CgroupError with the
        reason if this host gives no per-job group at all (not root, no cgroup filesystem,
        nothing writable)."""
        fs = fs or CgroupFs()
        own = fs.own_paths()
        v2_mount, v1_mounts = fs.mounts()
        notes: dict[str, str] = {}
        v2, enabled, why_not = None, set(), ""
        if v2_mount is not None and "" in own:
            try:
                v2, enabled = _prepare_v2(fs, v2_mount.dir(own[""]), name, notes)
            except CgroupError as exc:
                why_not = str(exc)
                log.info("no cgroup v2 job groups: %s", exc)
        v1 = {}
        for controller in CONTROLLERS:
            mount = v1_mounts.get(controller)
            if controller in enabled:
                continue
            if mount is None:
                if v1_mounts and controller in notes:       # a hybrid host without it
                    notes[controller] += "; no v1 hierarchy of it mounted"
                continue
            base = mount.dir(own.get(controller, "/")) / name
            try:
                fs.mkdir(base)
            except CgroupError as exc:
                notes[controller] = f"{notes[controller]}; v1: {exc}" \
                    if controller in notes else str(exc)
                continue
            notes.pop(controller, None)
            v1[controller] = base
        if v2 is None and not v1:
            raise CgroupError(why_not or "no cgroup filesystem to make job groups in")
        for c in CONTROLLERS:
            if c not in enabled and c not in v1:
                notes.setdefault(c, why_not or "no cgroup hierarchy here has it")
        return cls(v2, v1, enabled, notes, fs)

    @property
    def holds(self) -> dict[str, str]:
        """The limits a job's group holds, and how: controller -> "cgroup v2" or "cgroup v1"."""
        return {c: V2 if c in self.v2_controllers else V1 for c in CONTROLLERS
                if c in self.v2_controllers or c in self.v1}

    def describe(self) -> str:
        held = self.holds
        parts = []
        if self.v2 is not None:
            mine = [c for c in CONTROLLERS if held.get(c) == V2]
            parts.append(f"cgroup v2 ({', '.join(mine + ['kill'])})")
        if self.v1:
            parts.append(f"v1 {', '.join(c for c in CONTROLLERS if c in self.v1)}")
        missing = [c for c in CONTROLLERS if c not in held]
        return " + ".join(parts) + (f"; no {', '.join(missing)} controller" if missing else "")

    def job(self, key: str) -> "JobCgroup":
        """The group of the job ``key`` (a work directory's name), made if absent."""
        dirs = []
        if self.v2 is not None:
            dirs.append(self.v2 / key)
        dirs += [base / key for base in self.v1.values()]
        for d in dirs:
            self.fs.mkdir(d)
        return JobCgroup(self, key, dirs)

    def remove(self) -> None:
        """Remove this daemon's (empty) directories."""
        for d in ([self.v2] if self.v2 is not None else []) + list(self.v1.values()):
            try:
                self.fs.rmdir(d)
            except OSError as exc:
                log.warning("cannot remove cgroup %s (%s)", d, exc.strerror)

    def keys(self) -> set[str]:
        """The jobs that have a group now (after a restart: the ones to account for)."""
        bases = ([self.v2] if self.v2 is not None else []) + list(self.v1.values())
        return {d.name for b in bases if b.is_dir() for d in b.iterdir() if d.is_dir()}


def _prepare_v2(fs: CgroupFs, own: Path, name: str,
                notes: dict[str, str]) -> tuple[Path, set[str]]:
    """This daemon's v2 directory and the controllers enabled in it for its jobs: those its
    own cgroup (P) was delegated, each enabled on its own. A group with enabled controllers
    may hold processes only in its leaves, so P's processes move into ``P/daemon`` first; a
    daemon already there (restarted, or a second one) uses P as it is."""
    here = own.parent if own.name == LEAF else own
    delegated = fs.words(here / "cgroup.controllers")
    for c in CONTROLLERS:
        if c not in delegated:
            notes[c] = f"not delegated: not in {here / 'cgroup.controllers'}"
    on = fs.words(here / "cgroup.subtree_control")
    todo = [c for c in CONTROLLERS if c in delegated and c not in on]
    # The root group (no cgroup.type) may hold processes beside enabled controllers.
    if todo and (here / "cgroup.type").exists() and fs.read(here / "cgroup.procs").split():
        _into_leaf(fs, here)
    for c in todo:
        try:
            fs.write(here / "cgroup.subtree_control", f"+{c}")
        except CgroupError as exc:
            notes[c] = str(exc)
    base = here / name
    fs.mkdir(base)
    usable = fs.words(base / "cgroup.controllers")
    for c in CONTROLLERS:
        if c in usable and c not in fs.words(base / "cgroup.subtree_control"):
            try:
                fs.write(base / "cgroup.subtree_control", f"+{c}")
            except CgroupError as exc:
                notes[c] = str(exc)
    enabled = fs.words(base / "cgroup.subtree_control") & set(CONTROLLERS)
    if enabled:
        log.info("cgroup v2 controllers for jobs under %s: %s", base, ", ".join(sorted(enabled)))
    return base, enabled


def _into_leaf(fs: CgroupFs, here: Path) -> None:
    leaf = here / LEAF
    fs.mkdir(leaf)
    for pid in fs.read(here / "cgroup.procs").split():
        try:
            fs.write(leaf / "cgroup.procs", pid)
        except CgroupError as exc:
            log.info("process %s stays in %s: %s", pid, here, exc)   # gone, or not ours


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

    def holds(self, controller: str) -> bool:
        """Whether this group limits ``controller`` ("memory", "pids", "cpu")."""
        return self._dir(controller) is not None

    def limit(self, limits: Limits) -> None:
        """Set the job's limits that this host's controllers hold (memory without swap,
        processes, CPU time); the others are left to the sandbox (sandbox.for_job)."""
        self.limits = limits
        write = self.host.fs.write
        v2 = self.host.v2_controllers
        mem = self._dir("memory")
        if mem is not None and limits.memory_bytes:
            if "memory" in v2:
                write(mem / "memory.max", str(limits.memory_bytes))
                if (mem / "memory.swap.max").exists():
                    write(mem / "memory.swap.max", "0")
            else:
                write(mem / "memory.limit_in_bytes", str(limits.memory_bytes))
                if (mem / "memory.memsw.limit_in_bytes").exists():
                    write(mem / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        pids = self._dir("pids")
        if pids is not None and limits.pids:
            write(pids / "pids.max", str(limits.pids))
        cpu = self._dir("cpu")
        if cpu is not None and limits.cpus > 0:
            quota = int(limits.cpus * CPU_PERIOD_US)
            if "cpu" in v2:
                write(cpu / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            else:
                write(cpu / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                write(cpu / "cpu.cfs_quota_us", str(quota))

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
                self.host.fs.write(kill_file, "1")
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
                    self.host.fs.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
            else:
                log.warning("cannot remove cgroup %s", d)


# -- what each of a job's limits rests on, from what sandbox.probe() found -----------------

def job_limits(features: dict, cuda: bool) -> dict[str, str]:
    """How ``sandbox.for_job`` limits a job's memory, processes and CPU on this host
    (``sandbox.probe()``'s features): {"memory", "pids", "cpu"} -> "cgroup v2", "cgroup v1",
    "rlimit" or "none". Memory by RLIMIT_AS is per process and on CPU jobs only (CUDA
    reserves far more address space than it uses); GPU jobs never get a CPU cap."""
    group = features.get("job_cgroup", {})
    held = group.get("holds", {}) if group.get("available") else {}
    own_uid = bool(features.get("unprivileged_user", {}).get("available"))
    return {"memory": held.get("memory") or ("none" if cuda else "rlimit"),
            "pids": held.get("pids") or ("rlimit" if own_uid else "none"),
            "cpu": "none" if cuda else held.get("cpu", "none")}


def limit_features(features: dict) -> dict[str, dict]:
    """Each of a job's limits as a feature of this host (``memory_limit``, ``process_limit``,
    ``cpu_limit``): whether it holds, how (``job_limits``), or what stands in for it and why."""
    group = features.get("job_cgroup", {})
    notes = group.get("notes", {}) if group.get("available") else {}
    why = {c: notes.get(c) or group.get("detail") or "no job cgroup" for c in CONTROLLERS}
    how = job_limits(features, cuda=False)
    if how["memory"].startswith("cgroup"):
        memory = f"{how['memory']}: all of a job's processes together, no swap beyond it"
    else:
        memory = (f"no memory controller ({why['memory']}): a CPU job's processes get an"
                  " address-space limit each (RLIMIT_AS), a GPU job none")
    if how["pids"].startswith("cgroup"):
        pids = f"{how['pids']}: {PROCESSES:,} processes per job"
    elif how["pids"] == "rlimit":
        pids = (f"RLIMIT_NPROC: {PROCESSES:,} processes of the job's own uid (no pids"
                f" controller: {why['pids']})")
    else:
        pids = f"no pids controller ({why['pids']}) and jobs share the daemon's uid"
    if how["cpu"].startswith("cgroup"):
        cpu = f"{how['cpu']}: a CPU job gets its devices' cores (GPU jobs are never capped)"
    else:
        cpu = (f"no cpu controller ({why['cpu']}): CPU jobs share the cores by the kernel's"
               " scheduler (GPU jobs are never capped)")
    return {
        "memory_limit": {"available": how["memory"].startswith("cgroup"),
                         "how": how["memory"], "detail": memory},
        "process_limit": {"available": how["pids"] != "none", "how": how["pids"],
                          "detail": pids},
        "cpu_limit": {"available": how["cpu"] != "none", "how": how["cpu"], "detail": cpu},
    }


def join(procs_files: list[str]) -> None:
    """Move this process into a job's group (call as root, before dropping privileges)."""
    me = str(os.getpid())
    for f in procs_files:
        try:
            with open(f, "w") as out:
                out.write(me)
        except OSError as exc:
            raise CgroupError(f"cannot join {os.path.dirname(f)} ({exc.strerror})") from exc
