"""Job isolation on the provider (tests/test_isolation.py), continued: a job is ended however
its daemon side fails, a job's keyrings are its own, a job in its PID namespace sees only
its own processes and ends as the daemon sees it, and the uid probe."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gpumarket.provider import cgroups, sandbox
from gpumarket.provider.executor import JobProcess, job_env
# base, groups and reaper are fixtures (tests/isolation_kit.py)
from tests.isolation_kit import (  # noqa: F401
    FEATURES, JOB_UID, ROOT, _still_growing, base, box, groups, needs_keyrings,
    needs_pid_namespace, needs_root, reaper, run_hostile,
)


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
