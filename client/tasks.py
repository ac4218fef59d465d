"""A job array's tasks on the client: ``gpumarket tasks ARRAY`` lists them, and ``results``
fetches each succeeded task's outputs into its own directory as tasks complete
(docs/jobs.md)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gpumarket.client.console import command, dump, err, load_identity, out
from gpumarket.proto.artifacts import CHUNK_BYTES
from gpumarket.proto.errors import BadSignature, FailedPrecondition
from gpumarket.proto.jobspec import (
    NONCE_BYTES, STATES_BY_NAME, check_artifact_name, now_ms, state_name,
)
from gpumarket.proto.v1 import types_pb2 as pb

if TYPE_CHECKING:   # annotations only: commands get it from the cli group
    from gpumarket.link.client import Broker, BrokerClient

PAGE = 10_000
BLOBS_PER_CALL = 1000       # small files downloaded (or a job's inputs uploaded) in one call ...
BLOB_CALL_BYTES = 16 << 20  # ... and their bytes


def summary(progress: pb.ArrayProgress) -> str:
    """'1,000 tasks: 990 succeeded, 10 failed'."""
    parts = [(progress.queued, "queued"), (progress.running, "running"),
             (progress.succeeded, "succeeded"), (progress.failed, "failed"),
             (progress.cancelled, "cancelled")]
    return f"{progress.tasks:,} tasks: " + ", ".join(f"{n:,} {w}" for n, w in parts if n)


async def all_tasks(broker: BrokerClient, job_id: str, states: list[int] | None = None,
                    from_task: int = 0, limit: int = 0) -> list[pb.ArrayTask]:
    """The array's tasks (of ``states``) from ``from_task``, every page, up to ``limit``."""
    found: list[pb.ArrayTask] = []
    while True:
        page = await broker.list_tasks(job_id, from_task, PAGE, states)
        found += page.tasks
        if not page.next_task or (limit and len(found) >= limit):
            return found[:limit] if limit else found
        from_task = page.next_task


@click.command("tasks")
@click.argument("job_id")
@click.option("--state", "states", multiple=True,
              type=click.Choice(sorted(STATES_BY_NAME), case_sensitive=False),
              help="Only tasks in this state (repeatable).")
@click.option("--from", "from_task", type=click.IntRange(0), default=0,
              help="First task to show (0-based).")
@click.option("--limit", type=click.IntRange(1), default=100, show_default=True,
              help="Most tasks to show.")
@click.option("--failed", "failed", is_flag=True,
              help="Print only the failed tasks' indices, on one line as `resubmit --tasks`"
                   " takes them (3,17,40-45).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
@command
async def tasks_command(market: Broker, job_id: str, states: tuple[str, ...], from_task: int,
                        limit: int, failed: bool, as_json: bool) -> None:
    """List a job array's tasks: state, attempts, provider, time and error of each."""
    from rich.table import Table

    from gpumarket.kinds import arrays
    from gpumarket.proto.present import short

    wanted = [STATES_BY_NAME[s.upper()] for s in states]
    async with market.client(load_identity()) as broker:
        job_id = await broker.job_id(job_id)
        if failed:
            indices = [t.task for t in await all_tasks(broker, job_id, [pb.JOB_STATE_FAILED])]
            if as_json:
                dump({"job_id": job_id, "failed": indices})
            elif indices:
                click.echo(arrays.format_indices(indices))
            else:
                err.print(f"no task of {job_id} failed")
            return
        # The first page carries the array's progress too: no call of its own for it.
        page = await broker.list_tasks(job_id, from_task, min(limit, PAGE), wanted)
        found = list(page.tasks)[:limit]
        if page.next_task and len(found) < limit:
            found += await all_tasks(broker, job_id, wanted, page.next_task,
                                     limit - len(found))
    if as_json:
        dump({"job_id": job_id, "progress": progress_dict(page.progress),
              "tasks": [task_dict(t) for t in found]})
        return
    out.print(summary(page.progress))
    table = Table("task", "state", "attempts", "provider", "seconds", "outputs", "error")
    for t in found:
        table.add_row(str(t.task), state_name(t.state), str(t.attempts),
                      short(t.provider_id) if t.provider_id else "-", f"{t.seconds:.3f}",
                      str(len(t.outputs)), t.error)
    out.print(table)


def progress_dict(p: pb.ArrayProgress) -> dict:
    return {"tasks": p.tasks, "queued": p.queued, "running": p.running,
            "succeeded": p.succeeded, "failed": p.failed, "cancelled": p.cancelled}


def task_dict(t: pb.ArrayTask) -> dict:
    return {"task": t.task, "state": state_name(t.state), "attempts": t.attempts,
            "provider_id": t.provider_id, "seconds": t.seconds, "error": t.error,
            "batch": t.lease_job_id, "updated_at_ms": t.updated_at_ms,
            "outputs": [{"name": o.name, "sha256": o.sha256, "size_bytes": o.size_bytes}
                        for o in t.outputs]}


def open_receipt(envelope: pb.Envelope, provider_id: str, job_id: str, spec: pb.Envelope,
                 task: int | None = None) -> pb.Receipt:
    """A receipt signed by ``provider_id``, the provider that ran ``job_id`` (a job, a part
    of one, or an array's lease; ``task``: for that task's outputs alone), for this exact
    ``spec``, its output names checked; BadSignature (or InvalidArgument) otherwise."""
    from gpumarket.proto.envelope import open_envelope, payload_sha256

    what = f"receipt of {job_id}" if task is None else f"task {task}: its receipt"
    receipt, provider = open_envelope(envelope, pb.Receipt)
    if provider != receipt.provider_id or provider != provider_id:
        raise BadSignature(f"{what} is not signed by the provider that ran it")
    if receipt.job_id != job_id or receipt.spec_sha256 != payload_sha256(spec):
        raise BadSignature(f"{what} is for another job")
    for i, ref in enumerate(receipt.outputs):
        check_artifact_name(ref.name, ("" if task is None else f"task {task}: ")
                            + f"receipt.outputs[{i}].name")
    return receipt


def signed_outputs(job: pb.Job, client_id: str) -> dict[str, pb.Receipt]:
    """Every output of the array's finished batches (by name), each from a receipt signed by
    the provider that ran the batch, for this exact spec."""
    from gpumarket.proto.envelope import open_envelope

    _, signer = open_envelope(job.spec, pb.JobSpec)
    if signer != client_id:
        raise BadSignature(f"job {job.job_id} was not signed by your key")
    found: dict[str, pb.Receipt] = {}
    for part in job.parts:
        if part.receipt.payload:
            receipt = open_receipt(part.receipt, part.provider_id, part.job_id, job.spec)
            found.update(dict.fromkeys((ref.name for ref in receipt.outputs), receipt))
    return found


def task_receipt(job: pb.Job, t: pb.ArrayTask,
                 opened: dict[bytes, pb.Receipt] | None = None) -> pb.Receipt:
    """The receipt for a task's outputs (they went up as it ended), signed by the provider
    that ran it, for the lease that ran it and this exact spec: the task's own, or its task
    results update's (one for many tasks, kinds/receipt_tree.py), which must sign exactly
    the outputs the task lists by its path (returned naming them). ``opened``: receipts
    checked already, by signature (an update's covers many tasks: one check)."""
    from gpumarket.kinds import receipt_tree

    key = t.receipt.SerializeToString()
    receipt = None if opened is None else opened.get(key)
    if receipt is None or receipt.job_id != t.lease_job_id or \
            receipt.provider_id != t.provider_id:
        receipt = open_receipt(t.receipt, t.provider_id, t.lease_job_id, job.spec, t.task)
        if opened is not None:
            opened[key] = receipt
    if not receipt.tasks_root:
        return receipt
    if not receipt_tree.covers(receipt, t.task, t.outputs, t.receipt_path):
        raise BadSignature(f"task {t.task}: its outputs are not the ones its receipt signs")
    own = pb.Receipt()
    own.CopyFrom(receipt)
    own.outputs.extend(t.outputs)
    return own


async def fetch_results(broker: BrokerClient, job: pb.Job, client_id: str, output_dir: Path,
                        only: int | None) -> dict:
    """Download the outputs of the array's succeeded tasks (or task ``only``) into
    ``output_dir/task-NNNNNN/``, each checked against a signed receipt and its hash; write
    ``tasks.json``; return the summary."""
    from gpumarket.kinds import arrays

    signed = signed_outputs(job, client_id)
    states = [pb.JOB_STATE_SUCCEEDED] if only is None else []
    found = await all_tasks(broker, job.job_id, states, only or 0, 1 if only is not None else 0)
    if only is not None and (not found or found[0].task != only):
        raise FailedPrecondition(f"job {job.job_id} has no task {only}")
    output_dir.mkdir(parents=True, exist_ok=True)
    small: list[tuple[pb.ArtifactRef, Path]] = []
    large: list[tuple[pb.ArtifactRef, Path]] = []
    opened: dict[bytes, pb.Receipt] = {}
    for t in found:
        own = task_receipt(job, t, opened) if t.receipt.payload else None
        for ref in t.outputs:
            named = arrays.output_task(ref.name)
            receipt = own or signed.get(ref.name)
            if named is None or named[0] != t.task or receipt is None or not any(
                    o.sha256 == ref.sha256 for o in receipt.outputs if o.name == ref.name):
                raise BadSignature(f"task {t.task}: output {ref.name} is in no signed receipt")
            check_artifact_name(named[1], f"task {t.task}: output")
            target = output_dir / f"task-{t.task:06d}"
            target.mkdir(exist_ok=True)
            (small if ref.size_bytes <= CHUNK_BYTES else large).append((ref, target / named[1]))
    # Small files many to a call (a sweep's thousands of result files are not thousands of
    # calls against the broker's per-key rate), large ones each on its own (resumable).
    group: list[tuple[pb.ArtifactRef, Path]] = []
    size = 0
    for ref, target in small:
        if group and (len(group) == BLOBS_PER_CALL or size + ref.size_bytes > BLOB_CALL_BYTES):
            await broker.artifacts.download_blobs(group)
            group, size = [], 0
        group.append((ref, target))
        size += ref.size_bytes
    if group:
        await broker.artifacts.download_blobs(group)
    for ref, target in large:
        await broker.download(ref, target)
    files = len(small) + len(large)
    result = {"job_id": job.job_id, "progress": progress_dict(job.array), "files": files,
              "receipt_signature": "valid", "tasks": [task_dict(t) for t in found]}
    (output_dir / "tasks.json").write_text(json.dumps(result, indent=2))
    return result


@click.command("resubmit")
@click.argument("job_id")
@click.option("--failed", "failed", is_flag=True,
              help="Run again the tasks of the array that failed.")
@click.option("--tasks", "indices", metavar="LIST",
              help="Run again these tasks of the array: indices and ranges, 3,17,40-45.")
@click.option("--watch", "watch_", is_flag=True, help="Follow the new array until it ends.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
@command
async def resubmit_command(market: Broker, job_id: str, failed: bool, indices: str | None,
                           watch_: bool, as_json: bool) -> None:
    """Submit a job array again for some of its tasks only (its failed ones, or those named):
    a new array, signed anew, whose tasks keep their indices, so each does the same work
    with the same inputs; print its id."""
    from gpumarket.client.watch import EXIT_BY_STATE, follow
    from gpumarket.kinds import arrays
    from gpumarket.proto.envelope import open_envelope, seal

    if failed == (indices is not None):
        raise click.UsageError("give either --failed or --tasks LIST")
    identity = load_identity()
    async with market.client(identity) as broker:
        job_id = await broker.job_id(job_id)
        job = await broker.get_job(job_id)
        spec, signer = open_envelope(job.spec, pb.JobSpec)
        if signer != identity.id:
            raise BadSignature(f"job {job_id} was not signed by your key")
        if not arrays.is_array(spec):
            raise FailedPrecondition(f"job {job_id} is not a job array: it has no tasks")
        if failed:
            chosen = [t.task for t in await all_tasks(broker, job_id, [pb.JOB_STATE_FAILED])]
            if not chosen:
                raise FailedPrecondition(f"no task of {job_id} failed: nothing to resubmit")
        else:
            try:
                chosen = arrays.parse_indices(indices, spec.array.count)
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint="--tasks") from exc
        resubmitted = again(spec, chosen, now_ms())
        resp = await broker.submit(seal(identity, resubmitted))
        if as_json:
            dump({"job_id": resp.job_id, "state": state_name(resp.state), "of": job_id,
                  "tasks": chosen})
        else:
            click.echo(resp.job_id)
            err.print(f"{len(chosen):,} tasks of {job_id} ({arrays.format_indices(chosen)})")
        if watch_:
            state = await follow(broker, resp.job_id, as_json, out)
            sys.exit(EXIT_BY_STATE.get(state, 1))


def again(spec: pb.JobSpec, tasks: list[int], created_ms: int) -> pb.JobSpec:
    """The array ``spec`` for ``tasks`` alone (each keeps its index, its line of the same
    tasks input), new (nonce, times) so that it is a submission of its own."""
    out = pb.JobSpec()
    out.CopyFrom(spec)
    out.nonce = os.urandom(NONCE_BYTES)
    out.created_at_ms = created_ms
    out.expires_at_ms = created_ms + max(spec.expires_at_ms - spec.created_at_ms, 0)
    del out.array.only[:]
    out.array.only.extend(tasks)
    return out
