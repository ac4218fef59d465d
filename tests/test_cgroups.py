"""Job cgroups with what the host delegates (provider/cgroups.py): each controller enabled on
its own, the limits a missing one leaves to the sandbox (RLIMIT_NPROC of the job's own uid,
no CPU cap), no nesting when a daemon starts again or a second one starts beside it, and what
doctor and the offer say about it.

What is real and what is simulated: this machine is a hybrid host (the v1 controllers, and
cgroup v2 mounted at /sys/fs/cgroup/unified with no controller, since all of them are bound
to v1 hierarchies that hold other groups), so a v2 group delegated `memory` alone cannot be
made on it. The v2 rules (what a group was delegated, one write per controller, a refused
one, the no-internal-processes rule, the daemon's leaf) are tested on a tree of files that
acts like cgroupfs for them (FakeCgroupFs); the layout without nesting on this machine's real
v2 hierarchy; and a real provider and real `script` jobs run end to end on a host that gives
`memory` alone (a mount namespace showing only the v1 memory hierarchy and the v2 one) and on
this machine's own layout."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest

from gpumarket.proto.envelope import open_envelope
from gpumarket.proto.identity import Identity
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider import cgroups, sandbox
from gpumarket.provider.cgroups import CgroupError, CgroupFs, CgroupHost, Limits
from tests.helpers import BIN, Process

ALL_V2 = "cpuset cpu io memory hugetlb pids rdma misc"


class FakeCgroupFs(CgroupFs):
    """A tree of files that acts like cgroupfs for what the daemon reads and writes.

    v2 (under ``tmp/v2``): a new group gets its interface files, ``cgroup.controllers`` being
    its parent's ``cgroup.subtree_control`` and one file per enabled controller;
    ``cgroup.subtree_control`` takes ``+c``/``-c`` words all or nothing, only of controllers
    in the group's ``cgroup.controllers`` (ENOENT), never while a non-root group holds
    processes (EBUSY), and ``refuse`` refuses some anyway (as the kernel refuses ``cpu``
    while a realtime process runs); ``cgroup.procs`` moves a pid, never into a non-root group
    with enabled controllers (EBUSY); a write never makes a file. v1 (``tmp/v1-<c>``, as
    ``v1`` names): plain groups with their controller's files."""

    FILES: ClassVar = {"memory": ("memory.max", "memory.swap.max", "memory.events"),
                       "pids": ("pids.max",), "cpu": ("cpu.max",)}
    V1_FILES: ClassVar = {"memory": ("memory.limit_in_bytes", "memory.oom_control"),
                          "pids": ("pids.max",),
                          "cpu": ("cpu.cfs_period_us", "cpu.cfs_quota_us")}

    def __init__(self, tmp: Path, own: str = "/", delegated: str = ALL_V2,
                 root_controllers: str = ALL_V2, procs: tuple[int, ...] = (100, 101),
                 refuse: dict[str, int] | None = None, v1: tuple[str, ...] = ()) -> None:
        super().__init__(tmp / "proc")
        self.tmp, self.v2 = tmp, tmp / "v2"
        self.refuse = refuse or {}
        self.proc.mkdir()
        mounts = [f"30 1 0:30 / {self.v2} rw,relatime - cgroup2 cgroup2 rw"]
        lines = ["0::" + own]
        for n, c in enumerate(v1):
            (tmp / f"v1-{c}").mkdir()
            self._v1_files(tmp / f"v1-{c}", c)
            mounts.append(f"{31 + n} 1 0:{31 + n} / {tmp / f'v1-{c}'} rw - cgroup cgroup rw,{c}")
            lines.append(f"{n + 1}:{c}:/")
        (self.proc / "mountinfo").write_text("\n".join(mounts) + "\n")
        (self.proc / "cgroup").write_text("\n".join(reversed(lines)) + "\n")
        self.v2.mkdir()
        for name, text in (("cgroup.controllers", root_controllers),
                           ("cgroup.subtree_control", ""), ("cgroup.procs", "")):
            (self.v2 / name).write_text(text)
        d = self.v2
        for part in [p for p in own.split("/") if p]:
            (d / "cgroup.subtree_control").write_text(delegated)    # the parent's doing
            self.mkdir(d / part)
            d = d / part
        (d / "cgroup.procs").write_text("".join(f"{p}\n" for p in procs))

    def sit_in(self, cgroup: str) -> None:
        """This process is in ``cgroup`` (v2) from now on, as after a restart there."""
        lines = (self.proc / "cgroup").read_text().splitlines()
        (self.proc / "cgroup").write_text("\n".join([*lines[:-1], "0::" + cgroup]) + "\n")

    def _v1_files(self, d: Path, controller: str) -> None:
        for name in ("cgroup.procs", *self.V1_FILES[controller]):
            (d / name).write_text("")

    def _fail(self, path: Path, value: str, code: int):
        raise CgroupError(f"cannot write {value!r} to {path} ({os.strerror(code)})")

    def mkdir(self, path: Path) -> None:
        if path.is_dir():
            return
        if not path.parent.is_dir():
            raise CgroupError(f"cannot make {path} (No such file or directory)")
        path.mkdir()
        if not path.is_relative_to(self.v2):
            self._v1_files(path, next(c for c in self.V1_FILES if f"v1-{c}" in str(path)))
            return
        on = (path.parent / "cgroup.subtree_control").read_text()
        for name, text in (("cgroup.controllers", on), ("cgroup.subtree_control", ""),
                           ("cgroup.procs", ""), ("cgroup.type", "domain\n"),
                           ("cgroup.kill", "")):
            (path / name).write_text(text)
        self._controller_files(path)

    def _controller_files(self, d: Path) -> None:
        on = set((d / "cgroup.controllers").read_text().split())
        for c, names in self.FILES.items():
            for name in names:
                if c in on and not (d / name).exists():
                    (d / name).write_text("max\n" if name.endswith(".max") else "")
                elif c not in on:
                    (d / name).unlink(missing_ok=True)

    def write(self, path: Path, value: str) -> None:
        if not path.is_file():
            self._fail(path, value, errno.ENOENT)
        d, name = path.parent, path.name
        if d.is_relative_to(self.v2) and name == "cgroup.subtree_control":
            self._subtree(d, path, value)
        elif name == "cgroup.procs":
            tree = self.v2 if d.is_relative_to(self.v2) else d.parent
            if d != self.v2 and d.is_relative_to(self.v2) \
                    and (d / "cgroup.subtree_control").read_text().split():
                self._fail(path, value, errno.EBUSY)
            for f in tree.rglob("cgroup.procs"):
                f.write_text("".join(f"{p}\n" for p in f.read_text().split() if p != value))
            path.write_text(path.read_text() + f"{value}\n")
        else:
            path.write_text(value)

    def _subtree(self, d: Path, path: Path, value: str) -> None:
        have = set((d / "cgroup.controllers").read_text().split())
        on = set(path.read_text().split())
        for word in value.split():
            c = word[1:]
            if word[0] not in "+-" or c not in have:
                self._fail(path, value, errno.ENOENT)
            if c in self.refuse:
                self._fail(path, value, self.refuse[c])
            if word[0] == "+" and d != self.v2 and (d / "cgroup.procs").read_text().split():
                self._fail(path, value, errno.EBUSY)
        for word in value.split():
            (on.add if word[0] == "+" else on.discard)(word[1:])
        path.write_text(" ".join(sorted(on)))
        for child in d.iterdir():
            if child.is_dir():
                (child / "cgroup.controllers").write_text(" ".join(sorted(on)))
                self._controller_files(child)

    def rmdir(self, path: Path) -> None:
        if any(p.is_dir() for p in path.iterdir()) or (path / "cgroup.procs").read_text().split():
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        shutil.rmtree(path)


def words(path: Path) -> set[str]:
    return set(path.read_text().split())


def features_of(host: CgroupHost, **available: bool) -> dict:
    """probe()'s answer on a host with these groups (every other protection there unless
    ``available`` says otherwise)."""
    features = {name: {"available": available.get(name, True), "detail": ""}
                for name in ("unprivileged_user", "no_network", "private_tmp",
                             "resource_limits")}
    features["job_cgroup"] = {"available": True, "detail": host.describe(),
                              "holds": host.holds, "notes": host.notes}
    features.update(cgroups.limit_features(features))
    return features


# -- the v2 rules, on a tree that acts like cgroupfs --------------------------------------------

def test_a_group_delegated_memory_alone_limits_memory_and_runs_script_jobs(tmp_path):
    """The host of issue 31: the daemon's own group was delegated `memory` only, while the
    root has every controller. Memory is enabled on its own, the daemon's group's processes
    move into its leaf, and the rest falls back: RLIMIT_NPROC of the job's uid, no CPU cap."""
    fs = FakeCgroupFs(tmp_path, own="/process_api/x", delegated="memory")
    host = CgroupHost.detect("gpumarket-a", fs)
    p = fs.v2 / "process_api" / "x"
    assert host.v2 == p / "gpumarket-a"
    assert host.v2_controllers == {"memory"} and host.holds == {"memory": "cgroup v2"}
    assert words(p / "cgroup.subtree_control") == {"memory"}
    assert words(host.v2 / "cgroup.subtree_control") == {"memory"}
    assert words(p / "daemon" / "cgroup.procs") == {"100", "101"}
    assert not words(p / "cgroup.procs")
    assert set(host.notes) == {"pids", "cpu"}
    assert "not delegated" in host.notes["pids"], host.notes
    assert "no pids, cpu controller" in host.describe()

    group = host.job("job.1")
    group.limit(Limits(memory_bytes=1 << 30, pids=4096, cpus=2.0))
    d = host.v2 / "job.1"
    assert (d / "memory.max").read_text() == str(1 << 30)
    assert (d / "memory.swap.max").read_text() == "0"
    assert not (d / "pids.max").exists() and not (d / "cpu.max").exists()
    assert group.procs_files == [str(d / "cgroup.procs")]
    assert group.holds("memory") and not group.holds("pids")

    features = features_of(host)
    assert cgroups.job_limits(features, cuda=False) == {
        "memory": "cgroup v2", "pids": "rlimit", "cpu": "none"}
    assert cgroups.job_limits(features, cuda=True) == {
        "memory": "cgroup v2", "pids": "rlimit", "cpu": "none"}
    assert features["memory_limit"]["available"] and features["process_limit"]["available"]
    assert not features["cpu_limit"]["available"]
    assert "RLIMIT_NPROC" in features["process_limit"]["detail"]
    assert sandbox.missing_for_code(features) == []       # a script job runs here
    box = sandbox.for_job(features, _uids(), [0], 1 << 30, False, 8 << 30, group)
    assert box.limits["NPROC"] == cgroups.PROCESSES and "AS" not in box.limits
    assert box.cgroups == (str(d / "cgroup.procs"),)


def _uids():
    from gpumarket.provider.job_uids import UidRange

    return UidRange(first=70000, size=64)


def test_a_restarted_daemon_and_a_second_one_reuse_the_layout(tmp_path):
    fs = FakeCgroupFs(tmp_path, own="/process_api/x", delegated="memory pids")
    first = CgroupHost.detect("gpumarket-a", fs)
    p = fs.v2 / "process_api" / "x"
    fs.sit_in("/process_api/x/daemon")          # where the first start moved it
    again = CgroupHost.detect("gpumarket-a", fs)
    second = CgroupHost.detect("gpumarket-b", fs)
    assert again.v2 == first.v2 == p / "gpumarket-a"
    assert second.v2 == p / "gpumarket-b"
    assert again.v2_controllers == second.v2_controllers == {"memory", "pids"}
    assert sorted(d.name for d in p.iterdir() if d.is_dir()) == [
        "daemon", "gpumarket-a", "gpumarket-b"]
    assert not [d for d in (p / "daemon").iterdir() if d.is_dir()], "nested below the leaf"


def test_a_refused_controller_leaves_the_others_enabled(tmp_path):
    fs = FakeCgroupFs(tmp_path, own="/svc", delegated="memory pids cpu",
                      refuse={"cpu": errno.EINVAL})
    host = CgroupHost.detect("gpumarket-a", fs)
    assert host.v2_controllers == {"memory", "pids"}
    assert set(host.notes) == {"cpu"} and "Invalid argument" in host.notes["cpu"]
    assert cgroups.job_limits(features_of(host), cuda=False) == {
        "memory": "cgroup v2", "pids": "cgroup v2", "cpu": "none"}


def test_a_group_delegated_everything_keeps_every_limit(tmp_path):
    fs = FakeCgroupFs(tmp_path, own="/system.slice/gpumarket-provider.service",
                      delegated="cpu io memory pids")
    host = CgroupHost.detect("gpumarket-a", fs)
    assert host.v2_controllers == {"memory", "pids", "cpu"} and not host.notes
    group = host.job("job.1")
    group.limit(Limits(memory_bytes=1 << 30, pids=4096, cpus=2.0))
    d = host.v2 / "job.1"
    assert (d / "pids.max").read_text() == "4096"
    assert (d / "cpu.max").read_text() == "200000 100000"
    assert cgroups.job_limits(features_of(host), cuda=False) == {
        "memory": "cgroup v2", "pids": "cgroup v2", "cpu": "cgroup v2"}
    group.remove()
    host.remove()
    assert not host.v2.exists()


def test_the_root_group_keeps_its_processes(tmp_path):
    """In the root group (no cgroup.type) processes may sit beside enabled controllers:
    nothing moves."""
    fs = FakeCgroupFs(tmp_path, own="/", root_controllers="memory pids cpu")
    host = CgroupHost.detect("gpumarket-a", fs)
    assert host.v2 == fs.v2 / "gpumarket-a"
    assert host.v2_controllers == {"memory", "pids", "cpu"}
    assert words(fs.v2 / "cgroup.procs") == {"100", "101"}
    assert not (fs.v2 / "daemon").exists()


def test_a_hybrid_host_tracks_in_v2_and_limits_with_what_v1_has(tmp_path):
    """This machine's shape, with only the v1 memory hierarchy: v2 holds and kills (no
    controller there), v1 limits memory, the rest falls back."""
    fs = FakeCgroupFs(tmp_path, own="/", root_controllers="hugetlb", v1=("memory",))
    host = CgroupHost.detect("gpumarket-a", fs)
    assert host.v2 == fs.v2 / "gpumarket-a" and host.v2_controllers == set()
    assert host.v1 == {"memory": tmp_path / "v1-memory" / "gpumarket-a"}
    assert host.holds == {"memory": "cgroup v1"}
    group = host.job("job.1")
    group.limit(Limits(memory_bytes=1 << 30, pids=4096, cpus=2.0))
    assert (host.v1["memory"] / "job.1" / "memory.limit_in_bytes").read_text() == str(1 << 30)
    assert len(group.procs_files) == 2        # v2 (to kill it all at once) and v1 memory
    assert cgroups.job_limits(features_of(host), cuda=False) == {
        "memory": "cgroup v1", "pids": "rlimit", "cpu": "none"}


def test_a_group_delegated_nothing_still_kills_the_whole_job(tmp_path):
    """No controller anywhere: the job still gets a group (every process killed at once),
    its memory is bounded per process on CPU jobs, and code of its own is refused."""
    fs = FakeCgroupFs(tmp_path, own="/user.slice/x", delegated="", root_controllers="memory")
    host = CgroupHost.detect("gpumarket-a", fs)
    assert host.v2 is not None and host.holds == {}
    assert words(fs.v2 / "user.slice" / "x" / "cgroup.procs") == {"100", "101"}   # not moved
    features = features_of(host)
    assert cgroups.job_limits(features, cuda=False) == {
        "memory": "rlimit", "pids": "rlimit", "cpu": "none"}
    assert cgroups.job_limits(features, cuda=True)["memory"] == "none"
    assert sandbox.missing_for_code(features) == ["memory_limit"]
    box = sandbox.for_job(features, _uids(), [0], 1 << 30, False, 8 << 30, host.job("j.1"))
    assert box.limits["AS"] == 16 << 30
    box = sandbox.for_job(features, _uids(), [0], 1 << 30, True, 8 << 30, host.job("j.2"))
    assert "AS" not in box.limits


def test_without_a_job_uid_there_is_no_process_limit_but_the_pids_controller(tmp_path):
    fs = FakeCgroupFs(tmp_path, own="/x", delegated="memory")
    features = features_of(CgroupHost.detect("gpumarket-a", fs), unprivileged_user=False)
    assert cgroups.job_limits(features, cuda=False)["pids"] == "none"
    assert not features["process_limit"]["available"]
    assert "unprivileged_user" in sandbox.missing_for_code(features)


def test_no_cgroup_filesystem_is_one_clear_error(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "cgroup").write_text("0::/\n")
    (tmp_path / "proc" / "mountinfo").write_text("")
    with pytest.raises(CgroupError, match="no cgroup filesystem"):
        CgroupHost.detect("gpumarket-a", CgroupFs(tmp_path / "proc"))


def test_a_bind_mounted_subtree_is_found_below_its_root():
    m = cgroups.Mount(Path("/sys/fs/cgroup"), "/docker/abc")
    assert m.dir("/docker/abc/daemon") == Path("/sys/fs/cgroup/daemon")
    assert m.dir("/elsewhere") == Path("/sys/fs/cgroup/elsewhere")
    assert cgroups.Mount(Path("/sys/fs/cgroup"), "/").dir("/a/b") == Path("/sys/fs/cgroup/a/b")


# -- what the offer says -----------------------------------------------------------------

def test_the_offer_says_how_each_limit_holds(tmp_path):
    from gpumarket.client.offers import limits_text
    from gpumarket.client.query import parse
    from gpumarket.provider.config import ProviderConfig
    from gpumarket.provider.inventory import cpu_devices
    from gpumarket.provider.offering import build_offer

    identity = Identity.generate()
    config = ProviderConfig(broker="", data_dir=tmp_path)
    devices = cpu_devices(1)
    env = build_offer(config, identity, devices, {}, {pb.JOB_KIND_SCRIPT}, frozenset(),
                      True, {"memory": "cgroup v2", "pids": "rlimit", "cpu": "none"})
    offer, _ = open_envelope(env, pb.Offer)
    assert offer.job_limits == pb.JobLimits(memory=pb.LIMIT_METHOD_CGROUP_V2,
                                            pids=pb.LIMIT_METHOD_RLIMIT,
                                            cpu=pb.LIMIT_METHOD_NONE)
    assert limits_text(offer) == "memory:cgroup-v2 pids:rlimit cpu:none"
    row = {"limits": limits_text(offer)}
    assert all(c.matches(row) for c in parse("limits=memory:cgroup"))
    assert not all(c.matches(row) for c in parse("limits=pids:cgroup"))
    older, _ = open_envelope(build_offer(config, identity, devices, {}, {pb.JOB_KIND_SCRIPT},
                                         frozenset()), pb.Offer)
    assert limits_text(older) == "unknown"
    odd = pb.Offer(job_limits=pb.JobLimits(memory=99))     # a provider's number we do not know
    assert limits_text(odd) == "memory:unknown pids:unknown cpu:unknown"


# -- on this machine's real cgroups ------------------------------------------------------------

def _own_v2_group() -> Path | None:
    """This process's group in the real v2 hierarchy, where this test may make groups."""
    fs = CgroupFs()
    v2, _ = fs.mounts()
    own = fs.own_paths().get("")
    if os.geteuid() != 0 or v2 is None or own is None:
        return None
    here = v2.dir(own)
    return here if os.access(here, os.W_OK) else None


DETECT = """
import json, sys
from gpumarket.provider.cgroups import CgroupHost
sys.stdin.readline()                # until the test has moved it into its group
host = CgroupHost.detect(sys.argv[1])
print(json.dumps({"v2": str(host.v2), "controllers": sorted(host.v2_controllers)}))
host.remove()
"""


def _detect_in(group: Path, name: str) -> dict:
    """CgroupHost.detect(name) run by a process that sits in ``group``."""
    child = subprocess.Popen([sys.executable, "-c", DETECT, name], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        (group / "cgroup.procs").write_text(str(child.pid))
        out, err = child.communicate("go\n", timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    return json.loads(out)


@pytest.mark.skipif(_own_v2_group() is None, reason="needs root and a cgroup v2 hierarchy")
def test_on_this_machines_v2_hierarchy_a_restarted_daemon_does_not_nest():
    """Real groups: a daemon that finds itself in the leaf `daemon` (where an earlier start
    moved it) makes its directory beside the leaf, and one started in the group itself
    makes its own beside that."""
    p = _own_v2_group() / f"gpumarket-test-{os.getpid()}"
    made = [p, p / "daemon"]
    for d in made:
        d.mkdir()
    try:
        restarted = _detect_in(p / "daemon", "gpumarket-a")
        beside = _detect_in(p, "gpumarket-b")
        assert restarted["v2"] == str(p / "gpumarket-a")
        assert beside["v2"] == str(p / "gpumarket-b")
        assert not [d for d in (p / "daemon").iterdir() if d.is_dir()]
    finally:
        for d in [p / "gpumarket-a", p / "gpumarket-b", *reversed(made)]:
            if d.is_dir():
                d.rmdir()


# A host whose cgroups give `memory` alone, built from this machine (a hybrid host) in a
# mount namespace of the provider's own: /sys/fs/cgroup shows the v2 hierarchy (no
# controllers) and the v1 memory hierarchy, nothing else. The kernel enforces that memory
# hierarchy as on any host; pids and cpu are not there for the provider to use.
MEMORY_ONLY = ("umount -R /sys/fs/cgroup"
               " && mount -t tmpfs -o mode=755 gpumarket-memory-only /sys/fs/cgroup"
               " && mkdir /sys/fs/cgroup/unified /sys/fs/cgroup/memory"
               " && mount -t cgroup2 cgroup2 /sys/fs/cgroup/unified"
               " && mount -t cgroup -o memory cgroup /sys/fs/cgroup/memory"
               ' && exec "$@"')
# Memory-only: the host's memory in 16 shares (a device each, 1.5 GiB here), for a job to
# exceed its own.
CPU_DEVICES = {"memory-only": 16, "this-host": 1}

SCRIPT = """
import json, os, resource, sys
from gpumarket.provider.runners import task
hog = b"x" * (int(sys.argv[1]) << 20) if sys.argv[1:] else b""     # every page touched
(task.output_dir() / "seen.json").write_text(json.dumps({
    "uid": os.getuid(), "nproc": resource.getrlimit(resource.RLIMIT_NPROC),
    "as": resource.getrlimit(resource.RLIMIT_AS)}))
"""


def _memory_only_host() -> str:
    """Why a memory-only host cannot be built here ("" where it can)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return "needs root and unshare(1)"
    v2, v1 = CgroupFs().mounts()
    if v2 is None or v2.path != Path("/sys/fs/cgroup/unified") or "memory" not in v1 \
            or v1["memory"].path != Path("/sys/fs/cgroup/memory"):
        return "not a hybrid cgroup host (v1 memory at /sys/fs/cgroup/memory, v2 beside it)"
    return ""


def _this_hosts_limits() -> str:
    host = CgroupHost.detect(f"gpumarket-expect-{os.getpid()}")
    host.remove()
    held = {"memory": "rlimit", "pids": "rlimit", "cpu": "none", **host.holds}
    return " ".join(f"{k}:{held[k].replace(' ', '-')}" for k in ("memory", "pids", "cpu"))


def _script_job(path: Path, *args: str) -> Path:
    (path.parent / "limits.py").write_text(SCRIPT)
    path.write_text(f"""
name = "limits"
kind = "script"
max_price = 2.0
max_attempts = 1

[script]
code = "limits.py"
args = {json.dumps(list(args))}
""")
    return path


@pytest.mark.e2e
@pytest.mark.skipif(bool(_memory_only_host()), reason=_memory_only_host() or "-")
@pytest.mark.parametrize("layout", ["memory-only", "this-host"])
def test_a_real_provider_runs_script_jobs_with_the_limits_its_host_gives(market, tmp_path,
                                                                         layout, monkeypatch):
    """A real provider, on a host whose cgroups give memory alone and on this machine as it
    is, offers script jobs, says in its offer and in doctor how each limit holds, and runs
    them: the job's own uid with RLIMIT_NPROC, no RLIMIT_AS where its group holds its
    memory, and a job over its memory share killed by the kernel."""
    wrap = ["unshare", "-m", "--propagation", "private", "sh", "-c", MEMORY_ONLY, "sh"] \
        if layout == "memory-only" else []
    expected = "memory:cgroup-v1 pids:rlimit cpu:none" if wrap else _this_hosts_limits()
    data = tmp_path / "p1"
    data.mkdir()
    # Figures cached for its devices, as a provider started before left them: measuring 16
    # devices takes half a minute here, and is not what this test is about.
    from gpumarket.provider import benchmark
    from gpumarket.provider.inventory import cpu_devices

    monkeypatch.setattr(benchmark, "measure", lambda device: pb.Benchmark(
        matmul_flops=2e10, matmul_dtype="fp32", memory_bandwidth_bytes_per_s=5e9))
    benchmark.cached_benchmarks(cpu_devices(CPU_DEVICES[layout]), data / "benchmark.json")
    market.providers["p1"] = Process(
        [*wrap, str(BIN / "gpumarket-provider"), "run", "--broker", market.address,
         "--data-dir", str(data), "--price", "1.0", "--kinds", "script",
         "--cpu-devices", str(CPU_DEVICES[layout])], tmp_path / "p1.log", market.env)
    offers = market.wait_for_offers(1)
    assert offers[0]["kind"] == ["script"], market.providers["p1"].text()
    assert offers[0]["limits"] == expected
    r = market.cli("offers", "limits=memory:cgroup")
    assert r.returncode == 0 and expected in r.stdout.replace("\n", " "), r.stdout + r.stderr

    doctor = subprocess.Popen([*wrap, str(BIN / "gpumarket-provider"), "doctor",
                               "--data-dir", str(data), "--json"], env=market.env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    jobs = [_script_job(tmp_path / "fits.toml")]
    if wrap:        # one over its memory share (this host's memory limit: test_isolation.py)
        share = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // CPU_DEVICES[layout]
        jobs.append(_script_job(tmp_path / "hog.toml", str((share >> 20) + 256)))
    ids = []
    for path in jobs:
        r = market.cli("submit", str(path))
        assert r.returncode == 0, r.stderr
        ids.append(r.stdout.split()[0])

    out, err = doctor.communicate(timeout=300)
    assert doctor.returncode == 0, err
    report = json.loads(out)
    assert report["memory_limit"]["available"] and report["jobs_own_code"]["available"]
    assert [report[k]["how"] for k in ("memory_limit", "process_limit", "cpu_limit")] == [
        x.split(":")[1].replace("-", " ") for x in expected.split()]

    market.wait_state(ids[0], "SUCCEEDED", timeout=180)
    r = market.cli("results", ids[0], "-o", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    seen = json.loads((tmp_path / "out" / "seen.json").read_text())
    assert seen["uid"] != 0 and seen["nproc"] == [cgroups.PROCESSES] * 2, seen
    assert seen["as"] == [-1, -1], seen       # memory held by its group, not per process
    if wrap:
        job = market.wait_state(ids[1], "FAILED", timeout=180)
        assert "ran out of memory" in job["error"], job
