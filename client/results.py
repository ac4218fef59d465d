"""gpumarket results: a finished job's receipts checked (the provider's signature, the job,
its spec, the kind's output rule) and its outputs downloaded, each hash checked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gpumarket.client import tasks
from gpumarket.client.console import command, dump, load_identity, out
from gpumarket.proto.errors import BadSignature, FailedPrecondition
from gpumarket.proto.jobspec import state_name
from gpumarket.proto.v1 import types_pb2 as pb

if TYPE_CHECKING:   # annotations only: commands get it from the cli group
    from gpumarket.link.client import Broker


def verify_receipts(job: pb.Job, client_id: str | None) -> list[pb.Receipt]:
    """Check that the job's receipt (one per part for a split job) is signed by the provider
    that ran it and is for this exact spec; return them."""
    from gpumarket import kinds
    from gpumarket.proto.envelope import open_envelope

    if job.state != pb.JOB_STATE_SUCCEEDED:
        raise FailedPrecondition(f"job {job.job_id} is {state_name(job.state)}, not SUCCEEDED")
    spec, signer = open_envelope(job.spec, pb.JobSpec)
    if client_id is not None and signer != client_id:
        raise BadSignature(f"job {job.job_id} was not signed by your key")
    runs = [(p.job_id, p.provider_id, p.receipt) for p in job.parts] or [
        (job.job_id, job.provider_id, job.receipt)]
    receipts, names = [], set()
    for job_id, provider_id, envelope in runs:
        receipt = tasks.open_receipt(envelope, provider_id, job_id, job.spec)
        for ref in receipt.outputs:
            if ref.name in names:
                raise BadSignature(f"two parts of job {job.job_id} both wrote {ref.name}")
            names.add(ref.name)
        receipts.append(receipt)
    problem = kinds.get(spec.kind).output_problem(kinds.values_of(spec), names)
    if problem:
        raise BadSignature(f"job {job.job_id}: {problem}")
    return receipts


def merged_metrics(receipts: list[pb.Receipt]) -> dict[str, float]:
    """One job's figures from its parts' receipts: counts add up, seconds per frame is
    weighted by frames rendered, frames per hour adds up (the parts run at once)."""
    if len(receipts) == 1:
        return dict(receipts[0].metrics)
    merged: dict[str, float] = {}
    for r in receipts:
        for key, value in r.metrics.items():
            merged[key] = merged.get(key, 0.0) + value
    rendered = sum(r.metrics.get("frames_rendered", 0.0) for r in receipts)
    if rendered:
        merged["seconds_per_frame"] = sum(r.metrics.get("seconds_per_frame", 0.0)
                                          * r.metrics.get("frames_rendered", 0.0)
                                          for r in receipts) / rendered
    merged["gpu"] = max((r.metrics.get("gpu", 0.0) for r in receipts), default=0.0)
    merged["parts"] = float(len(receipts))
    return merged


@click.command()
@click.argument("job_id")
@click.option("-o", "--output", "output_dir", type=click.Path(file_okay=False, path_type=Path),
              required=True, help="Directory to write the outputs into.")
@click.option("--task", type=click.IntRange(0),
              help="A job array: only this task's outputs.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
@command
async def results(market: Broker, job_id: str, output_dir: Path, task: int | None,
                  as_json: bool) -> None:
    """Download a finished job's outputs, checking every receipt's signature and every hash
    (a split job's parts are merged into one directory; a job array's succeeded tasks, even
    while others run, each into a directory task-NNNNNN)."""
    from rich.table import Table

    from gpumarket.proto.artifacts import write_atomically

    identity = load_identity()
    async with market.client(identity) as broker:
        job_id = await broker.job_id(job_id)
        job = await broker.get_job(job_id)
        if job.array.tasks:
            found = await tasks.fetch_results(broker, job, identity.id, output_dir, task)
            if as_json:
                dump(found)
            else:
                out.print(f"{tasks.summary(job.array)}; {found['files']} files of"
                          f" {len(found['tasks'])} tasks in {output_dir}, each matching its"
                          " signed hash")
            return
        if task is not None:
            raise FailedPrecondition(f"job {job_id} is not a job array: it has no tasks")
        receipts = verify_receipts(job, identity.id)
        output_dir.mkdir(parents=True, exist_ok=True)
        for receipt in receipts:
            for ref in receipt.outputs:
                await broker.download(ref, output_dir / ref.name)
    outputs = [r for receipt in receipts for r in receipt.outputs]
    summary = {
        "job_id": job.job_id,
        "provider_id": ",".join(dict.fromkeys(r.provider_id for r in receipts)),
        "attempt": max(r.attempt for r in receipts),
        "wall_seconds": max(r.wall_seconds for r in receipts),
        "device_seconds": sum(r.device_seconds for r in receipts),
        "metrics": merged_metrics(receipts),
        "outputs": [{"name": r.name, "sha256": r.sha256, "size_bytes": r.size_bytes}
                    for r in outputs],
        # The provider's signature over these hashes checks out, and the bytes match them;
        # whether the provider computed them right is what the broker's spot checks say.
        "receipt_signature": "valid",
        "content": job.verification.status or "unverified",
        "checks": [{"what": c.what, "provider_id": c.provider_id, "checker_id": c.checker_id,
                    "state": c.state, "detail": c.detail} for c in job.verification.checks],
    }
    if len(receipts) > 1:
        summary["parts"] = [{"part": i, "job_id": r.job_id, "provider_id": r.provider_id,
                             "attempt": r.attempt, "wall_seconds": r.wall_seconds,
                             "metrics": dict(r.metrics)} for i, r in enumerate(receipts, 1)]
    write_atomically(output_dir / "receipt.json", json.dumps(summary, indent=2).encode())
    if as_json:
        dump(summary)
        return
    for r in receipts:
        out.print(f"receipt signed by provider {r.provider_id}: signature valid"
                  + (f" ({r.job_id})" if len(receipts) > 1 else ""))
    table = Table("output", "bytes", "sha256")
    for r in outputs:
        table.add_row(r.name, str(r.size_bytes), r.sha256[:16] + "…  ok")
    out.print(table)
    metrics = ", ".join(f"{k} {v:.4g}" for k, v in sorted(summary["metrics"].items()))
    states = [c.state for c in job.verification.checks]
    passed = states.count("passed")
    content = {"verified": f"verified: {passed} spot check{'s' if passed != 1 else ''} by"
                           " replay on other providers agreed",
               "unverified": "unverified: part of it was disputed and never settled (not"
                             " charged)" if "inconclusive" in states else
                             "unverified: no spot check replayed this work (the results are"
                             " the provider's word)"}.get(summary["content"], summary["content"])
    out.print(f"{len(outputs)} files in {output_dir}, each matching its signed hash; {content};"
              f" {metrics}")


COMMANDS = (results,)
