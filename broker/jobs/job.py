"""A job as the broker's domain code reads it: one immutable value made from a row of ``jobs``
in one place (``Job.from_row``), which says which sort of job it is.

Every sort shares the ``jobs`` table (docs/architecture.md, The broker's rooms):

- ``job``: what a client submitted (a whole job, a split job's top row, an array, an
  endpoint);
- ``part``: one of a split job's parts (``parent_id``, ``part`` of ``parts``);
- ``batch``: a lease's worth of a job array's tasks (``parent_id``, ``tasks``);
- ``replica``: one of an endpoint's replicas (``parent_id``, no parts, no tasks);
- ``check``: a replay of another job's segment by another provider (``check_of``; paid
  from ``pays_from``'s hold).

A ``Job`` also answers ``job["column"]`` (it is a read-only Mapping of its columns) for the
modules that still read rows by key (checks/): they take a ``Job`` or a dict alike.

This is also the bottom layer of rows and events, under the state machine: the only code
that writes the ``jobs`` table and the ``events`` table (``insert_job``, ``update_job``,
``add_to_job``, ``set_queue_reasons``, ``insert_event``; tests/test_architecture.py checks
it). Each writes a row change or an event and nothing else, inside the caller's transaction:
no reactions, no money, no notifications — what a change causes is the state machine's
(jobs/transitions: ``set_job``, ``append_event``, ``spawn``). No imports of the broker here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from sqlite_utils import Database

from gpumarket.proto.v1 import types_pb2 as pb

Sort = Literal["job", "part", "batch", "replica", "check"]


@dataclass(frozen=True)
class Job(Mapping):
    """One row of ``jobs``, typed (units in the names: ``_ms`` epoch milliseconds, ``_s``
    seconds)."""

    id: str
    client_id: str
    name: str
    kind: int                       # JobKind number
    state: int                      # JobState number
    spec: bytes                     # the client's signed spec (an Envelope)
    spec_sha256: str
    expires_at_ms: int              # the spec's expiry: no lease after it
    attempt: int
    max_attempts: int
    epoch: int                      # the current lease's epoch (0: never leased)
    provider_id: str | None         # the current lease's holder
    lease_id: str | None
    progress_step: int
    progress_total: int
    progress_metrics: str           # JSON object
    error: str
    queue_reason: str               # why it waits, as its client reads it
    receipt: bytes | None           # the provider's signed receipt (an Envelope)
    resume_from: str | None         # JSON ArtifactRef of its latest checkpoint
    created_at_ms: int
    updated_at_ms: int
    checkpoint_step: int
    checkpoint_seconds: float       # measured cost of writing a checkpoint, smoothed
    log_lines: int
    parent_id: str | None           # a part's, batch's or replica's top job
    part: int                       # a part's number (1-based), a replica's; 0 otherwise
    parts: int                      # a split job's parts (on the top row and on each part)
    needs: str                      # JSON market.admission.Needs
    fee_ppm: int
    enforce_funds: int              # 1: it runs only as far as its hold pays
    hold_basis: str
    hold_needed: int                # units a paused job needs in its hold to go on
    settled_to_ms: int | None       # its current lease is paid up to here
    settled_step: int
    check_of: str | None            # a check: the job whose work it replays
    pays_from: str | None           # a check: the top job whose hold pays it
    tasks: int                      # an array's tasks (on its top row and its batches)
    lanes: int                      # an array: leases its tasks are spread over

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Job:
        """The job of a whole row of ``jobs`` (``SELECT *``); raises KeyError if a column is
        missing (columns it does not know are left out)."""
        return cls(**{name: row[name] for name in COLUMNS})

    @property
    def sort(self) -> Sort:
        """Which sort of row this is (the module docstring)."""
        if self.check_of:
            return "check"
        if not self.parent_id:
            return "job"
        if self.tasks:
            return "batch"
        return "part" if self.parts else "replica"

    @property
    def top_id(self) -> str:
        """The submitted job this row belongs to (itself, for a top job or a check)."""
        return self.parent_id or self.id

    @property
    def is_split(self) -> bool:
        """The top row of a job split into parts (its state follows theirs)."""
        return bool(self.parts) and not self.part and not self.parent_id

    @property
    def is_array(self) -> bool:
        """The top row of a job array (its state follows its tasks)."""
        return bool(self.tasks) and not self.parent_id

    # The read-only Mapping of its columns, for the readers by key.
    def __getitem__(self, column: str) -> Any:
        if column not in _COLUMN_SET:
            raise KeyError(column)
        return getattr(self, column)

    def __iter__(self) -> Iterator[str]:
        return iter(COLUMNS)

    def __len__(self) -> int:
        return len(COLUMNS)


COLUMNS = tuple(f.name for f in fields(Job))
_COLUMN_SET = frozenset(COLUMNS)


@dataclass(frozen=True)
class LeaseTerms:
    """What the market decided for one lease of a queued job (market/placement.plan), as
    ``jobs.transitions.create_lease`` writes and signs it."""

    job_id: str
    provider_id: str
    device_indices: tuple[int, ...]
    price_per_gpu_hour: float       # credits per GPU-hour
    accept_within_ms: int           # the provider must start it within this, or it lapses
    checkpoint_every: int           # steps between checkpoints (0: the runner's own)
    provider_mtbf_s: float = 0.0    # the provider's observed mean time between failures
    checkpoint_interval_s: float = 0.0  # the checkpoint interval for that MTBF (0: none)
    raw_runtime_s: float = 0.0      # the job's uncalibrated runtime estimate on this offer
    accelerator: int = 0            # the offer's device class (Accelerator)


# The rows layer: writes of ``jobs`` and ``events``, nothing else.

def _columns(values: Mapping[str, object]) -> None:
    """Raise ValueError unless every name is a column of ``jobs`` (they become SQL)."""
    unknown = set(values) - _COLUMN_SET
    if unknown:
        raise ValueError(f"no such column of jobs: {sorted(unknown)}")


def insert_job(db: Database, row: Mapping[str, object]) -> None:
    """Insert a job's row (jobs/transitions.submit and spawn are its only callers, so that
    what a row holds, and what a child inherits, is decided there once)."""
    _columns(row)
    db["jobs"].insert(dict(row))


def update_job(db: Database, job_id: str, now: int | None, **values: object) -> None:
    """Set columns of a job's row, and its ``updated_at_ms`` to ``now`` (None: left)."""
    if now is not None:
        values["updated_at_ms"] = now
    _columns(values)
    sets = ", ".join(f"{k} = ?" for k in values)
    db.execute(f"UPDATE jobs SET {sets} WHERE id = ?", [*values.values(), job_id])


def update_jobs(db: Database, changes: Mapping[str, Mapping[str, object]], now: int) -> None:
    """``update_job`` of many jobs (by id; every job's changes name the same columns), each
    row's ``updated_at_ms`` set to ``now``: one statement run for every row (executemany:
    SQLite loops in C; on PostgreSQL the rows are sent in one pipeline, not a round trip, nor
    a statement's preparation, a row)."""
    if not changes:
        return
    names = list(next(iter(changes.values())))
    _columns(dict.fromkeys(names))
    sets = ", ".join(f"{k} = ?" for k in names)
    db.conn.executemany(f"UPDATE jobs SET {sets}, updated_at_ms = ? WHERE id = ?",
                        [[*(values[k] for k in names), now, job_id]
                         for job_id, values in changes.items()])


def add_to_job(db: Database, job_id: str, now: int | None, **amounts: int) -> None:
    """Add to counters of a job's row (``log_lines=3``), and set its ``updated_at_ms`` to
    ``now`` (None: left)."""
    _columns(amounts)
    sets = [f"{k} = {k} + ?" for k in amounts]
    args: list[object] = list(amounts.values())
    if now is not None:
        sets.append("updated_at_ms = ?")
        args.append(now)
    db.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE id = ?", [*args, job_id])


def start_billing(db: Database, job_id: str, now: int) -> None:
    """Its current lease is paid from ``now`` on, unless it already was from earlier (a
    re-attached job reporting again changes nothing)."""
    db.execute("UPDATE jobs SET settled_to_ms = coalesce(settled_to_ms, ?) WHERE id = ?",
               [now, job_id])


def set_queue_reasons(db: Database, reasons: Mapping[str, str]) -> None:
    """Why each job (by id) still waits, on its row and on its top job's, where each is
    still queued."""
    for job_id, reason in reasons.items():
        db.execute("UPDATE jobs SET queue_reason = ? WHERE id = ? AND state = ?",
                   [reason, job_id, pb.JOB_STATE_QUEUED])
        db.execute("UPDATE jobs SET queue_reason = ? WHERE state = ? AND id ="
                   " (SELECT parent_id FROM jobs WHERE id = ?)",
                   [reason, pb.JOB_STATE_QUEUED, job_id])


def insert_event(db: Database, job_id: str, type_: str, state: int, attempt: int, now: int,
                 *, provider_id: str = "", message: str = "",
                 progress: dict | None = None) -> None:
    """Append one event to a job's history (what ``watch`` streams)."""
    db.execute(
        "INSERT INTO events (job_id, at_ms, type, state, attempt, provider_id, message, progress)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [job_id, now, type_, state, attempt, provider_id, message,
         json.dumps(progress) if progress is not None else None],
    )


def insert_events(db: Database, events: list[tuple]) -> None:
    """``insert_event`` of many events, in order, as one statement run for every event
    (executemany): each (job_id, at_ms, type, state, attempt, provider_id, message, progress
    as JSON or None)."""
    db.conn.executemany(
        "INSERT INTO events (job_id, at_ms, type, state, attempt, provider_id, message, progress)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?)", events)
