"""A job's end is noticed by an event, not a poll (provider/executor.py, exits.py): our own
child's, a process that is not our child (a re-attached job, a forked one whose forkserver
died) through its pidfd, and the stop path's SIGTERM/SIGKILL on the same event. Each test
sets the poll and the drain tick to an hour: only an event can end it within its bound.
Every log line and report still arrives, in order, with the final read at the end."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumarket.provider import executor, exits
from gpumarket.provider.executor import JobProcess, job_env
from gpumarket.provider.exits import ForkedChild, pid_gone, pid_runs_in
from gpumarket.provider.reports import Log, Progress

HOUR = 3600.0
BOUND = 120.0       # generous: a loaded machine (process starts); a poll or tick would take an hour


@pytest.fixture
def no_polls(monkeypatch):
    monkeypatch.setattr(exits, "POLL_S", HOUR)
    monkeypatch.setattr(executor, "DRAIN_S", HOUR)


def job_process(tmp_path: Path, source: str, on_report, grace: float = 1.0,
                max_runtime_s: float = HOUR) -> JobProcess:
    """A JobProcess (not yet started) that runs ``source`` as its runner module, in
    ``tmp_path / "work"``, with a job's clean environment (job_env) and its reports sent
    to ``on_report``."""
    pkg = tmp_path / "pkgs"
    pkg.mkdir(exist_ok=True)
    (pkg / "event_runner.py").write_text(source)
    workdir = tmp_path / "work"
    workdir.mkdir(exist_ok=True)
    env = job_env(workdir, "", None)
    env["PYTHONPATH"] = str(pkg)
    return JobProcess("event_runner", workdir, env, on_report, max_runtime_s=max_runtime_s,
                      grace_s=grace)


def _orphan(workdir: Path, seconds: float) -> int:
    """A process that is not this one's child (its parent exits at once: it is reparented),
    that looks like a job of ``workdir`` (pid_runs_in) and ends after ``seconds``; its
    pid."""
    line = (f'{sys.executable} -c "import sys, time; time.sleep(float(sys.argv[1]))"'
            f' {seconds} gpumarket.provider.runners {workdir} >/dev/null 2>&1 & echo $!')
    r = subprocess.run(
        ["sh", "-c", line],
        capture_output=True, text=True, check=True, start_new_session=True)
    pid = int(r.stdout.split()[0])
    deadline = time.monotonic() + BOUND
    while not pid_runs_in(pid, workdir):   # until it has exec'd (a moment)
        assert time.monotonic() < deadline, "the orphan did not start"
        time.sleep(0.01)
    return pid


def test_a_jobs_exit_ends_its_follower_at_once_with_every_line_and_report(tmp_path, no_polls):
    reports = []

    async def on_report(r):
        reports.append(r)

    job = job_process(tmp_path, """
import json, os
out = open(os.environ["GPUMARKET_REPORT_FILE"], "a")
for step in range(1, 4):
    print("line", step, flush=True)
    out.write(json.dumps({"event": "progress", "step": step, "total": 3}) + "\\n")
    out.flush()
print("a last partial line", end="", flush=True)
out.write(json.dumps({"event": "done", "metrics": {}}) + "\\n")
""", on_report)

    async def scenario():
        return await asyncio.wait_for(job.run(), BOUND)

    outcome = asyncio.run(scenario())
    assert outcome.succeeded and outcome.exit_code == 0
    assert [r for r in reports if not isinstance(r, Log)] == \
        [Progress(step=s, total=3) for s in (1, 2, 3)]
    lines = [x for r in reports if isinstance(r, Log) for x in r.lines]
    assert lines == ["line 1", "line 2", "line 3", "a last partial line"]


def test_stop_waits_on_the_exit_event_then_kills(tmp_path, no_polls):
    """SIGTERM ends a job that heeds it at once (no grace spent); one that ignores it is
    killed when its grace ends, and noticed dead at once."""
    async def on_report(r):
        pass

    async def stop_running(source: str, grace: float):
        job = job_process(tmp_path, source, on_report, grace=grace)
        await job.start()
        followed = asyncio.create_task(job.run())
        log = job.workdir / "job.log"
        deadline = time.monotonic() + BOUND
        while "ready" not in log.read_text():       # its SIGTERM handler is set
            assert time.monotonic() < deadline, "the job did not start"
            await asyncio.sleep(0.01)
        await asyncio.wait_for(job.stop("cancelled"), BOUND)    # not the hour's grace
        return await asyncio.wait_for(followed, BOUND)

    heeds = "import time\nprint('ready', flush=True)\ntime.sleep(600)\n"
    outcome = asyncio.run(stop_running(heeds, grace=HOUR))
    assert outcome.killed and outcome.exit_code == -signal.SIGTERM
    (tmp_path / "work").rename(tmp_path / "work-1")
    ignores = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
               "print('ready', flush=True)\ntime.sleep(600)\n")
    outcome = asyncio.run(stop_running(ignores, grace=0.5))
    assert outcome.killed and outcome.exit_code == -signal.SIGKILL
    assert "cancelled" in outcome.error


def test_the_exit_of_a_process_not_our_child_is_noticed_by_its_pidfd(tmp_path, no_polls):
    if not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfd_open here")
    workdir = tmp_path / "work"
    workdir.mkdir()
    pid = _orphan(workdir, 1.0)
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)     # not ours: no child watcher can wait for it

    async def scenario():
        await asyncio.wait_for(pid_gone(pid, lambda: pid_runs_in(pid, workdir)),
                               BOUND)

    asyncio.run(scenario())
    assert not pid_runs_in(pid, workdir)


def test_a_reattached_job_and_an_orphaned_forked_one_end_on_their_pidfd(tmp_path, no_polls):
    if not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfd_open here")

    async def on_report(r):
        pass

    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / executor.REPORTS).write_text("")
    (workdir / "job.log").write_text("")

    async def reattached():
        job = JobProcess("event_runner", workdir, {}, on_report, max_runtime_s=HOUR,
                         grace_s=1.0)
        job.attach(_orphan(workdir, 1.0))
        return await asyncio.wait_for(job.run(), BOUND)

    outcome = asyncio.run(reattached())
    assert outcome.exit_code is None and outcome.error == "job ended without finishing"

    async def orphaned():
        child = ForkedChild(_orphan(workdir, 1.0), workdir)
        child.orphaned()        # its forkserver died: followed by its pid
        assert child.running()
        return await asyncio.wait_for(child.wait(), BOUND)

    assert asyncio.run(orphaned()) is None


def test_without_pidfds_the_pid_is_polled(tmp_path, monkeypatch):
    """Where pidfd_open is refused (an old kernel, a seccomp filter), the poll still ends it."""
    def refused(pid, flags=0):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(exits.os, "pidfd_open", refused, raising=False)
    workdir = tmp_path / "work"
    workdir.mkdir()
    pid = _orphan(workdir, 0.5)

    async def scenario():
        await asyncio.wait_for(pid_gone(pid, lambda: pid_runs_in(pid, workdir)),
                               BOUND)

    asyncio.run(scenario())


def test_a_job_s_group_is_not_signalled_once_its_pid_is_another_process_s():
    """A job's process group is killed by its leader's pid (its grace over, at its end).
    Once that leader is reaped and its group empty, the pid can go to a stranger's new
    group: signal_group sends nothing to a process that started at another time than the
    leader it was given, and signals a group whose leader is the one it knows."""
    from gpumarket.provider.exits import signal_group, started_at

    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        started = started_at(proc.pid)
        assert started is not None and started_at(2 ** 22 + 1) is None
        signal_group(proc.pid, signal.SIGKILL, started + 1)     # "the job" was another
        time.sleep(0.2)
        assert proc.poll() is None, "a stranger's group was killed"
        signal_group(proc.pid, signal.SIGKILL, started)
        assert proc.wait(BOUND) == -signal.SIGKILL
        signal_group(proc.pid, signal.SIGKILL, started)         # gone: nothing to send
    finally:
        proc.kill()
        proc.wait()
