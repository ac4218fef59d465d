"""Job isolation on the provider: what a job process gives up before it touches a job.

A ``Sandbox`` says how far: an unprivileged uid/gid of its own (where the daemon runs as
root), no network (a network namespace of its own with only loopback up, where the kernel
lets us make one), and resource limits (open files, processes of its uid, file size, core
dumps, and address space on CPU jobs). ``apply`` does it, in this order, in the job's own
process: the network first (it needs root), the limits, then the uid. The daemon starts a cold
job as ``python -m gpumarket.provider.sandbox MODULE WORKDIR`` with the sandbox in
``$GPUMARKET_SANDBOX``; a warm runner applies the one in its order before it reads the job.
The disk quota of the work directory is watched by the executor (and no single file may
exceed it: RLIMIT_FSIZE).

    python -m gpumarket.provider.sandbox --probe     # what this host allows, as JSON

No torch, no grpc here: this runs before anything else in a job process.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import resource
import runpy
import socket
import struct
import subprocess
import sys
from dataclasses import asdict, dataclass, field

ENV = "GPUMARKET_SANDBOX"
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
JOB_UID_BASE = 61000          # job uids: this + the lowest leased device index
LIMITS = ("NOFILE", "NPROC", "FSIZE", "CORE", "AS")


@dataclass(frozen=True)
class Sandbox:
    uid: int | None = None             # None: keep the daemon's
    gid: int | None = None
    network: bool = True               # False: a network namespace with only loopback
    limits: dict[str, int] = field(default_factory=dict)   # RLIMIT_<NAME> -> soft = hard

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Sandbox":
        raw = json.loads(text)
        return cls(uid=raw.get("uid"), gid=raw.get("gid"), network=bool(raw.get("network")),
                   limits={k: int(v) for k, v in (raw.get("limits") or {}).items()
                           if k in LIMITS})


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


def apply(box: Sandbox) -> None:
    """Give up what ``box`` says, for good; raise SandboxError if any of it fails (the job
    must not run half-isolated)."""
    if not box.network:
        _unshare_network()
    for name, value in box.limits.items():
        which = getattr(resource, f"RLIMIT_{name}")
        hard = resource.getrlimit(which)[1]
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)       # lower only: raising needs CAP_SYS_RESOURCE
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError) as exc:
            raise SandboxError(f"cannot set RLIMIT_{name} to {value} ({exc})") from exc
    if box.uid is not None:
        try:
            os.setgroups([])
            os.setgid(box.gid if box.gid is not None else box.uid)
            os.setuid(box.uid)
        except OSError as exc:
            raise SandboxError(f"cannot run as uid {box.uid} ({exc.strerror})") from exc


def probe(jobs_dir: str | None = None) -> dict[str, dict]:
    """What this host gives: each feature tried for real in a child process. A job uid is
    only usable if it can reach ``jobs_dir`` (every directory above it open to others)."""
    def attempt(box: Sandbox, check: str) -> tuple[bool, str]:
        code = ("import sys; from gpumarket.provider import sandbox as s; "
                f"s.apply(s.Sandbox.from_json({box.to_json()!r})); {check}")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60)
        lines = (r.stderr or r.stdout).strip().splitlines()
        return r.returncode == 0, lines[-1] if lines else ""

    root = os.geteuid() == 0
    reach = f"os.stat({str(jobs_dir)!r})" if jobs_dir else "pass"
    user_ok, user_why = attempt(Sandbox(uid=JOB_UID_BASE, gid=JOB_UID_BASE),
                                f"import os; assert os.getuid() != 0; {reach}")
    if not root and not user_ok:
        user_why = "the daemon is not root, so jobs run as its own user"
    if root and not user_ok and "Permission denied" in user_why:
        user_why = (f"a job uid cannot reach {jobs_dir} (a directory above it is closed to"
                    " other users: chmod o+x it, or move the data directory)")
    net_ok, net_why = attempt(
        Sandbox(network=False),
        "import socket; socket.create_connection(('192.0.2.1', 9), timeout=2)")
    # connecting to an outside address must fail inside the namespace: success means leaky
    no_net = not net_ok and "unreachable" in net_why.lower()
    ns_ok, ns_why = attempt(Sandbox(network=False), "pass")
    limits_ok, limits_why = attempt(Sandbox(limits={"NOFILE": 256, "CORE": 0}), "pass")
    return {
        "unprivileged_user": {"available": user_ok, "detail": user_why or "jobs run as uid"
                              f" {JOB_UID_BASE} + device index"},
        "no_network": {"available": ns_ok and no_net,
                       "detail": "network namespace with loopback only" if ns_ok and no_net
                       else (ns_why or net_why)},
        "resource_limits": {"available": limits_ok, "detail": limits_why or
                            "open files, processes, file size, core dumps, address space"},
    }


def for_job(features: dict, device_indices: list[int], memory_bytes: int, cuda: bool,
            disk_quota_bytes: int) -> Sandbox:
    """The sandbox of one job, from what this host gives (``probe()``): its own uid (the job
    uid base + its lowest device index: jobs on other devices never share one), no network,
    at most 64 Ki open files, 4 Ki processes of its uid, no file larger than its disk quota,
    no core dumps, and on the CPU an address space of its devices' memory + 8 GiB (CUDA
    reserves far more address space than it uses, so GPU jobs go without that limit)."""
    limits = {"NOFILE": 65536, "CORE": 0, "FSIZE": disk_quota_bytes}
    uid = None
    if features.get("unprivileged_user", {}).get("available"):
        uid = JOB_UID_BASE + min(device_indices or [0])
        limits["NPROC"] = 4096      # counted per uid: meaningless for a job that stays root
    if not cuda:
        limits["AS"] = memory_bytes + 8 * 2**30
    return Sandbox(uid=uid, gid=uid,
                   network=not features.get("no_network", {}).get("available"), limits=limits)


def kill_uid(uid: int) -> int:
    """SIGKILL every process of ``uid`` (a job's uid: whatever it left behind, even outside
    its process group); return how many."""
    import signal

    killed = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
        except (OSError, StopIteration):
            continue
        if str(uid) in uids:
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed


def open_traversal(*dirs) -> None:
    """Let job uids pass through these directories (x for all, never r): a job reaches its
    own work directory and nothing else there that is not world-readable."""
    for d in dirs:
        mode = os.stat(d).st_mode & 0o7777
        if mode & 0o111 != 0o111:
            os.chmod(d, mode | 0o111)


def describe(box: Sandbox) -> str:
    limits = ", ".join(f"{k.lower()} {v:,}" for k, v in sorted(box.limits.items()))
    return (f"sandbox: uid {box.uid if box.uid is not None else os.getuid()},"
            f" {'network' if box.network else 'no network'}, limits: {limits or 'none'}")


def enter(text: str) -> bool:
    """Apply the sandbox given as JSON and say so in the job's log; False if it failed."""
    box = Sandbox.from_json(text)
    try:
        apply(box)
    except SandboxError as exc:
        print(f"error: sandbox: {exc}", file=sys.stderr, flush=True)
        return False
    print(describe(box), flush=True)
    return True


def prepare_host(data_dir, jobs_dir) -> dict[str, dict]:
    """Open the way to the jobs' work directories for job uids, then probe."""
    jobs_dir.mkdir(parents=True, exist_ok=True)
    open_traversal(data_dir, jobs_dir)
    return probe(str(jobs_dir))


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
