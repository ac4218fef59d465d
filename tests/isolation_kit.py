"""What the isolation tests share (tests/test_isolation*.py, tests/test_forkserver.py): the
uids their jobs run as, what this host gives (the skip marks), the end of whatever their
jobs left behind, a data directory job uids can reach, control groups, the sandbox a job
gets here and a hostile job run through the executor."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import tempfile
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


def _still_growing(marker: Path, wait_s: float = 1.0) -> bool:
    before = marker.stat().st_size if marker.exists() else 0
    import time

    time.sleep(wait_s)
    return (marker.stat().st_size if marker.exists() else 0) != before
