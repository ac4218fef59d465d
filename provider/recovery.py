"""What a restarted daemon needs besides its journal: the assignment a journal entry stands
for, and the job processes nothing accounts for any more."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

from gpumarket.proto.envelope import open_envelope, payload_sha256
from gpumarket.proto.errors import GpumarketError
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider.cgroups import CgroupError, CgroupHost
from gpumarket.provider.executor import signal_group
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


def kill_orphans(jobs_dir: Path, keep: set[int]) -> list[int]:
    """SIGKILL job processes started for ``jobs_dir`` that are not in ``keep``; return them."""
    marker = str(jobs_dir).encode()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in keep:
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker in cmd and b"gpumarket.provider.runners" in cmd:
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
