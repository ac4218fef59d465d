"""Job isolation on the provider, attacked from inside a job: a runner that tries to read
the daemon's key, reach the network, fork-bomb and fill the disk, run through the same
executor and sandbox a leased job gets (provider/executor.py, provider/sandbox.py)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
from pathlib import Path

import pytest

from gpumarket.provider import sandbox
from gpumarket.provider.executor import JobProcess, job_env

ROOT = Path(__file__).resolve().parent.parent
FEATURES = sandbox.probe()
needs_root = pytest.mark.skipif(not FEATURES["unprivileged_user"]["available"],
                                reason="jobs can only switch uid where the daemon is root")
needs_netns = pytest.mark.skipif(not FEATURES["no_network"]["available"],
                                 reason=FEATURES["no_network"]["detail"])


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
                name: str = "j.1") -> tuple[str, object]:
    workdir = base / "jobs" / name
    workdir.mkdir()
    (workdir / "job.json").write_text(json.dumps(attack))
    env = {**job_env(workdir, "", None), "PYTHONPATH": str(ROOT)}

    async def go():
        async def ignore(report):
            pass

        proc = JobProcess("tests.hostile_job", workdir, env, ignore, 120, 2.0, None, box, quota)
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
    defaults = dict(uid=sandbox.JOB_UID_BASE, gid=sandbox.JOB_UID_BASE, network=False,
                    limits={"NOFILE": 1024, "NPROC": 64, "CORE": 0, "FSIZE": 8 << 20})
    return sandbox.Sandbox(**{**defaults, **kw})


@needs_root
def test_a_job_runs_as_its_own_uid_with_a_clean_environment(base, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-leak")
    log, _ = run_hostile(base, {"attack": "identity"}, box())
    assert f"identity: uid {sandbox.JOB_UID_BASE} gid {sandbox.JOB_UID_BASE} groups []" in log
    assert "AWS_SECRET_ACCESS_KEY" not in log and sandbox.ENV not in log
    assert f"sandbox: uid {sandbox.JOB_UID_BASE}, no network" in log


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
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "gpumarket.provider.sandbox", "--probe"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    features = json.loads(r.stdout)
    assert set(features) == {"unprivileged_user", "no_network", "resource_limits"}
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
