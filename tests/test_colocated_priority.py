"""A lower tier's job process runs at a lower CPU priority (provider/priority.job_priority,
lower_priority): every thread of every process of the job's group, so that a replica and the
marketplace's own processes win a core it shares with them (bench/colocated.py); and a job on
a slice of the CPU is held to its cores from its start (``settle``), every thread of it, not
only once its runner pins itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpumarket.provider.executor import job_priority
from gpumarket.provider.priority import lower_priority, settle
from gpumarket.proto.v1 import types_pb2 as pb

# A process with a second thread and a child process (itself with a thread), all started
# before the priority is lowered.
JOB = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
child = subprocess.Popen([sys.executable, "-c", "import threading, time;"
                          " threading.Thread(target=time.sleep, args=(60,)).start();"
                          " print('child', flush=True); time.sleep(60)"],
                         stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "child"
print(child.pid, flush=True)
time.sleep(60)
"""


def nices(pid: int) -> list[int]:
    """The nice value of each thread of ``pid``."""
    return [int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])
            for task in Path(f"/proc/{pid}/task").iterdir()]


def test_lower_tiers_run_at_a_lower_priority_every_thread_of_the_group():
    assert job_priority(pb.TIER_SERVING, False) == 0
    assert job_priority(pb.TIER_UNSPECIFIED, True) == 0       # an endpoint's replica
    assert 0 < job_priority(pb.TIER_STANDARD, False) < job_priority(pb.TIER_INTERRUPTIBLE,
                                                                     False)
    job = subprocess.Popen([sys.executable, "-c", JOB], stdout=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        child = int(job.stdout.readline())
        assert len(nices(job.pid)) >= 2 and len(nices(child)) >= 2
        assert set(nices(job.pid)) == set(nices(child)) == {0}
        lower_priority(job.pid, job_priority(pb.TIER_INTERRUPTIBLE, False))
        want = job_priority(pb.TIER_INTERRUPTIBLE, False)
        assert set(nices(job.pid)) == set(nices(child)) == {want}
        autogroup = Path(f"/proc/{job.pid}/autogroup")
        if autogroup.exists():  # its session's group too: what weighs against other sessions
            assert autogroup.read_text().split()[-1:] in ([], [str(want)])
            # ours is untouched; a session that never called setsid since boot (a CI runner's)
            # is in the root group, whose file the kernel leaves empty
            assert Path("/proc/self/autogroup").read_text().split()[-1:] in ([], ["0"])
        lower_priority(job.pid, 0)      # a replica's: left as it is
        assert set(nices(job.pid)) == {want}
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()


def threads_of(*pids: int) -> list[int]:
    return [int(t.name) for pid in pids for t in Path(f"/proc/{pid}/task").iterdir()]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a slice needs a second core")
def test_a_job_on_a_cpu_slice_is_held_to_its_cores_every_thread_of_the_group():
    """Every thread of both processes (started before it was settled) on the slice's core, at
    its tier's nice; a job on every core the daemon has (a whole CPU) left on them."""
    mine = sorted(os.sched_getaffinity(0))
    nice = job_priority(pb.TIER_STANDARD, False)
    for cores, want in (({mine[-1]}, {mine[-1]}), (set(mine), set(mine))):
        job = subprocess.Popen([sys.executable, "-c", JOB], stdout=subprocess.PIPE,
                               text=True, start_new_session=True)
        try:
            child = int(job.stdout.readline())
            tids = threads_of(job.pid, child)
            assert len(tids) >= 4
            assert all(os.sched_getaffinity(t) == set(mine) for t in tids)
            settle(job.pid, nice, {"GPUMARKET_CPU_CORES": ",".join(map(str, sorted(cores)))})
            assert all(os.sched_getaffinity(t) == want for t in tids)
            assert set(nices(job.pid)) == set(nices(child)) == {nice}
        finally:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
