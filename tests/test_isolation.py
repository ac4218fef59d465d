"""Job isolation on the provider, attacked from inside a job: a runner that tries to read
the daemon's key, reach the network, fork-bomb and fill the disk, run through the same
executor and sandbox a leased job gets (provider/executor.py, provider/sandbox.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from gpumarket.provider import cgroups, job_uids, sandbox
from gpumarket.provider.executor import JobProcess, job_env

ROOT = Path(__file__).resolve().parent.parent
# The uids these tests' jobs run as: a range of their own, as a daemon claims one.
UIDS = job_uids.claim(f"tests-{os.getpid()}") if os.geteuid() == 0 else None
JOB_UID = UIDS.first if UIDS else None
FEATURES = sandbox.probe(uids=UIDS)
needs_root = pytest.mark.skipif(not FEATURES["unprivileged_user"]["available"],
                                reason=FEATURES["unprivileged_user"]["detail"])
needs_netns = pytest.mark.skipif(not FEATURES["no_network"]["available"],
                                 reason=FEATURES["no_network"]["detail"])
needs_cgroup = pytest.mark.skipif(not FEATURES["job_cgroup"]["available"],
                                  reason=FEATURES["job_cgroup"]["detail"])
needs_private_tmp = pytest.mark.skipif(not FEATURES["private_tmp"]["available"],
                                       reason=FEATURES["private_tmp"]["detail"])
PID_NAMESPACE = FEATURES.get("pid_namespace", {"available": False, "detail": "not probed"})
KEYRINGS = FEATURES.get("keyrings", {"available": False, "detail": "not probed"})
needs_pid_namespace = pytest.mark.skipif(not PID_NAMESPACE["available"],
                                         reason=PID_NAMESPACE["detail"])
needs_keyrings = pytest.mark.skipif(not KEYRINGS["available"], reason=KEYRINGS["detail"])


@pytest.fixture(autouse=True)
def reaper():
    """After each test (its assertions made), whatever its jobs left behind goes, whether or
    not the code under test managed it: a survivor of a failed run would load the machine
    for every later test."""
    yield
    if UIDS is not None:
        for uid in sandbox.processes_of(set(range(UIDS.first, UIDS.first + UIDS.size))):
            sandbox.kill_uid(uid)


@pytest.fixture(scope="module")
def groups():
    """This test module's control-group directory, as a daemon makes one."""
    host = cgroups.CgroupHost.detect(f"gpumarket-tests-{os.getpid()}")
    yield host
    for key in host.keys():
        group = host.job(key)
        group.kill()
        group.remove()
    host.remove()


@pytest.fixture
def base():
    """A data directory that job uids can reach (pytest's own tmp dirs are closed to them)."""
    d = Path(tempfile.mkdtemp(prefix="gpumarket-iso-", dir="/tmp"))
    d.chmod(0o755)
    (d / "jobs").mkdir(mode=0o711)
    key = d / "provider.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def run_hostile(base: Path, attack: dict, box: sandbox.Sandbox, quota: int = 0,
                name: str = "j.1", group: cgroups.JobCgroup | None = None
                ) -> tuple[str, object]:
    workdir = base / "jobs" / name
    workdir.mkdir()
    (workdir / "job.json").write_text(json.dumps(attack))
    env = {**job_env(workdir, "", None), "PYTHONPATH": str(ROOT)}
    if group is not None:
        box = sandbox.Sandbox(**{**box.__dict__, "cgroups": tuple(group.procs_files)})

    async def go():
        async def ignore(report):
            pass

        proc = JobProcess("tests.hostile_job", workdir, env, ignore, 120, 2.0, None, box, quota,
                          group)
        outcome = await proc.run()
        sandbox_pid = proc.pid
        return outcome, sandbox_pid

    outcome, pid = asyncio.run(go())
    try:
        os.killpg(pid, signal.SIGKILL)   # what the job left behind (fork bomb children)
    except (ProcessLookupError, PermissionError):
        pass
    return (workdir / "job.log").read_text(), outcome


def box(**kw) -> sandbox.Sandbox:
    """The sandbox a job gets on this host (its uid, no network, private scratch, limits),
    with ``kw`` changed."""
    private = FEATURES["private_tmp"]["available"]
    defaults = dict(uid=JOB_UID, gid=JOB_UID, network=False,
                    limits={"NOFILE": 1024, "NPROC": 64, "CORE": 0, "FSIZE": 8 << 20},
                    scratch_bytes=(16 << 20) if private else 0,
                    expose=(),
                    pid_namespace=private and PID_NAMESPACE["available"],
                    keyring=KEYRINGS["available"])
    known = {f.name for f in dataclasses.fields(sandbox.Sandbox)}
    return sandbox.Sandbox(**{k: v for k, v in {**defaults, **kw}.items() if k in known})


@needs_root
def test_a_job_runs_as_its_own_uid_with_a_clean_environment(base, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-leak")
    log, _ = run_hostile(base, {"attack": "identity"}, box())
    assert f"identity: uid {JOB_UID} gid {JOB_UID} groups []" in log
    assert "AWS_SECRET_ACCESS_KEY" not in log and sandbox.ENV not in log
    assert f"sandbox: uid {JOB_UID}, no network" in log


@needs_root
def test_a_job_cannot_read_or_link_the_daemons_key(base):
    log, _ = run_hostile(base, {"attack": "read_key", "key": str(base / "provider.key")}, box())
    assert "read_key: denied (Permission denied)" in log
    assert "read_key: link denied" in log and "READ" not in log and "LINKED" not in log
    assert not (base / "jobs" / "j.1" / "stolen").exists()


@needs_netns
def test_a_job_cannot_open_a_connection(base):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted = []

    def accept():
        listener.settimeout(8)
        try:
            accepted.append(listener.accept())
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    log, _ = run_hostile(base, {"attack": "network",
                                "targets": [["127.0.0.1", port], ["192.0.2.1", 80]]},
                         box(uid=None, gid=None))
    t.join()
    listener.close()
    assert not accepted, "the job reached a port on the host"
    assert f"network: 127.0.0.1:{port} Connection refused" in log   # its own empty loopback
    assert "network: 192.0.2.1:80 Network is unreachable" in log
    assert "CONNECTED" not in log


@needs_root
def test_a_fork_bomb_stops_at_the_process_limit(base):
    log, outcome = run_hostile(base, {"attack": "fork_bomb"}, box())
    line = next(x for x in log.splitlines() if x.startswith("fork_bomb:"))
    assert "stopped after" in line and "Resource temporarily unavailable" in line, line
    assert int(line.split("after ")[1].split()[0]) < 64


def test_a_job_that_fills_its_disk_is_stopped(base):
    quota = 24 << 20
    log, outcome = run_hostile(base, {"attack": "fill_disk"}, box(uid=None, gid=None),
                               quota=quota)
    assert "fill_disk: UNLIMITED" not in log
    assert outcome.error.startswith(f"job wrote more than {quota:,} bytes to its work"
                                    " directory"), outcome.error
    assert not outcome.succeeded


def test_what_this_host_gives_is_reported(tmp_path):
    r = subprocess.run([sys.executable, "-m", "gpumarket.provider.sandbox", "--probe"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    features = json.loads(r.stdout)
    assert set(features) == {"unprivileged_user", "no_network", "resource_limits",
                             "private_tmp", "job_cgroup", "memory_limit", "process_limit",
                             "cpu_limit", "pid_namespace", "keyrings"}
    assert features["resource_limits"]["available"]


def test_a_checkpoint_that_links_to_the_key_is_not_packed(base, tmp_path):
    from gpumarket.proto.errors import InvalidArgument
    from gpumarket.provider import checkpoints

    ckpt = tmp_path / "step-00000002"
    ckpt.mkdir()
    for name in ("state.safetensors", "state.json", "COMPLETE"):
        (ckpt / name).write_text("{}")
    (ckpt / "model.safetensors").symlink_to(base / "provider.key")
    with pytest.raises(InvalidArgument, match="model.safetensors is not a plain file"):
        checkpoints.pack(ckpt, tmp_path / "out.tar")


def _still_growing(marker: Path, wait_s: float = 1.0) -> bool:
    before = marker.stat().st_size if marker.exists() else 0
    import time

    time.sleep(wait_s)
    return (marker.stat().st_size if marker.exists() else 0) != before


# Each way a job's leftovers end, on its own: its group, its uid, its PID namespace (the
# survivor, detached into a session of its own, escapes its process group).
SURVIVOR_WAITS = {"until_running": True}     # the job ends once its survivor has run


@needs_cgroup
def test_a_reforking_survivor_dies_with_its_job_group(base, groups):
    marker = base / "jobs" / "j.1" / "generations"
    group = groups.job("survivor")
    group.limit(cgroups.Limits(memory_bytes=512 << 20, pids=256))
    log, outcome = run_hostile(base, {"attack": "survivor", "marker": str(marker),
                                      **SURVIVOR_WAITS},
                               box(uid=None, gid=None, pid_namespace=False), group=group)
    assert "survivor: detached" in log
    assert marker.exists(), "the survivor never ran"
    assert not _still_growing(marker), "a process of the job outlived it"
    assert not group.pids()


@needs_root
def test_a_reforking_survivor_dies_with_its_uid_without_a_group(base):
    marker = base / "jobs" / "j.1" / "generations"
    uid = JOB_UID + 2    # its uid's process count takes a while to drop: the others' own
    log, outcome = run_hostile(base, {"attack": "survivor", "marker": str(marker),
                                      **SURVIVOR_WAITS},
                               box(uid=uid, gid=uid, pid_namespace=False))
    assert "survivor: detached" in log
    assert marker.exists(), "the survivor never ran"
    assert not _still_growing(marker), "a process of the job outlived it"
    assert not sandbox.processes_of({uid})


@needs_pid_namespace
def test_a_reforking_survivor_dies_with_its_pid_namespace(base):
    """No group, no uid of its own: its PID namespace alone ends it with the job."""
    marker = base / "jobs" / "j.1" / "generations"
    log, outcome = run_hostile(base, {"attack": "survivor", "marker": str(marker),
                                      **SURVIVOR_WAITS}, box(uid=None, gid=None))
    assert "survivor: detached" in log and "own PID namespace" in log, log
    assert marker.exists(), "the survivor never ran"
    assert not _still_growing(marker), "a process of the job outlived it"


@needs_private_tmp
def test_scratch_directories_are_private_bounded_and_gone_after_the_job(base):
    scratch = ["/tmp", "/var/tmp", "/dev/shm"]
    limits = {"NOFILE": 1024, "NPROC": 64, "CORE": 0, "FSIZE": 1 << 30}
    log, _ = run_hostile(base, {"attack": "fill_scratch", "dirs": scratch, "mib": 64},
                         box(limits=limits))
    for d in scratch:
        line = next(x for x in log.splitlines() if x.startswith(f"fill_scratch: {d} "))
        assert "No space left on device" in line and int(line.split()[3]) <= 16, line
        assert not os.path.exists(os.path.join(d, "left-behind")), f"{d} is the host's"
    log, _ = run_hostile(base, {"attack": "look_scratch", "dirs": scratch}, box(), name="j.2")
    assert log.count("look_scratch:") == 3 and "left-behind" not in log, log


@needs_root
@needs_cgroup
def test_memory_is_limited_per_job_not_per_process(base, groups):
    group = groups.job("memory")
    group.limit(cgroups.Limits(memory_bytes=192 << 20, pids=256))
    log, outcome = run_hostile(base, {"attack": "memory", "processes": 3, "mib_each": 96},
                               box(uid=JOB_UID + 1, gid=JOB_UID + 1), group=group)
    assert not outcome.succeeded
    assert outcome.error.startswith("job ran out of memory: it used more than its limit of"
                                    f" {192 << 20:,} bytes"), outcome.error


@needs_root
def test_each_daemon_has_its_own_job_uids(base, tmp_path):
    from gpumarket.provider.recovery import end_strays

    a = job_uids.claim("provider-a", lock_dir=tmp_path / "locks")
    b = job_uids.claim("provider-b", lock_dir=tmp_path / "locks")
    other = job_uids.claim("provider-a", lock_dir=tmp_path / "locks")   # a is running
    assert len({a.first, b.first, other.first}) == 3
    other.release()
    a.release()
    again = job_uids.claim("provider-a", lock_dir=tmp_path / "locks")   # a restarted
    assert again.first == a.first
    # A job of daemon b keeps running while daemon a cleans up after itself.
    import subprocess

    job = subprocess.Popen(["sleep", "30"], user=b.uid(0), group=b.uid(0), extra_groups=[])
    try:
        end_strays(None, set(), again, set())
        assert job.poll() is None, "daemon a's clean-up killed daemon b's job"
        end_strays(None, set(), b, set())
        assert job.wait(10) == -signal.SIGKILL
    finally:
        job.kill()
        again.release()
        b.release()


def test_the_daemon_never_follows_a_link_out_of_a_job_tree(tmp_path):
    from gpumarket.provider import jobfiles

    secret = tmp_path / "data"
    secret.mkdir()
    (secret / "provider.key").write_bytes(b"secret")
    (secret / "step-00000001").mkdir()
    work = tmp_path / "job"
    (work / "checkpoints").mkdir(parents=True)
    (work / "outputs").symlink_to(secret)
    (work / "checkpoints" / "step-00000001").symlink_to(secret / "step-00000001")
    root = jobfiles.open_dir(work)
    try:
        with pytest.raises(jobfiles.JobFileError, match="outputs is a link"):
            with jobfiles.plain_files(root, "outputs"):
                pass
        with pytest.raises(jobfiles.JobFileError, match="step-00000001 is a link"):
            jobfiles.open_beneath(root, "checkpoints/step-00000001", directory=True)
        with pytest.raises(jobfiles.JobFileError, match="not a plain path"):
            jobfiles.open_beneath(root, "../data/provider.key")
        (work / "outputs").unlink()
        (work / "outputs").mkdir()
        (work / "outputs" / "result.txt").write_text("ok")
        (work / "outputs" / "key").symlink_to(secret / "provider.key")
        with pytest.raises(jobfiles.JobFileError, match="outputs/key is a link|key is a link"):
            with jobfiles.plain_files(root, "outputs"):
                pass
        (work / "outputs" / "key").unlink()
        os.mkfifo(work / "outputs" / "pipe")     # would block a plain open() forever
        with pytest.raises(jobfiles.JobFileError, match="pipe is not a plain file"):
            with jobfiles.plain_files(root, "outputs"):
                pass
        (work / "outputs" / "pipe").unlink()
        with pytest.raises(jobfiles.JobFileError, match="belongs to uid"):
            with jobfiles.plain_files(root, "outputs", owner=os.geteuid() + 1):
                pass
        with jobfiles.plain_files(root, "outputs", owner=os.geteuid()) as files:
            assert [(name, os.read(fd, 10)) for name, fd in files] == [("result.txt", b"ok")]
    finally:
        os.close(root)


@needs_cgroup
def test_a_cancelled_job_leaves_no_process_behind(base, groups):
    """Cancelled while it runs (the broker's cancel, or the daemon stopping): its process
    group goes, and so does a process it detached, even with the follower of the job
    (which ends everything when the job exits) cancelled."""
    marker = base / "jobs" / "j.1" / "generations"
    workdir = base / "jobs" / "j.1"
    workdir.mkdir()
    (workdir / "job.json").write_text(json.dumps({"attack": "survivor", "stay": True,
                                                  "marker": str(marker)}))
    group = groups.job("cancelled")
    group.limit(cgroups.Limits(memory_bytes=512 << 20, pids=256))
    uid = JOB_UID + 3
    limits = {"NOFILE": 1024, "NPROC": 4096, "CORE": 0, "FSIZE": 8 << 20}
    box_ = sandbox.Sandbox(**{**box(uid=uid, gid=uid, limits=limits).__dict__,
                              "cgroups": tuple(group.procs_files)})
    env = {**job_env(workdir, "", None), "PYTHONPATH": str(ROOT)}

    async def go():
        async def ignore(report):
            pass

        proc = JobProcess("tests.hostile_job", workdir, env, ignore, 120, 2.0, None, box_,
                          0, group)
        follower = asyncio.create_task(proc.run())
        for _ in range(200):
            if marker.exists():
                break
            await asyncio.sleep(0.05)
        follower.cancel()          # the follower gone first: stop() alone must end it all
        await asyncio.gather(follower, return_exceptions=True)
        await proc.stop("cancelled by client")

    asyncio.run(go())
    assert marker.exists(), (workdir / "job.log").read_text()
    assert not _still_growing(marker), "a process of the cancelled job outlived it"
    assert not group.pids() and not sandbox.processes_of({uid})


@needs_root
def test_a_job_is_ended_however_its_daemon_side_fails(base):
    """The daemon's own code fails while it follows a job (here on the job's first report,
    as a malformed report once made it): every process of the job still ends, its detached
    re-forking survivor included, before the failure goes on up."""
    marker = base / "jobs" / "j.1" / "generations"
    workdir = base / "jobs" / "j.1"
    workdir.mkdir()
    (workdir / "job.json").write_text(json.dumps({"attack": "survivor", "stay": True,
                                                  "marker": str(marker)}))
    uid = JOB_UID + 5
    limits = {"NOFILE": 1024, "NPROC": 4096, "CORE": 0, "FSIZE": 8 << 20}
    box_ = box(uid=uid, gid=uid, limits=limits, pid_namespace=False)   # its uid alone ends it
    env = {**job_env(workdir, "", None), "PYTHONPATH": str(ROOT)}

    async def broken(report):
        if "survivor: detached" in str(report):     # once the survivor is out
            raise RuntimeError("the daemon's own code failed")

    async def go():
        proc = JobProcess("tests.hostile_job", workdir, env, broken, 120, 2.0, None, box_)
        with pytest.raises(RuntimeError, match="own code failed"):
            await proc.run()

    asyncio.run(go())
    assert "survivor: detached" in (workdir / "job.log").read_text()   # the attack ran
    assert not _still_growing(marker), "a process of the job outlived its follower's failure"
    assert not sandbox.processes_of({uid})


def _key_syscalls():
    from tests import hostile_job

    if hostile_job.SYS_KEYCTL < 0:
        pytest.skip(f"no keyctl numbers for {hostile_job.platform.machine()}")
    return hostile_job


@needs_root
@needs_keyrings
def test_no_job_reads_the_keys_of_an_earlier_job_of_its_uid_or_the_daemons(base):
    """Job A leaves a key in every keyring it can name (its session keyring, its uid's user,
    user session and persistent keyrings); job B, the next on the same device (same uid),
    finds none of them, nor the key in the daemon's own session keyring."""
    keys = _key_syscalls()
    keys._syscall(keys.SYS_KEYCTL, 1, 0)       # this process's own new session keyring ...
    secret = b"the daemon's secret"             # ... with a secret in it, as a daemon's might
    keys._syscall(keys.SYS_ADD_KEY, b"user", b"gpumarket-daemon-secret", secret, len(secret),
                  keys.KEY_SPEC["@s"])
    uid = JOB_UID + 6
    log_a, _ = run_hostile(base, {"attack": "keys_plant", "description": "gpumarket-left-key",
                                  "secret": "job A's"}, box(uid=uid, gid=uid), name="a.1")
    for name in ("@s", "@u", "@us", "persistent"):
        assert f"keys_plant: planted in {name}" in log_a, log_a
    log_b, _ = run_hostile(base, {"attack": "keys_look", "descriptions": [
        "gpumarket-left-key", "gpumarket-daemon-secret"]}, box(uid=uid, gid=uid), name="b.1")
    assert log_b.count("keys_look:") == 8, log_b
    assert "FOUND" not in log_b, log_b


@needs_root
@needs_keyrings
def test_the_daemon_empties_a_job_uids_keyrings_when_its_job_ends(base):
    """As above, but job B does not empty them itself: the daemon did when A ended."""
    _key_syscalls()
    uid = JOB_UID + 7
    log_a, _ = run_hostile(base, {"attack": "keys_plant", "description": "gpumarket-left-key",
                                  "secret": "job A's"}, box(uid=uid, gid=uid), name="a.1")
    assert "keys_plant: planted in @u" in log_a, log_a
    log_b, _ = run_hostile(base, {"attack": "keys_look", "descriptions": ["gpumarket-left-key"]},
                           box(uid=uid, gid=uid, keyring=False), name="b.1")
    for name in ("@u", "@us", "persistent"):
        assert f"keys_look: gpumarket-left-key in {name}: none" in log_b, log_b


@needs_root
@needs_pid_namespace
def test_a_job_sees_only_its_own_processes_and_work_directory(base, groups):
    """With the provider's directories as passable as the shipped service made them (0711),
    a job sees no process of the host, cannot list the data or jobs directory, does not find
    another job's work directory by its name, nor another job's control group (named by its
    work directory) beside its own."""
    import subprocess

    group = None
    if FEATURES["job_cgroup"]["available"]:
        groups.job("other.1").limit(cgroups.Limits(memory_bytes=256 << 20, pids=64))
        group = groups.job("j.1")
        group.limit(cgroups.Limits(memory_bytes=512 << 20, pids=256))

    base.chmod(0o711)
    (base / "jobs").chmod(0o711)
    other = base / "jobs" / "other.1"
    (other / "outputs").mkdir(parents=True)
    other.chmod(0o755)
    host = subprocess.Popen(["sleep", "60"])
    try:
        log, outcome = run_hostile(base, {
            "attack": "look_around", "host_pids": [os.getpid(), host.pid],
            "dirs": {"data dir": str(base), "jobs dir": str(base / "jobs")},
            "others": [str(other), str(other / "outputs")]}, box(), group=group)
    finally:
        host.kill()
        host.wait()
    assert outcome.exit_code == 0, log
    line = next(x for x in log.splitlines() if x.startswith("look_around: /proc shows"))
    assert int(line.split()[3]) <= 3, line           # its init, itself, maybe its child
    assert "SEEN" not in log and log.count("not seen") == 2, log
    assert "look_around: data dir not listed (Permission denied)" in log, log
    assert "look_around: jobs dir not listed (Permission denied)" in log, log
    assert "FOUND" not in log and log.count("not there") == 2, log
    if group is not None:
        beside = [x for x in log.splitlines() if x.startswith("look_around: beside its group")]
        assert beside and all(x.endswith("j.1: ['j.1']") for x in beside), beside


@pytest.mark.slow
@needs_root
@needs_pid_namespace
def test_a_job_in_its_pid_namespace_ends_as_the_daemon_sees_it(base):
    """The daemon knows a job by the pid outside its namespace: a job's exit code, a signal
    that kills it, and a drain request (SIGUSR1 to that pid alone) reach or come from the
    job itself."""
    workdir = base / "jobs" / "j.1"
    env = {**job_env(workdir, "", None), "PYTHONPATH": str(ROOT)}
    (base / "pkg").mkdir()
    (base / "pkg" / "pid_job.py").write_text(
        "import os, signal, sys, time\n"
        "what = open(os.path.join(sys.argv[1], 'what')).read()\n"
        "got = []\n"
        "signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))\n"
        "open(os.path.join(sys.argv[1], 'running'), 'w').close()\n"
        "print('pid', os.getpid(), flush=True)\n"
        "if what == 'exit':\n    sys.exit(7)\n"
        "if what == 'drain':\n"
        "    while not got:\n        time.sleep(0.02)\n"
        "    print('drained', flush=True)\n    sys.exit(0)\n"
        "time.sleep(60)\n")
    (base / "pkg").chmod(0o755)
    env["PYTHONPATH"] += f":{base / 'pkg'}"

    def run(what: str, action=None):
        if workdir.exists():
            import shutil

            shutil.rmtree(workdir)
        workdir.mkdir()
        (workdir / "what").write_text(what)

        async def go():
            async def ignore(report):
                pass

            proc = JobProcess("pid_job", workdir, env, ignore, 120, 5.0, None,
                              box(expose=(str(base / "pkg"),)))
            follower = asyncio.create_task(proc.run())
            if action is not None:
                for _ in range(1200):
                    if (workdir / "running").exists() or follower.done():
                        break
                    await asyncio.sleep(0.05)
                await action(proc)
            return await follower

        return asyncio.run(go()), (workdir / "job.log").read_text()

    outcome, log = run("exit")
    assert outcome.exit_code == 7 and "pid 2" in log, log

    async def term(proc):
        await proc.stop("cancelled")

    outcome, log = run("sleep", term)
    assert outcome.exit_code == -signal.SIGTERM and outcome.killed, (outcome, log)

    async def drain(proc):
        proc.request_drain()

    outcome, log = run("drain", drain)
    assert outcome.exit_code == 0 and "drained" in log, (outcome, log)


@needs_root
@pytest.mark.parametrize("closed", ["a torch library", "torch"])
def test_the_uid_probe_meets_what_a_job_uid_cannot_read(closed):
    """The probe's check (sandbox.PROBE_CHECK, run as the job uid) fails, saying why, on a
    torch whose library file only root may read, and on a torch a job uid cannot find."""
    where = Path(tempfile.mkdtemp(prefix="probe-"))
    try:
        where.chmod(0o755)
        lib = where / "torch" / "lib"
        lib.mkdir(parents=True)
        (where / "torch" / "__init__.py").write_text("")
        (lib / "libtorch_fake.so").write_bytes(b"\x7fELF")
        if closed == "torch":
            (where / "torch").chmod(0o700)
        else:
            (lib / "libtorch_fake.so").chmod(0o600)
        # Started as root (the probe's child drops to the job uid once it runs), then as
        # uid 65534 with only the made-up tree on its path.
        code = (f"import importlib.util, os, sys; os.setgid(65534); os.setuid(65534);"
                f" sys.path[:] = [{str(where)!r}]; exec({sandbox.PROBE_CHECK!r})")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode != 0
        last = r.stderr.strip().splitlines()[-1]
        if closed == "torch":
            assert "No module named 'torch'" in last, last
        else:
            assert "Permission denied" in last and "libtorch_fake.so" in last, last
    finally:
        shutil.rmtree(where)
