"""A job process's claim on the host's CPUs beside an endpoint's replica: its nice value by
tier, and, for a job on a slice of the CPU, its cores and its scheduling policy.

A lower tier's job runs at a lower priority (nice): where it shares cores with a replica's
engine, the broker's or this daemon's threads, they win the core first. On a slice of the
CPU (a job held to some of the daemon's cores, the rest being another slice's) that is not
enough: the replica's requests pass through the broker and this daemon, which may run on any
core, and while a slice's job keeps its own core busy the kernel puts their threads on the
replica's core, where they queue behind its engine. A lower tier's job on a CPU slice
therefore runs SCHED_IDLE: the kernel counts its core as idle when it places a waking
thread, and any other thread takes the core from it at once — so the marketplace's own
threads go to the job's core rather than the replica's. It still has all of its core the
rest of the time. And it is held to its slice's cores from its start (before the runner
pins itself, runners/base.apply_share): a forked job by its forkserver before it runs
anything, one started cold here as soon as it is spawned, so not even its imports run on the
replica's core. bench/colocated.py measures it (``colocated_ttft_p99_ratio``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from gpumarket.proto.v1 import types_pb2 as pb

log = logging.getLogger(__name__)

TIER_NICE = {pb.TIER_STANDARD: 5, pb.TIER_UNSPECIFIED: 5, pb.TIER_INTERRUPTIBLE: 10}
CORES_ENV = "GPUMARKET_CPU_CORES"   # a CPU job's cores (executor.slice_env)


def job_priority(tier: int, serves: bool) -> int:
    """The nice value of a job process of ``tier`` (an endpoint's replica, ``serves``: 0)."""
    return 0 if serves or tier == pb.TIER_SERVING else TIER_NICE.get(tier, 5)


def job_cores(env: dict[str, str]) -> frozenset[int]:
    """The cores a job with environment ``env`` is held to (none: not a CPU job)."""
    try:
        return frozenset(int(c) for c in env.get(CORES_ENV, "").split(",") if c)
    except ValueError:
        return frozenset()


def on_a_slice(cores: frozenset[int]) -> bool:
    """Whether a job held to ``cores`` has only a slice of this daemon's CPU: fewer cores than
    the daemon may run on, the others another slice's (or the daemon's own)."""
    return bool(cores) and cores < frozenset(os.sched_getaffinity(0))


def group_threads(pgid: int) -> list[int]:
    """Every thread of every process in process group ``pgid`` (a job's: it leads its own),
    as this host's /proc shows them now."""
    tids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            tids += [int(t.name) for t in (entry / "task").iterdir()]
        except (OSError, ValueError, IndexError):
            continue                # ended meanwhile
    return tids


def hold_to_slice(pgid: int, cores: frozenset[int], idle: bool) -> None:
    """Hold the job whose session leader is ``pgid`` to ``cores``, each of its threads, and
    with ``idle`` to SCHED_IDLE (threads and processes it starts later inherit both). A job
    cannot leave SCHED_IDLE again without privilege (RLIMIT_NICE). What cannot be done is a
    note in the daemon's log: the runner still pins itself to its cores."""
    failed = ""
    for tid in group_threads(pgid):
        try:
            if cores:
                os.sched_setaffinity(tid, cores)
            if idle:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:
            continue
        except OSError as exc:
            failed = exc.strerror or str(exc)
    if failed:
        log.warning("job process group %d: not held to its slice (%s)", pgid, failed)


def lower_priority(pgid: int, nice: int) -> None:
    """Lower the CPU priority of the job whose session leader is ``pgid`` to ``nice``: every
    thread of every process of its group (setpriority PRIO_PGRP reaches each thread; later
    ones inherit it), and its session's scheduling group. With the kernel's autogroup
    scheduling (sched_autogroup_enabled, the default of desktop and many server kernels)
    each session is a group of its own and a thread's nice value is weighed only inside
    it: against the broker's, this daemon's or a replica's threads, the job's session
    weighs as /proc/PID/autogroup says, which is what is set here. A job cannot raise
    either back without privilege. Where it is not allowed, the job runs at the daemon's
    priority (a note in the daemon's log)."""
    if nice <= 0:
        return
    try:
        os.setpriority(os.PRIO_PGRP, pgid, nice)
    except OSError as exc:
        log.warning("job process group %d left at the daemon's priority: %s", pgid,
                    exc.strerror)
        return
    try:
        session = int(Path(f"/proc/{pgid}/stat").read_text().rsplit(")", 1)[1].split()[3])
        if session == pgid:     # its own session (a forked job's setsid done): its group
            Path(f"/proc/{pgid}/autogroup").write_text(str(nice))
    except FileNotFoundError:
        pass                    # no autogroups in this kernel (or the job has ended)
    except (OSError, ValueError, IndexError) as exc:
        log.warning("job session %d: its scheduling group left at the daemon's priority:"
                    " %s", pgid, exc)


def settle(pgid: int, nice: int, env: dict[str, str]) -> None:
    """A job process just started (``pgid``, its environment ``env``) put in its place: its
    tier's ``nice`` (job_priority), and on a slice of the CPU its cores and, below the
    serving tier (``nice`` > 0), SCHED_IDLE."""
    cores = job_cores(env)
    if on_a_slice(cores):
        hold_to_slice(pgid, cores, idle=nice > 0)
    lower_priority(pgid, nice)
