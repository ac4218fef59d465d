"""Submitting a job: ``api/marketplace.SubmitJob``'s one domain call. A spec signed by its
client becomes a stored job — its parameters and freshness checked, its inputs the client's
to use, sized and admitted (market/admission: its size, its needs and its shape), its
hold sized from the live offers (money/credit_holds) — written in the shape admission chose
(``store``): one job or a split job and its parts (jobs/transitions.submit), a job array and
its batches (jobs/arrays.submit), an endpoint and its replicas (serving/endpoints.submit).

``quote`` sizes a spec the same way and stores nothing (``Quote``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlite_utils import Database

from gpumarket import kinds
from gpumarket.broker.jobs import arrays
from gpumarket.broker.jobs import transitions
from gpumarket.broker.jobs import views
from gpumarket.broker.market import admission
from gpumarket.broker.market import matcher
from gpumarket.broker.market import scheduler
from gpumarket.broker.money import credit_holds
from gpumarket.broker.serving import endpoints
from gpumarket.kinds import arrays as task_arrays
from gpumarket.proto.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from gpumarket.proto.jobspec import check_fresh
from gpumarket.proto.v1 import types_pb2 as pb

if TYPE_CHECKING:
    from gpumarket.broker.state import BrokerState

CANDIDATES = 50     # the offers a hold (and a quote) is sized from, best first


async def submit(state: BrokerState, envelope: pb.Envelope, spec: pb.JobSpec, client_id: str,
                 now: int) -> str:
    """Store the job of ``spec`` (``envelope``'s payload, signed by ``client_id``) in the
    shape its admission chose, with its hold and first event, QUEUED; return its id.
    Raises InvalidArgument (the spec, its inputs or an array's tasks), FailedPrecondition
    (an input that is not the client's), ResourceExhausted (too many queued jobs),
    InsufficientFunds (the hold), Replay (a spec submitted before)."""
    values = kinds.check_spec(spec)
    check_fresh(spec)
    cfg = state.config
    queued = await state.store.read(views.queued_count, client_id)
    if queued >= cfg.max_queued_jobs:
        raise ResourceExhausted(f"you already have {queued} queued jobs, this broker's limit"
                                " per client; wait for some to start, or cancel some",
                                reason="quota")
    await check_inputs(state, spec, client_id)
    est = await asyncio.to_thread(admission.estimate, kinds.get(spec.kind), values, spec,
                                  state.artifacts.blob_path)
    job = admission.admit(envelope, spec, client_id, values, est, cfg)
    book = None
    if job.shape == "array":                # every task runs, or the submission says which not
        await asyncio.to_thread(check_tasks, state, spec, values)
        if not spec.array.per_lease:        # spread over the devices that fit it
            book = await scheduler.recent_book(state)
            job = dataclasses.replace(job, lanes=book.lanes(job.needs.view("quote", client_id)))
    if job.needs.tier in ("interruptible", "standard") and job.needs.deadline_s:
        # A deadline no offer could meet even now is refused, nothing written (timed on
        # the fastest offers that fit it).
        fastest = dataclasses.replace(job.needs, objective="fastest")
        book, found, _ = await timed(state, fastest, client_id, CANDIDATES, book)
        admission.check_deadline(job.needs, found)
    held, basis = await hold(state, job.needs, client_id, job.runs_at_once, spec.budget, book)
    job = dataclasses.replace(job, hold=held, hold_basis=basis, fee_ppm=cfg.fee_ppm,
                              enforce_funds=cfg.billing)
    return await state.store.write(store, job, now)


def store(db: Database, job: admission.NewJob, now: int) -> str:
    """Write a new job in its shape, in one transaction; return its id (not its row read
    back: on PostgreSQL a round trip a submission, for the id the caller has)."""
    if job.shape == "array":
        arrays.submit(db, job, now, lanes=job.lanes)
    elif job.shape == "endpoint":
        endpoints.submit(db, job, now)
    else:                                   # one job, or a split job and its parts
        transitions.submit(db, job, now)
    return job.id


def check_tasks(state: BrokerState, spec: pb.JobSpec, values: dict) -> None:
    """Every task of an array runs, or the submission says which does not (InvalidArgument);
    reads the tasks file, so off the event loop."""
    ref = next(r for r in spec.inputs if r.name == spec.array.tasks_input)
    path = state.artifacts.blob_path(ref.sha256)
    if path.stat().st_size > task_arrays.MAX_TASKS_BYTES:
        raise InvalidArgument(f"array.tasks: more than {task_arrays.MAX_TASKS_BYTES >> 20}"
                              " MiB")
    data = path.read_bytes()
    try:
        task_arrays.check_tasks(kinds.get(spec.kind), values, data, spec.array.count,
                                {r.name for r in spec.inputs})
    except kinds.ParamError as exc:
        raise InvalidArgument(str(exc)) from exc


async def check_inputs(state: BrokerState, spec: pb.JobSpec, key_id: str) -> None:
    """Raise unless ``key_id`` may use every input: one answer for a blob that is absent
    and one it may not read, so that nobody learns what others have uploaded."""
    for i, ref in enumerate(spec.inputs):
        size = await state.store.read(views.artifact_size, ref.sha256)
        if size is None or not await state.store.read(views.may_read, key_id, ref.sha256):
            raise FailedPrecondition(f"inputs[{i}] ({ref.name}): artifact {ref.sha256[:12]}…"
                                     " is not uploaded (by you); upload it first")
        if size != ref.size_bytes:
            raise InvalidArgument(f"inputs[{i}] ({ref.name}): size {ref.size_bytes} does"
                                  f" not match the stored {size} bytes")


async def timed(state: BrokerState, needs: admission.Needs, client_id: str, limit: int,
                book: matcher.Book | None = None
                ) -> tuple[matcher.Book, list[credit_holds.Timed], dict[str, int]]:
    """The offers that fit a job not stored yet, best first, each with the job's calibrated
    wall time, and what excluded the others (``book``: the live offers, if read already;
    else the Book the submissions share, scheduler.recent_book: up to a second old)."""
    if book is None:
        book = await scheduler.recent_book(state)
    view = needs.view("quote", client_id)
    found, excluded = book.candidates(view, limit)
    return book, await state.store.read(credit_holds.timed, book, view, found), excluded


async def hold(state: BrokerState, needs: admission.Needs, client_id: str, runs: int,
               budget: float, book: matcher.Book | None = None) -> tuple[int, str]:
    """(units to hold, what that rests on) for a job of ``needs`` that runs ``runs`` at once
    (credit_holds.amount)."""
    found = [] if budget else (await timed(state, needs, client_id, CANDIDATES, book))[1]
    return credit_holds.amount(needs, runs, found, budget)


@dataclass(frozen=True)
class Quote:
    """Where a spec would run and what submitting it would hold."""

    needs: admission.Needs
    work_flops: float
    book: matcher.Book
    timed: list[credit_holds.Timed]     # the offers that fit it, best first
    excluded: dict[str, int]            # offers left out, by reason
    hold: int
    hold_basis: str


async def quote(state: BrokerState, spec: pb.JobSpec, client_id: str) -> Quote:
    """Size ``spec`` as ``submit`` would, from the offers live now; store nothing. A quote
    needs a well-formed spec but no nonce, times or signature. Raises InvalidArgument,
    FailedPrecondition (an input that is not the client's)."""
    values = check_spec_for_quote(spec)
    kind = kinds.get(spec.kind)
    await check_inputs(state, spec, client_id)   # the broker sizes the job from its inputs
    est = await asyncio.to_thread(admission.estimate, kind, values, spec,
                                  state.artifacts.blob_path)
    needs = admission.needs(spec, values, est)
    book, found, excluded = await timed(state, needs, client_id, CANDIDATES)
    held, basis = credit_holds.amount(needs, admission.runs_at_once(spec, values), found,
                                      spec.budget)
    return Quote(needs, est.work_flops, book, found, excluded, held, basis)


def check_spec_for_quote(spec: pb.JobSpec) -> dict:
    """A quote needs a well-formed spec but no nonce, times or signature; return its
    kind's parameters."""
    probe = pb.JobSpec()
    probe.CopyFrom(spec)
    probe.nonce = b"\0" * 16
    probe.created_at_ms, probe.expires_at_ms = 1, 2
    return kinds.check_spec(probe)
