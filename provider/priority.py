"""A job process's claim on the host's CPUs beside an endpoint's replica: its nice value by
tier, and, for a job on a slice of the CPU, its cores from its very start.

A lower tier's job runs at a lower priority (nice): where it shares cores with a replica's
engine, the broker's or this daemon's threads, they win the core first. A job on a slice of
the CPU (held to some of the daemon's cores, the rest another slice's) is held to its cores
before anything of it runs, not only once its runner pins itself (runners/base.apply_share,
after the runner's imports): a forked job by its forkserver's child, its sandbox's
processes included; one started cold here as soon as it is spawned — so neither a
training's imports nor its sandbox's wrappers run on a replica's core.

Tried and left out: running a lower tier's job on a CPU slice SCHED_IDLE (its core then
counts as idle where the kernel places a waking thread of the broker or this daemon), and
that at nice 19 on its session's group as well. bench/colocated.py, three pairs alternating
with and without at load average 5-7 on the 2-core machine: colocated_ttft_p99_ratio 1.98,
2.42 (SCHED_IDLE), 2.96 (and nice 19) against 1.61, 0.83, 1.44 without (docs/broker.md).
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


def hold_to_slice(pgid: int, cores: frozenset[int]) -> None:
    """Hold each thread of the job whose session leader is ``pgid`` to ``cores`` (threads and
    processes it starts later inherit them). What cannot be done is a note in the daemon's
    log: the runner still pins itself to its cores when it starts."""
    failed = ""
    for tid in group_threads(pgid):
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:
            continue
        except OSError as exc:
            failed = exc.strerror or str(exc)
    if failed:
        log.warning("job process group %d: not held to its slice's cores (%s)", pgid, failed)


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
    """A job process just started (``pgid``, its environment ``env``) put in its place: on a
    slice of the CPU held to its cores, and at its tier's ``nice`` (job_priority)."""
    cores = job_cores(env)
    if on_a_slice(cores):
        hold_to_slice(pgid, cores)
    lower_priority(pgid, nice)
