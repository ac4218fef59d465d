"""A failed attempt's final update: the error and this provider's signed account of it (a
FailureReport: whether the job's own process ran, its exit status, the last lines of its
log), which the broker checks and shows the client as this provider's word
(docs/recovery.md)."""

from __future__ import annotations

import os
from pathlib import Path

from gpumarket.proto.envelope import seal
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.provider import jobfiles
from gpumarket.provider.executor import log_tail
from gpumarket.provider.leases import Assignment

TAIL_LINES = 20            # lines of the job's log the report carries ...
TAIL_CHARS = 500           # ... each cut to this many characters
ERROR_CHARS = 2000


def failed(identity: Identity, assignment: Assignment, error: str, *, ran: bool,
           exit_code: int | None = None, workdir: Path | None = None,
           owner: int | None = None) -> gw.JobFailed:
    """The JobFailed update for ``assignment``'s lease: ``ran`` says the job's own process
    ran and ended (with ``exit_code``, None if unknown: a re-attached job), so the failure
    may be the job's; otherwise the provider failed before it did. The log's tail is read
    from ``workdir``/job.log, a file the job owns (as ``owner``) and may have replaced: it is
    opened without following links, and left out if it is anything but that plain file."""
    lease = assignment.lease
    report = gw.FailureReport(
        job_id=lease.job_id, epoch=lease.epoch, provider_id=identity.id,
        spec_sha256=assignment.spec_sha256, job_ran=ran, error=error[:ERROR_CHARS],
        log_tail=_tail(workdir, owner) if ran and workdir is not None else [],
        at_ms=now_ms())
    if exit_code is not None:
        report.exit_code = exit_code
    return gw.JobFailed(error=error[:ERROR_CHARS], report=seal(identity, report))


def _tail(workdir: Path, owner: int | None) -> list[str]:
    try:
        fd = jobfiles.open_under(workdir, "job.log", owner=owner)
    except (OSError, jobfiles.JobFileError):
        return []
    try:
        return [line[:TAIL_CHARS] for line in log_tail(fd, TAIL_LINES).splitlines()]
    finally:
        os.close(fd)
