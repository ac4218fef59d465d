"""Job isolation on the provider: what a job process gives up before it touches a job.

A ``Sandbox`` says how far, and ``apply`` does it in the job's own process, in this order:
join the job's control group (provider/cgroups.py: memory, processes and CPU of the whole
job, and one kill for all of it), a network namespace with only loopback, a mount namespace
with private scratch directories and a way to only the paths the job needs
(provider/mounts.py), a PID namespace of its own with its own /proc (provider/pidns.py),
resource limits, a private umask, the job's own unprivileged uid (from the daemon's own
range, provider/job_uids.py), and last a fresh session keyring with the uid's own keyrings
emptied (provider/keyrings.py). The first steps need root; the uid switch ends it. The
daemon starts a cold job as ``python -m gpumarket.provider.sandbox MODULE
WORKDIR`` with the sandbox in ``$GPUMARKET_SANDBOX``; a job forked by its kind's
forkserver (runners/forkserver.py) applies the one in its order before it runs anything of
the job. The work directory's disk quota is watched by the executor
(and no single file may exceed it: RLIMIT_FSIZE); scratch directories are tmpfs of a bounded
size whose pages count against the job's memory.

    python -m gpumarket.provider.sandbox --probe     # what this host allows, as JSON

No torch, no grpc here: this runs before anything else in a job process.
"""

from __future__ import annotations

import ctypes
import fcntl
import importlib.util
import json
import os
import resource
import runpy
import socket
import struct
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpumarket.provider import cgroups, keyrings, mounts, pidns
from gpumarket.provider.job_uids import UidRange, UidRangeError, claim

ENV = "GPUMARKET_SANDBOX"
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
LIMITS = ("NOFILE", "NPROC", "FSIZE", "CORE", "AS")
JOB_UMASK = 0o077
# What the job-uid probe reads, as that uid: the modules a runner imports first (found on
# the path and opened) and every file of torch's lib/ (opened), then one import of a compiled
# package. Not `import torch` itself: that is ~2 s of CPU at every daemon start, and what
# fails for a job uid is reaching and reading files (a closed directory above the Python, a
# file not readable by others), which this meets the same way.
PROBE_CHECK = """
import importlib.util, os
def opened(name):
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"No module named {name!r}")
    with open(spec.origin, "rb") as f:
        f.read(1)
    return spec.origin
for entry in os.scandir(os.path.join(os.path.dirname(opened("torch")), "lib")):
    if entry.is_file():
        with open(entry.path, "rb") as f:
            f.read(1)
for name in ("numpy", "gpumarket.provider.runners.training"):
    opened(name)
import numpy
"""
# What a job that runs code of its own (a script, a model's remote code) must not run
# without: its own uid, no network, private scratch, its own group (every process of it
# killed at once) and a memory limit on all of it together. Not the pids or cpu controller:
# its processes are bounded by RLIMIT_NPROC of its own uid all the same, and CPU time is
# shared, not a way out; so a host that delegates `memory` alone runs such jobs
# (docs/security.md).
CODE_NEEDS = ("unprivileged_user", "no_network", "private_tmp", "job_cgroup", "memory_limit")
# How the probe tells a PID namespace (the job is pid 2 beside its init, and its /proc shows
# those two only) and a fresh session keyring (not the one the probe has).
PID_CHECK = ("import os; p = sorted(int(x) for x in os.listdir('/proc') if x.isdigit());"
             " assert os.getpid() == 2 and p == [1, 2], f'/proc shows {len(p)} processes'")
KEYRING_CHECK = ("from gpumarket.provider import keyrings as k; assert k.session_id() not in"
                 " (0, {session}), 'the session keyring is not a fresh one'")


@dataclass(frozen=True)
class Sandbox:
    uid: int | None = None             # None: keep the daemon's
    gid: int | None = None
    network: bool = True               # False: a network namespace with only loopback
    limits: dict[str, int] = field(default_factory=dict)   # RLIMIT_<NAME> -> soft = hard
    cgroups: tuple[str, ...] = ()      # cgroup.procs files of the job's group, to join
    scratch_bytes: int = 0             # > 0: own mount namespace, private scratch of this size
    expose: tuple[str, ...] = ()       # paths the job needs besides the interpreter's
    pid_namespace: bool = False        # its own PID namespace and /proc
    keyring: bool = False              # a fresh session keyring (and, with a uid, its
                                       # uid's own keyrings emptied)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Sandbox":
        raw = json.loads(text)
        return cls(uid=raw.get("uid"), gid=raw.get("gid"), network=bool(raw.get("network")),
                   limits={k: int(v) for k, v in (raw.get("limits") or {}).items()
                           if k in LIMITS},
                   cgroups=tuple(raw.get("cgroups") or ()),
                   scratch_bytes=int(raw.get("scratch_bytes") or 0),
                   expose=tuple(raw.get("expose") or ()),
                   pid_namespace=bool(raw.get("pid_namespace")),
                   keyring=bool(raw.get("keyring")))


class SandboxError(Exception):
    pass


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, ifr)[:18])[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


def _unshare_network() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        raise SandboxError(f"no network namespace ({os.strerror(ctypes.get_errno())})")
    _loopback_up()   # the job's own processes still talk to each other (torch.distributed)


def interpreter_paths() -> list[str]:
    """What a job process needs to run this Python and import gpumarket's runners: the
    interpreter, its prefixes, every import path, and the packages' own directories (an
    editable install maps them outside sys.path)."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable),
             os.path.realpath(sys.executable), *(p for p in sys.path if os.path.isabs(p))]
    for name in ("gpumarket.proto", "gpumarket.provider"):
        spec = importlib.util.find_spec(name)
        if spec is not None:
            paths += list(spec.submodule_search_locations or ())
    return paths


def apply(box: Sandbox) -> list[str]:
    """Give up what ``box`` says, for good; return notes for the job's log. Raises
    SandboxError if any of it fails (the job must not run half-isolated). With a PID
    namespace, the process that calls this stays outside it and never returns (it ends as
    the job does, provider/pidns.py); this returns in the job's process inside it."""
    notes = []
    status_w = None
    try:
        if box.cgroups:
            cgroups.join(list(box.cgroups))
            notes.append("own cgroup")
        if not box.network:
            _unshare_network()
        if box.scratch_bytes:
            uid = box.uid if box.uid is not None else os.getuid()
            gid = box.gid if box.gid is not None else uid
            notes += mounts.private_view([*interpreter_paths(), *box.expose], uid, gid,
                                         box.scratch_bytes)
            try:    # the names of the jobs beside it: not worth failing the job for
                mounts.hide_beside([os.path.dirname(f) for f in box.cgroups])
            except mounts.MountError as exc:
                notes.append(f"other jobs' control groups shown ({exc})")
        if box.pid_namespace:
            if not box.scratch_bytes:
                mounts.unshare_mounts()      # its /proc must not be the host's
            status_w = pidns.enter(box.uid, box.gid)
            mounts.mount_proc()
            notes.append("own PID namespace and /proc")
    except (cgroups.CgroupError, mounts.MountError) as exc:
        raise SandboxError(str(exc)) from exc
    except OSError as exc:
        raise SandboxError(exc.strerror or str(exc)) from exc
    for name, value in box.limits.items():
        which = getattr(resource, f"RLIMIT_{name}")
        hard = resource.getrlimit(which)[1]
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)       # lower only: raising needs CAP_SYS_RESOURCE
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError) as exc:
            raise SandboxError(f"cannot set RLIMIT_{name} to {value} ({exc})") from exc
    os.umask(JOB_UMASK)
    if box.uid is not None:
        try:
            os.setgroups([])
            os.setgid(box.gid if box.gid is not None else box.uid)
            os.setuid(box.uid)
        except OSError as exc:
            raise SandboxError(f"cannot run as uid {box.uid} ({exc.strerror})") from exc
    if box.keyring:
        try:
            keyrings.fresh(clear=box.uid is not None)
        except keyrings.KeyringError as exc:
            raise SandboxError(f"no fresh keyrings ({exc})") from exc
        notes.append("fresh keyrings")
    if status_w is not None:
        try:
            pidns.start_job(status_w)
        except OSError as exc:
            raise SandboxError(f"cannot start the job in its PID namespace ({exc})") from exc
    return notes


def _attempts(tries: dict[str, tuple[Sandbox, str]]) -> dict[str, tuple[bool, str]]:
    """Run each (sandbox, check) in a child of its own, all at once; (worked, last line)."""
    procs = {}
    for name, (box, check) in tries.items():
        code = ("import sys; from gpumarket.provider import sandbox as s; "
                f"s.apply(s.Sandbox.from_json({box.to_json()!r})); {check}")
        procs[name] = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    out = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        lines = (stderr or stdout).strip().splitlines()
        out[name] = (proc.returncode == 0, lines[-1] if lines else "")
    return out


def probe(jobs_dir: str | None = None, uids: UidRange | None = None,
          cgroup_host: cgroups.CgroupHost | None = None) -> dict[str, dict]:
    """What this host gives: each feature tried for real in a child process, the job uid
    one by importing what a job's runner imports, as that uid, in the sandbox a job gets
    (a job uid is only usable if it can run the runner and reach ``jobs_dir``)."""
    try:
        session = keyrings.session_id()
    except keyrings.KeyringError:
        session = -1
    first = _attempts({
        "no_network": (Sandbox(network=False), "import socket; socket.create_connection("
                       "('192.0.2.1', 9), timeout=2)"),
        "namespace": (Sandbox(network=False), "pass"),
        "private_tmp": (Sandbox(scratch_bytes=1 << 20), "import os; st = os.statvfs('/tmp');"
                        " assert st.f_blocks * st.f_frsize <= 2 << 20, 'tmp is shared'"),
        "resource_limits": (Sandbox(limits={"NOFILE": 256, "CORE": 0}), "pass"),
        "pid_namespace": (Sandbox(scratch_bytes=1 << 20, pid_namespace=True), PID_CHECK),
        "keyrings": (Sandbox(keyring=True), KEYRING_CHECK.format(session=session)),
    })
    tmp_ok, tmp_why = first["private_tmp"]
    pid_ok, pid_why = first["pid_namespace"]
    pid_ok = pid_ok and tmp_ok
    keys_ok, keys_why = first["keyrings"]
    user = _probe_uid(jobs_dir, uids, tmp_ok, tmp_why, pid_ok, keys_ok)
    net_ok, net_why = first["no_network"]
    # connecting to an outside address must fail inside the namespace: success means leaky
    no_net = not net_ok and "unreachable" in net_why.lower()
    ns_ok, ns_why = first["namespace"]
    features = {
        "unprivileged_user": {"available": user[0], "detail": user[1]},
        "no_network": {"available": ns_ok and no_net,
                       "detail": "network namespace with loopback only" if ns_ok and no_net
                       else (ns_why or net_why)},
        "private_tmp": {"available": tmp_ok, "detail": tmp_why or "/tmp, /var/tmp, /dev/shm"
                        " of the job's own (tmpfs, counted in its memory), and only its paths"
                        " inside closed directories (of the provider's data and jobs"
                        " directories, only its own work directory)"},
        "resource_limits": {"available": first["resource_limits"][0],
                            "detail": first["resource_limits"][1] or
                            "open files, processes, file size, core dumps"},
        "pid_namespace": {"available": pid_ok, "detail": (
            "a PID namespace of its own with its own /proc: a job sees only its own"
            " processes, and all of them end with it") if pid_ok else pid_why or tmp_why},
        "keyrings": {"available": keys_ok, "detail": keys_why or "a fresh session keyring"
                     " per job; the job uid's user, user session and persistent keyrings"
                     " emptied before its job runs and after it ends"},
    }
    features["job_cgroup"] = _probe_cgroup(cgroup_host)
    features.update(cgroups.limit_features(features))
    return features


def _probe_uid(jobs_dir: str | None, uids: UidRange | None, private: bool,
               private_why: str, pid_namespace: bool = False,
               keyring: bool = False) -> tuple[bool, str]:
    """Whether a job uid (this daemon's first, or a range claimed for the probe) can read
    what a job runs — the runner's modules and torch's libraries (``PROBE_CHECK``) — and
    reach ``jobs_dir``, in the sandbox a job gets (with the private view where this host
    gives it); and why."""
    if os.geteuid() != 0:
        return False, "the daemon is not root, so jobs run as its own user"
    claimed = None
    try:
        if uids is None:
            uids = claimed = claim(f"probe-{os.getpid()}")
    except UidRangeError as exc:
        return False, str(exc)
    try:
        uid = uids.first
        reach = f"\nimport os; os.stat({str(jobs_dir)!r})" if jobs_dir else ""
        box = Sandbox(uid=uid, gid=uid, scratch_bytes=(1 << 20) if private else 0,
                      expose=(jobs_dir,) if jobs_dir else (), pid_namespace=pid_namespace,
                      keyring=keyring)
        ok, why = _attempts({"u": (box, f"exec({PROBE_CHECK + reach!r})")})["u"]
    finally:
        if claimed is not None:
            claimed.release()
    if ok:
        return True, (f"jobs run as uids {uids.first}-{uids.first + uids.size - 1} (this"
                      " daemon's range), one per device")
    if "Permission denied" in why or "No module" in why:
        return False, (f"job uid {uid} cannot reach the provider's Python or {jobs_dir} (a"
                       " directory above them is closed to other users, and no mount"
                       f" namespace can show them: {private_why or 'not root'})")
    return False, f"job uid {uid} cannot run a runner: {why}"


def _probe_cgroup(host: cgroups.CgroupHost | None) -> dict:
    made = None
    try:
        if host is None:
            host = made = cgroups.CgroupHost.detect(f"gpumarket-probe-{os.getpid()}")
        group = host.job(f"probe-{os.getpid()}")
        try:
            group.limit(cgroups.Limits(memory_bytes=256 << 20, pids=64))
            ok, why = _attempts({"c": (Sandbox(cgroups=tuple(group.procs_files)),
                                       "pass")})["c"]
        finally:
            group.kill()
            group.remove()
    except cgroups.CgroupError as exc:
        return {"available": False, "detail": str(exc)}
    finally:
        if made is not None:
            made.remove()
    return {"available": ok, "detail": why or "every process of a job in a group of its"
            f" own, killed at once ({host.describe()})", "holds": host.holds,
            "notes": host.notes}


def for_job(features: dict, uids: UidRange | None, device_indices: list[int],
            disk_quota_bytes: int, cuda: bool, memory_bytes: int,
            cgroup: cgroups.JobCgroup | None = None, expose: tuple[str, ...] = ()) -> Sandbox:
    """The sandbox of one job, from what this host gives (``probe()``): its own uid (from
    this daemon's range, by its lowest device: jobs on other devices never share one), its
    control group, no network, private scratch directories of its disk quota, its own PID
    namespace, fresh keyrings, at most 64 Ki open files, 4 Ki processes of its uid (with or
    without the pids controller), no file larger than its disk quota, no core dumps. Where
    its group does not hold its memory, a CPU job's memory is bounded per process instead
    (address space of its devices' memory + 8 GiB; CUDA reserves far more address space than
    it uses, so GPU jobs go without that limit). ``cgroups.job_limits`` says the same per
    resource."""
    limits = {"NOFILE": 65536, "CORE": 0, "FSIZE": disk_quota_bytes}
    have = lambda name: bool(features.get(name, {}).get("available"))
    uid = None
    if have("unprivileged_user") and uids is not None:
        uid = uids.uid(min(device_indices or [0]))
        limits["NPROC"] = cgroups.PROCESSES   # per uid: meaningless for a job that stays root
    if not cuda and (cgroup is None or not cgroup.holds("memory")):
        limits["AS"] = memory_bytes + 8 * 2**30
    return Sandbox(uid=uid, gid=uid, network=not have("no_network"), limits=limits,
                   cgroups=tuple(cgroup.procs_files) if cgroup is not None else (),
                   scratch_bytes=disk_quota_bytes if have("private_tmp") else 0,
                   expose=expose,
                   pid_namespace=have("pid_namespace") and have("private_tmp"),
                   keyring=have("keyrings"))


def missing_for_code(features: dict) -> list[str]:
    """The protections a job running its own code needs that this host does not give."""
    return [name for name in CODE_NEEDS if not features.get(name, {}).get("available")]


# Run as the job's uid: kill(-1, SIGKILL), the shell's builtin (no interpreter the job's uid
# may not be able to reach); the shell is among the killed.
KILL_ALL = ["/bin/sh", "-c", "kill -9 -1"]


def kill_uid(uid: int, killed: bool = False) -> int:
    """SIGKILL every process of ``uid`` (a job's uid: whatever it left behind, even outside
    its process group and after detaching); return how many were seen alive after a kill
    (0: the first kill ended them all). A child that takes the uid sends ``kill(-1)``, which
    the kernel delivers to all of the uid's processes at once: none forks past it (a fork
    that races it either makes a child the kill reaches or fails, as the parent has the
    signal pending), so one kill ends them all, and a scan of /proc after it verifies that;
    should it show one alive, the kill is sent again until a scan shows none. ``killed``:
    the uid's processes were just sent that kill (keyrings.Ender): scan, kill only if
    needed.

    The child is exec'd, not a bare ``os.fork()`` of the daemon: no Python runs in it
    before the kill (gRPC's fork handlers, which could abort it there, are off in the
    provider: see provider/__init__.py)."""
    seen = 0
    for tries in range(100):
        if tries or not killed:
            subprocess.run(KILL_ALL, user=uid, group=uid, extra_groups=[], close_fds=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env={}, check=False)
        live, dead = _scan(uid)
        seen = max(seen, len(live))
        if not live:
            if dead:
                _await_reaped(uid)
            return seen
    _await_reaped(uid)
    return seen


def _scan(uid: int) -> tuple[list[int], list[int]]:
    """The processes of ``uid``: those alive, and the zombies."""
    out: tuple[list[int], list[int]] = ([], [])
    for pid, status in _statuses():
        if uid in {int(u) for u in status.get("Uid", "").split()[:3]}:
            out[status.get("State", "").strip().startswith("Z")].append(pid)
    return out


def _statuses():
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                yield int(entry), dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue


def _await_reaped(uid: int, timeout_s: float = 5.0) -> None:
    """Wait (a little) until the killed processes of ``uid`` are reaped: until then they
    still count against the next job's process limit (RLIMIT_NPROC is per uid)."""
    import time

    deadline = time.monotonic() + timeout_s
    while processes_of({uid}, zombies=True) and time.monotonic() < deadline:
        time.sleep(0.02)


def reclaim_uid(uid: int) -> int:
    """Make ``uid`` ready for a new job: whatever still runs as it (left by an earlier job
    of that uid, the device's last) is killed first. Returns how many processes were seen."""
    if not processes_of({uid}, zombies=True):
        return 0
    return kill_uid(uid)


def processes_of(uids: set[int], zombies: bool = False) -> dict[int, list[int]]:
    """Processes whose real, effective or saved uid is one of ``uids``, by uid (live ones
    only, unless ``zombies``)."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if not zombies and status.get("State", "").strip().startswith("Z"):
            continue
        for uid in {int(u) for u in status.get("Uid", "").split()[:3]} & uids:
            out.setdefault(uid, []).append(int(entry))
    return out


def close_dirs(data_dir: Path, jobs_dir: Path, traversable: bool) -> None:
    """Close the provider's data and jobs directories to job uids: they may not list them
    (a job sees only its own work directory there: its mount namespace shows it alone, and
    this host gives one unless ``traversable``), and may pass through them only where they
    must reach their work directories without a mount namespace (``traversable``)."""
    mode = os.stat(data_dir).st_mode & 0o7777 & ~0o006
    os.chmod(data_dir, (mode | 0o001) if traversable else mode)
    os.chmod(jobs_dir, 0o711 if traversable else 0o700)


def describe(box: Sandbox, notes: list[str] = ()) -> str:
    limits = ", ".join(f"{k.lower()} {v:,}" for k, v in sorted(box.limits.items()))
    extra = "".join(f", {n}" for n in notes)
    return (f"sandbox: uid {box.uid if box.uid is not None else os.getuid()},"
            f" {'network' if box.network else 'no network'}{extra}, limits: {limits or 'none'}")


def enter(text: str) -> bool:
    """Apply the sandbox given as JSON and say so in the job's log; False if it failed."""
    box = Sandbox.from_json(text)
    try:
        notes = apply(box)
    except SandboxError as exc:
        print(f"error: sandbox: {exc}", file=sys.stderr, flush=True)
        return False
    print(describe(box, notes), flush=True)
    return True


def prepare_host(data_dir: Path, jobs_dir: Path, uids: UidRange | None,
                 cgroup_host: cgroups.CgroupHost | None) -> dict[str, dict]:
    """Make the jobs directory and close it and the data directory to job uids
    (``close_dirs``), then probe."""
    jobs_dir.mkdir(parents=True, exist_ok=True)
    private = _attempts({"p": (Sandbox(scratch_bytes=1 << 20), "pass")})["p"][0]
    close_dirs(data_dir, jobs_dir, traversable=not private)
    return probe(str(jobs_dir), uids, cgroup_host)


def summary(features: dict[str, dict]) -> str:
    return "; ".join(f"{k}: {'yes' if v['available'] else 'no (' + v['detail'] + ')'}"
                     for k, v in features.items())


def _run_job(module: str, workdir: str) -> int:
    text = os.environ.pop(ENV, "")
    if text and not enter(text):
        return 1
    sys.argv = [module, workdir]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def main() -> int:
    if sys.argv[1:] == ["--probe"]:
        print(json.dumps(probe(), indent=2))
        return 0
    if len(sys.argv) != 3:
        print("usage: python -m gpumarket.provider.sandbox MODULE WORKDIR | --probe",
              file=sys.stderr)
        return 2
    return _run_job(sys.argv[1], sys.argv[2])


if __name__ == "__main__":
    sys.exit(main())
