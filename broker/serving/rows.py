"""Serving's rows as the broker reads them: each an immutable value made from a row in one
place (``from_row``), read by attribute (``replica.state``), so that a column renamed or gone
fails where the row is read, not in the router or a servicer (as ``jobs/job.Job`` is for a
job).

- ``LiveReplica``: one live replica of an endpoint, its job row's columns joined with its
  current lease's (``endpoints.replicas``);
- ``LiveEndpoint``: a serving endpoint with its settings and live replicas
  (``endpoints.live``: what the router and the autoscaler keep in step with);
- ``EndpointKey``: one of an endpoint's API keys (``endpoint_keys``; only its sha256 is
  kept, never the secret);
- ``Usage``: the requests and tokens an endpoint's replica leases served
  (``endpoint_usage``, summed);
- ``Overview``: what ``endpoint list``/``show`` tell of an endpoint from the database.

None of them answers ``row["column"]``: every reader (the router, the autoscaler, the
HTTP side's endpoints page, the marketplace's views) names the field, which a type checker
and a reader can follow (``tests/test_typed_rows.py`` checks their source for reads by
key). Of the broker, only ``jobs/job`` is imported here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from gpumarket.broker.jobs.job import Job


@dataclass(frozen=True)
class LiveReplica:
    """A live replica (QUEUED, LEASED, RUNNING or PAUSED): its job row's columns and its
    current lease's (None where it has no lease)."""

    id: str                         # the replica's job id
    part: int                       # its number under its endpoint (1-based)
    state: int                      # JobState number
    epoch: int = 0                  # its current lease's epoch (0: never leased)
    provider_id: str | None = None  # its current lease's holder
    progress_step: int = 0          # 1 once its engine is ready under this lease
    attempt: int = 1
    lease_id: str | None = None
    issued_at_ms: int | None = None  # when its current lease was made
    accelerator: int | None = None  # its lease's device class (Accelerator)

    COLUMNS = ("j.id, j.part, j.state, j.epoch, j.provider_id, j.progress_step, j.attempt,"
               " j.lease_id, l.issued_at_ms, l.accelerator")

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> LiveReplica:
        """The replica of a row selected with ``COLUMNS`` (``jobs j`` left-joined with
        ``leases l``); raises KeyError if a column is missing."""
        return cls(**{f.name: row[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class LiveEndpoint:
    """A serving endpoint (its top job RUNNING), as the router keeps it."""

    id: str                         # the endpoint's top job id
    client_id: str
    name: str                       # the model name its API answers to
    settings: dict                  # kinds/endpoint.settings_of its spec
    created_at_ms: int = 0
    replicas: tuple[LiveReplica, ...] = ()


@dataclass(frozen=True)
class EndpointKey:
    """One API key of an endpoint (what a client sees of it: never the secret)."""

    key_id: str
    created_at_ms: int
    revoked_at_ms: int = 0          # 0: not revoked

    COLUMNS = ("key_id", "created_at_ms", "revoked_at_ms")    # of endpoint_keys

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> EndpointKey:
        """The key of an ``endpoint_keys`` row (a NULL ``revoked_at_ms`` is 0)."""
        return cls(row["key_id"], row["created_at_ms"], row["revoked_at_ms"] or 0)


@dataclass(frozen=True)
class Usage:
    """What an endpoint's replica leases served, summed over them."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True)
class Overview:
    """An endpoint as the database tells it: its top job, settings, live replicas, durable
    usage, keys and latest events (event rows as dicts: ``seq``, ``job_id``, ``at_ms``,
    ``type``, ``state``, ``attempt``, ``provider_id``, ``message``)."""

    top: Job
    settings: dict
    replicas: tuple[LiveReplica, ...]
    usage: Usage
    keys: tuple[EndpointKey, ...] = ()
    events: tuple[dict, ...] = ()
