"""Job isolation on the provider, attacked from inside a job: a runner that tries to read
the daemon's key, reach the network, fork-bomb and fill the disk, run through the same
executor and sandbox a leased job gets (provider/executor.py, provider/sandbox.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

from gpumarket.provider import cgroups, job_uids, sandbox
from gpumarket.provider.executor import JobProcess, job_env
# base, groups and reaper are fixtures: a jobs dir job uids can reach, a control-group
# directory, and the end of whatever a job of these uids left behind.
from tests.isolation_kit import (  # noqa: F401
    JOB_UID, ROOT, _still_growing, base, box, groups, needs_cgroup, needs_netns,
    needs_pid_namespace, needs_private_tmp, needs_root, reaper, run_hostile,
)


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
        # Until its survivor runs (or the job ended): a job process's start, an interpreter
        # in its sandbox, is seconds on a loaded machine, and 10 s, this wait's bound
        # before, was short for it; 120 s, as for any process start here.
        for _ in range(2400):
            if marker.exists() or follower.done():
                break
            await asyncio.sleep(0.05)
        follower.cancel()          # the follower gone first: stop() alone must end it all
        await asyncio.gather(follower, return_exceptions=True)
        await proc.stop("cancelled by client")

    asyncio.run(go())
    assert marker.exists(), (workdir / "job.log").read_text()
    assert not _still_growing(marker), "a process of the cancelled job outlived it"
    assert not group.pids() and not sandbox.processes_of({uid})
