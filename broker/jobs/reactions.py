"""What the other rooms do when a job moves. The state machine (jobs/transitions,
jobs/endings) calls these hooks at the moments named below; job arrays (jobs/arrays) and
spot checks (checks/verification, checks/disputes) answer them. So the state machine imports
neither of them, and they import it: no import circle in the broker
(tests/test_architecture.py).

The broker installs its reactions once when it starts (``broker.server.install_reactions``);
until then a hook raises, so a process that forgot cannot pass for a broker without arrays
or checks. Each hook runs inside the transaction of the transition that calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlite_utils import Database

from gpumarket.broker.checks.policy import Policy
from gpumarket.broker.jobs.job import Job
from gpumarket.proto.v1 import types_pb2 as pb


@dataclass(frozen=True)
class Reactions:
    """The hooks, by the moment each answers."""

    # A batch of a job array moved (db, array id, batch id, its event's type, now): its
    # tasks follow it, and the array follows them.
    batch_moved: Callable[[Database, str, str, str, int], None]
    # The tasks a new lease of a batch runs (db, batch id).
    batch_tasks: Callable[[Database, str], list[int]]
    # A job array's top row is cancelled (db, array id, now): its tasks are.
    array_cancelled: Callable[[Database, str, int], None]
    # A check's row is leased (db, check id, provider id, now): the scope the lease carries.
    check_leased: Callable[[Database, str, str, int], pb.CheckScope | None]
    # A checkpoint was stored (db, policy, job, lease, step, ref, now): it is kept, and its
    # segment perhaps checked.
    checkpoint_stored: Callable[[Database, Policy, Job, dict, int, dict, int], None]
    # A job's receipt came (db, policy, job, lease, total steps, outputs, receipt, now): its
    # last segment is perhaps checked.
    receipt_came: Callable[[Database, Policy, Job, dict, int, dict, pb.Receipt, int], Any]
    # The checks of a job not decided yet (db, job id): it waits for them (VERIFYING).
    open_checks: Callable[[Database, str], int]
    # What the checks found of a job's work, in words (db, job id).
    work_summary: Callable[[Database, str], str]
    # A check's replay returned (db, check id, its outputs by name, now).
    check_returned: Callable[[Database, str, dict[str, dict], int], None]
    # A check's row was queued again (db, check id).
    check_requeued: Callable[[Database, str], None]
    # A check's row failed for good (db, check id, error, now): the replay could not run.
    check_failed: Callable[[Database, str, str, int], None]
    # A top job ended (db, job id, whether it failed, now): its checks end with it, before
    # its hold goes back.
    job_ended: Callable[[Database, str, bool, int], None]


_installed: list[Reactions] = []


def install(reactions: Reactions) -> None:
    """Make ``reactions`` the broker's (once when it starts; again replaces them)."""
    _installed[:] = [reactions]


def hooks() -> Reactions:
    """The installed reactions; raises RuntimeError if none were installed."""
    if not _installed:
        raise RuntimeError("the broker's reactions are not installed"
                           " (gpumarket.broker.server.install_reactions)")
    return _installed[0]
