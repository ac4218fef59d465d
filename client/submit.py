"""gpumarket submit: a job file becomes a signed job on the broker — funds checked before
anything is uploaded, its inputs uploaded, its spec built and signed (`quote` and
`endpoint create` share these steps)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gpumarket.client.console import command, dump, load_identity, out
from gpumarket.proto.errors import InsufficientFunds
from gpumarket.proto.jobspec import NONCE_BYTES, now_ms, state_name
from gpumarket.proto.money import fmt
from gpumarket.proto.v1 import types_pb2 as pb

if TYPE_CHECKING:   # annotations only: commands get it from the cli group; the job file
    # (and with it the job kinds) is imported by the commands that read one
    from gpumarket.client import jobfile
    from gpumarket.link.client import Broker, BrokerClient


async def upload_inputs(broker: BrokerClient, job: jobfile.JobFile) -> list[pb.ArtifactRef]:
    """Upload the job file's inputs (a directory as a tar); return their references, in its
    order. The small ones (at most CHUNK_BYTES each: a script, an array's tasks, a config,
    the files its [array] inputs list) go whole, many to one UploadBlobs call: one round
    trip for all of them, not one each; a larger one goes on its own, chunked and
    resumable."""
    import asyncio
    import hashlib

    from gpumarket.client import jobfile
    from gpumarket.proto.artifacts import CHUNK_BYTES

    refs: list[pb.ArtifactRef | None] = [None] * len(job.inputs)
    small: list[tuple[int, str, bytes]] = []        # (input's index, sha256, bytes)
    for i, item in enumerate(job.inputs):
        data = item.data
        if data is None:
            data = await asyncio.to_thread(jobfile.pack_directory, item.path) \
                if item.path.is_dir() else _small_file(item.path, CHUNK_BYTES)
        # A path as it is: rich's console took "[x]" in one for markup and dropped it
        # (and importing rich for these lines took ~20 ms of every submission).
        click.echo(f"uploading {'its tasks' if item.data is not None else item.path}"
                   f" as {item.name}", err=True)
        if data is not None and len(data) <= CHUNK_BYTES:
            small.append((i, hashlib.sha256(data).hexdigest(), data))
        elif data is None:
            refs[i] = await broker.upload(item.path, item.name)
        else:
            refs[i] = await _upload_bytes(broker, data, item.name)
    for group in _blob_calls(small):
        await broker.artifacts.upload_blobs([(sha, data) for _, sha, data in group])
        for i, sha, data in group:
            refs[i] = pb.ArtifactRef(name=job.inputs[i].name, sha256=sha, size_bytes=len(data))
    return refs


def _small_file(path: Path, limit: int) -> bytes | None:
    """The file's bytes if it has at most ``limit`` of them, else None."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data if len(data) <= limit else None


async def _upload_bytes(broker: BrokerClient, data: bytes, name: str) -> pb.ArtifactRef:
    """Upload ``data`` larger than one blob, from an unnamed temporary file."""
    import tempfile

    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        return await broker.upload(f.fileno(), name)


def _blob_calls(small: list[tuple[int, str, bytes]]):
    """``small`` in groups that one UploadBlobs call takes (tasks.BLOBS_PER_CALL blobs,
    tasks.BLOB_CALL_BYTES bytes: the broker's limits are 1,000 and 32 MiB)."""
    from gpumarket.client.tasks import BLOB_CALL_BYTES, BLOBS_PER_CALL

    group: list[tuple[int, str, bytes]] = []
    size = 0
    for blob in small:
        if group and (len(group) == BLOBS_PER_CALL or size + len(blob[2]) > BLOB_CALL_BYTES):
            yield group
            group, size = [], 0
        group.append(blob)
        size += len(blob[2])
    if group:
        yield group


async def check_funds(broker: BrokerClient, job: jobfile.JobFile) -> None:
    """Refuse, before anything is uploaded, a job the caller's available balance cannot
    hold: the least the broker would hold for it (jobfile.least_hold) against the balance,
    where the broker enforces funds; the broker checks the exact hold at submit. Raises
    InsufficientFunds."""
    from gpumarket.client import jobfile

    account = await broker.account(limit=1)
    least, basis = jobfile.least_hold(job)
    if account.billing and account.available < least:
        raise InsufficientFunds(
            f"insufficient funds: this job holds at least {fmt(least)} credits ({basis}); your"
            f" available balance is {fmt(account.available)}, {fmt(least - account.available)}"
            " short (ask the broker's operator for credit, or set a smaller budget in the job"
            " file); nothing was uploaded")


def build_spec(job: jobfile.JobFile, refs: list[pb.ArtifactRef], created_ms: int) -> pb.JobSpec:
    from gpumarket import kinds
    from gpumarket.client import arrays as job_arrays

    spec = pb.JobSpec(
        name=job.name, kind=job.kind,
        resources=pb.Resources(gpus=job.gpus, min_memory_bytes=job.min_memory_bytes,
                               accelerator=job.accelerator,
                               min_compute_capability=job.min_compute_capability,
                               gpu_models=list(job.gpu_models)),
        objective=job.objective, deadline_s=job.deadline_s, min_reliability=job.min_reliability,
        max_price_per_gpu_hour=job.max_price, inputs=refs, max_runtime_s=job.max_runtime_s,
        max_attempts=job.max_attempts, nonce=os.urandom(NONCE_BYTES),
        budget=job.budget, min_provider_stake=job.min_provider_stake,
        verify_rate=job.verify_rate, tier=job.tier, preemptible=job.preemptible,
        created_at_ms=created_ms, expires_at_ms=created_ms + job.expires_in_s * 1000,
    )
    kinds.get(job.kind).write(spec, job.params)
    if job.array_count:
        spec.array.CopyFrom(pb.JobArray(count=job.array_count, per_lease=job.array_per_lease,
                                        tasks_input=job_arrays.TASKS_INPUT))
    return spec


@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--watch", "watch_", is_flag=True, help="Follow the job until it ends.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
@command
async def submit(market: Broker, job_file: Path, watch_: bool, as_json: bool) -> None:
    """Upload JOB_FILE's inputs, sign the job, submit it, and print its id (a job your
    available balance cannot hold is refused before anything is uploaded)."""
    from gpumarket.client import jobfile
    from gpumarket.proto.envelope import seal

    job = jobfile.load(job_file)
    identity = load_identity()
    async with market.client(identity) as broker:
        await check_funds(broker, job)
        refs = await upload_inputs(broker, job)
        spec = build_spec(job, refs, now_ms())
        resp = await broker.submit(seal(identity, spec))
        if as_json:
            dump({"job_id": resp.job_id, "state": state_name(resp.state)})
        else:
            click.echo(resp.job_id)
        if watch_:
            from gpumarket.client.watch import EXIT_BY_STATE, follow

            state = await follow(broker, resp.job_id, as_json, out)
            sys.exit(EXIT_BY_STATE.get(state, 1))


COMMANDS = (submit,)
