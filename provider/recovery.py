"""A restarted daemon picks up where the last one stopped: it re-attaches to jobs that
outlived it, finishes or gives back the ones that ended meanwhile, re-sends final updates
the broker has not settled, and ends whatever of a job no journal entry accounts for."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
from pathlib import Path

from gpumarket.proto.envelope import open_envelope, payload_sha256
from gpumarket.proto.errors import GpumarketError
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider import reattach
from gpumarket.provider.attempt import Attempt
from gpumarket.provider.cgroups import CgroupError, CgroupHost
from gpumarket.provider.executor import pid_runs_in, signal_group
from gpumarket.provider.job_uids import UidRange
from gpumarket.provider.journal import Entry
from gpumarket.provider.leases import Assignment
from gpumarket.provider.sandbox import kill_uid, processes_of

log = logging.getLogger(__name__)


def assignment_of(entry: Entry) -> Assignment | None:
    """The lease and spec a journal entry recorded (they were checked when accepted; the
    journal is the provider's own file). None if the entry is unreadable."""
    try:
        lease, _ = open_envelope(pb.Envelope.FromString(entry.lease), pb.Lease)
        spec, client_id = open_envelope(lease.job_spec, pb.JobSpec)
    except (GpumarketError, ValueError):
        return None
    return Assignment(lease, spec, client_id, payload_sha256(lease.job_spec))


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _descends_from(pid: int, keep: set[int]) -> bool:
    """Whether ``pid`` is a process forked by one in ``keep`` (a re-attached job's own
    processes, such as the init and job process of its PID namespace, share its command
    line)."""
    for _ in range(64):
        pid = _parent(pid)
        if pid <= 1:
            return False
        if pid in keep:
            return True
    return False


def kill_orphans(jobs_dir: Path, keep: set[int]) -> list[int]:
    """SIGKILL job processes started for ``jobs_dir`` that are not in ``keep`` nor forked by
    one in it; return them."""
    marker = str(jobs_dir).encode()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in keep:
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if (marker in cmd and b"gpumarket.provider.runners" in cmd
                and not _descends_from(int(entry.name), keep)):
            pid = int(entry.name)
            log.warning("killing orphaned job process %d", pid)
            signal_group(pid, signal.SIGKILL)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            killed.append(pid)
    return killed


def end_strays(groups: CgroupHost | None, keep_groups: set[str], uids: UidRange | None,
               keep_uids: set[int]) -> None:
    """End what is left of jobs that no journal entry follows any more: every process of
    their control groups (then the groups) and of this daemon's job uids."""
    if groups is not None:
        for key in groups.keys() - keep_groups:
            group = groups.job(key)
            try:
                killed = group.kill()
            except CgroupError as exc:
                log.error("stray job group %s: %s", key, exc)
                continue
            if killed:
                log.warning("killed %d stray processes of job group %s", killed, key)
            group.remove()
    if uids is not None:
        mine = set(range(uids.first, uids.first + uids.size)) - keep_uids
        found = {uid for _ in range(3) for uid in processes_of(mine)}   # a forker may hide
        for uid in found:                                              # from one scan
            log.warning("killed %d stray processes of job uid %d", kill_uid(uid), uid)


async def restore(daemon) -> None:
    """Rebuild ``daemon``'s jobs from its journal (see the module's docstring)."""
    entries = await asyncio.to_thread(daemon.journal.entries)
    attached: set[int] = set()
    for e in entries:
        assignment = assignment_of(e)
        if assignment is None:
            await asyncio.to_thread(daemon.journal.remove, e.job_id, e.epoch)
            continue
        job = Attempt(assignment, Path(e.workdir), daemon)
        daemon.jobs[assignment.lease.job_id] = job
        if e.final is not None:
            daemon.unsettled[job.key] = gw.ProviderMessage.FromString(e.final)
            log.info("job %s: re-sending its final update", e.job_id)
        elif e.pid and pid_runs_in(e.pid, job.workdir):
            attached.add(e.pid)
            reattach.reattach(job, e.pid)
            log.info("job %s: re-attached to its running process %d", e.job_id, e.pid)
        elif (done := reattach.done_meanwhile(job)) is not None:
            reattach.finish_meanwhile(job, done)
        else:
            log.warning("job %s: its process ended while the daemon was down", e.job_id)
            await daemon.finished(job, job.update(released=gw.JobReleased(
                reason="job process ended while the provider daemon was down")))
    jobs_dir = daemon.config.jobs_dir
    kill_orphans(jobs_dir, attached)
    following = [j for j in daemon.jobs.values() if j.process is not None]
    await asyncio.to_thread(end_strays, daemon.isolation.cgroups,
                            {j.workdir.name for j in following}, daemon.isolation.uids,
                            {j.job_uid for j in following})
    known = {Path(e.workdir).name for e in entries}
    if jobs_dir.is_dir():
        for d in jobs_dir.iterdir():
            if d.name not in known:
                shutil.rmtree(d, ignore_errors=True)
