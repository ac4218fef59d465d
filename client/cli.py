"""gpumarket: submit signed jobs to a GPU marketplace, watch them, and fetch their results
(receipt signature and hashes checked).

Exit codes: 0 ok; 1 error (bad input, broker unreachable, refused); 2 usage;
3 the job FAILED; 4 the job was CANCELLED (watch and submit --watch).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import click
from google.protobuf.json_format import MessageToDict
from rich.table import Table

from gpumarket import kinds
from gpumarket.client import arrays as job_arrays
from gpumarket.client import endpoints, jobfile, money, tasks
from gpumarket.client.console import clock, command, dump, err, key_path, load_identity, out
from gpumarket.proto.artifacts import write_atomically
from gpumarket.proto.envelope import open_envelope, seal
from gpumarket.proto.money import fmt, offer_prices
from gpumarket.proto.present import job_dict, short
from gpumarket.proto.errors import (
    BadSignature, FailedPrecondition, GpumarketError, InsufficientFunds,
)
from gpumarket.proto.identity import Identity, home_dir
from gpumarket.proto.jobspec import (
    ACCELERATOR_NAMES, NONCE_BYTES, STATES_BY_NAME, TIER_NAMES,
    kind_name, now_ms, state_name,
)
from gpumarket.proto.v1 import marketplace_pb2 as mp
from gpumarket.proto.v1 import types_pb2 as pb

if TYPE_CHECKING:   # imported where a command talks to a broker: --help needs no grpc
    from gpumarket.link.client import Broker, BrokerClient


def _identity_if_any() -> Identity | None:
    return Identity.load(key_path()) if key_path().exists() else None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--broker", envvar="GPUMARKET_BROKER", default="127.0.0.1:7070",
              show_default=True, help="Broker address HOST:PORT, TLS (or $GPUMARKET_BROKER); "
              "plaintext://HOST:PORT for a plaintext broker on loopback.")
@click.option("--broker-key", envvar="GPUMARKET_BROKER_KEY", default="",
              help="The broker's key id to accept (or $GPUMARKET_BROKER_KEY); without it the "
              "key seen first is trusted and remembered in known_brokers, like SSH.")
@click.pass_context
def cli(ctx: click.Context, broker: str, broker_key: str) -> None:
    """gpumarket client: submit signed jobs to a GPU marketplace, watch them, and download
    their results (the provider's signed receipt and every hash checked).

    Exit codes: 0 ok, 1 error, 2 usage, 3 job failed, 4 job cancelled, 5 job paused (its
    hold is spent: `gpumarket topup`).
    """
    ctx.obj = _BrokerOnUse(broker, broker_key)


class _BrokerOnUse:
    """The commands' Broker, made when one first uses it: click runs the group's callback
    before a command reads its own --help, which then imports no grpc."""

    def __init__(self, address: str, pin: str) -> None:
        self._made: Broker | None = None
        self._args = (address, pin)

    def __getattr__(self, name: str):
        if self._made is None:
            from gpumarket.link.channel import Trust
            from gpumarket.link.client import Broker

            address, pin = self._args
            self._made = Broker(address, Trust(pin=pin, known=home_dir() / "known_brokers"))
        return getattr(self._made, name)


# -- keys ---------------------------------------------------------------------------------

@cli.group()
def keys() -> None:
    """Manage this client's signing key ($GPUMARKET_HOME/client.key)."""


@keys.command("init")
def keys_init() -> None:
    """Create the client's Ed25519 key (mode 0600) if there is none; print its id."""
    path = key_path()
    if path.exists():
        identity = load_identity()
        click.echo(f"key already exists: {path}")
    else:
        identity = Identity.generate()
        identity.save(path)
        click.echo(f"created key {path}")
    click.echo(f"client id: {identity.id}")


@keys.command("show")
def keys_show() -> None:
    """Print this client's id and key file."""
    identity = load_identity()
    click.echo(f"client id: {identity.id}\nkey file:  {key_path()}")


# -- submit -------------------------------------------------------------------------------

async def upload_inputs(broker: BrokerClient, job: jobfile.JobFile) -> list[pb.ArtifactRef]:
    refs = []
    with tempfile.TemporaryDirectory() as tmp:
        for item in job.inputs:
            path = item.path
            if item.data is not None:
                path = Path(tmp) / item.name
                path.write_bytes(item.data)
            elif path.is_dir():
                path = Path(tmp) / item.name
                path.write_bytes(await asyncio.to_thread(jobfile.pack_directory, item.path))
            err.print(f"uploading {'its tasks' if item.data is not None else item.path}"
                      f" as {item.name}")
            refs.append(await broker.upload(path, item.name))
    return refs


async def check_funds(broker: BrokerClient, job: jobfile.JobFile) -> None:
    """Refuse, before anything is uploaded, a job the caller's available balance cannot
    hold: the least the broker would hold for it (jobfile.least_hold) against the balance,
    where the broker enforces funds; the broker checks the exact hold at submit. Raises
    InsufficientFunds."""
    account = await broker.account(limit=1)
    least, basis = jobfile.least_hold(job)
    if account.billing and account.available < least:
        raise InsufficientFunds(
            f"insufficient funds: this job holds at least {fmt(least)} credits ({basis}); your"
            f" available balance is {fmt(account.available)}, {fmt(least - account.available)}"
            " short (ask the broker's operator for credit, or set a smaller budget in the job"
            " file); nothing was uploaded")


def build_spec(job: jobfile.JobFile, refs: list[pb.ArtifactRef], created_ms: int) -> pb.JobSpec:
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


@cli.command()
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--watch", "watch_", is_flag=True, help="Follow the job until it ends.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
@command
async def submit(market: Broker, job_file: Path, watch_: bool, as_json: bool) -> None:
    """Upload JOB_FILE's inputs, sign the job, submit it, and print its id (a job your
    available balance cannot hold is refused before anything is uploaded)."""
    from gpumarket.client.watch import EXIT_BY_STATE, follow

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
            state = await follow(broker, resp.job_id, as_json, out)
            sys.exit(EXIT_BY_STATE.get(state, 1))


# -- read commands ------------------------------------------------------------------------

@cli.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
@command
async def status(market: Broker, job_id: str, as_json: bool) -> None:
    """Show a job's state, progress and attempt history."""
    async with market.client(load_identity()) as broker:
        job_id = await broker.job_id(job_id)
        job = await broker.get_job(job_id)
    if as_json:
        dump(job_dict(job))
        return
    out.print(f"job       {job.job_id}  ({job.name})")
    out.print(f"kind      {kind_name(job.kind)}")
    out.print(f"state     {state_name(job.state)}")
    if job.progress.total:
        metrics = ", ".join(f"{k} {v:.4g}" for k, v in sorted(job.progress.metrics.items()))
        out.print(f"progress  {job.progress.step}/{job.progress.total}  {metrics}")
    if job.array.tasks:
        out.print(f"tasks     {tasks.summary(job.array)}  (gpumarket tasks {job.job_id})")
    if job.checkpoint_step:
        out.print(f"checkpoint step {job.checkpoint_step} (stored, hash checked, resumable)")
    out.print(f"attempt   {job.attempt}")
    if job.provider_id:
        out.print(f"provider  {job.provider_id}")
    if job.error:
        out.print(f"error     {job.error}")
    if job.queue_reason and job.state in (pb.JOB_STATE_QUEUED, pb.JOB_STATE_PAUSED):
        out.print(f"{'queue' if job.state == pb.JOB_STATE_QUEUED else 'paused':9} "
                  f"{job.queue_reason}")
    b = job.billing
    if b.hold:
        out.print(f"billing   held {fmt(b.hold)}, charged {fmt(b.charged)}, left"
                  f" {fmt(b.remaining)} credits" + (f", disputed {fmt(b.disputed)}"
                                                    if b.disputed else ""))
    v = job.verification
    if v.status:
        rate = f"; its provider's work is spot-checked at {v.rate:.0%}" if v.rate else ""
        out.print(f"checks    {v.status}{rate}")
        if v.checks:
            table = Table("check", "of", "work", "checker", "state", "detail")
            for c in v.checks:
                table.add_row(c.check_id.rsplit("~", 1)[-1], short(c.provider_id), c.what,
                              short(c.checker_id) if c.checker_id else "-", c.state, c.detail)
            out.print(table)
    if job.parts:
        table = Table("part", "job", "state", "progress", "attempt", "provider", "error")
        for p in job.parts:
            table.add_row(str(p.part), p.job_id, state_name(p.state),
                          f"{p.progress.step}/{p.progress.total}", str(p.attempt),
                          p.provider_id or "-", p.error)
        out.print(table)
    if job.attempts:
        table = Table("attempt", "epoch", "provider", "started", "ended", "outcome", "reason")
        for a in job.attempts:
            table.add_row(str(a.attempt), str(a.epoch), short(a.provider_id),
                          clock(a.started_at_ms),
                          clock(a.ended_at_ms), a.outcome, a.reason)
        out.print(table)


@cli.command("list")
@click.option("--state", "states", multiple=True,
              type=click.Choice(sorted(STATES_BY_NAME), case_sensitive=False),
              help="Only jobs in this state (repeatable).")
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
@command
async def list_(market: Broker, states: tuple[str, ...], limit: int, as_json: bool) -> None:
    """List your jobs, newest first (a broker shows each client only its own)."""
    identity = load_identity()
    client_id = identity.id
    async with market.client(identity) as broker:
        jobs = await broker.list_jobs(client_id, [STATES_BY_NAME[s.upper()] for s in states],
                                      limit)
    if as_json:
        dump([job_dict(j) for j in jobs])
        return
    table = Table("name", "kind", "state", "progress", "attempt", "provider")
    table.add_column("job", no_wrap=True)
    for j in jobs:
        progress = f"{j.progress.step}/{j.progress.total}" if j.progress.total else "-"
        table.add_row(j.name, kind_name(j.kind), state_name(j.state), progress,
                      str(j.attempt), short(j.provider_id) or "-", short(j.job_id))
    out.print(table)


@cli.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print each event as a JSON line.")
@click.pass_obj
@command
async def watch(market: Broker, job_id: str, as_json: bool) -> None:
    """Follow a job's events with a progress bar until it ends (exit 3 failed, 4 cancelled)."""
    from gpumarket.client.watch import EXIT_BY_STATE, follow

    async with market.client(load_identity()) as broker:
        job_id = await broker.job_id(job_id)
        state = await follow(broker, job_id, as_json, out)
    sys.exit(EXIT_BY_STATE.get(state, 1))


@cli.command()
@click.argument("job_id")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the job ends.")
@click.option("--json", "as_json", is_flag=True, help="Print each line as a JSON object.")
@click.pass_obj
@command
async def logs(market: Broker, job_id: str, follow: bool, as_json: bool) -> None:
    """Print the job's stdout and stderr (from every attempt), as its provider shipped them;
    kept by the broker after the job ends."""
    async with market.client(load_identity()) as broker:
        job_id = await broker.job_id(job_id)
        attempt = 0
        async for line in broker.logs(job_id, follow=follow):
            if as_json:
                print(json.dumps({"seq": line.seq, "at_ms": line.at_ms, "attempt": line.attempt,
                                  "text": line.text}), flush=True)
                continue
            if line.attempt != attempt and attempt:
                click.echo(f"--- attempt {line.attempt} ---")
            attempt = line.attempt
            click.echo(line.text)


@cli.command()
@click.argument("job_id")
@click.pass_obj
@command
async def cancel(market: Broker, job_id: str) -> None:
    """Cancel one of your jobs (a running one is stopped on its provider)."""
    identity = load_identity()
    async with market.client(identity) as broker:
        job_id = await broker.job_id(job_id)
        state = await broker.cancel(seal(identity, mp.CancelOrder(job_id=job_id, at_ms=now_ms())))
    click.echo(f"{job_id} {state_name(state)}")


def verify_receipts(job: pb.Job, client_id: str | None) -> list[pb.Receipt]:
    """Check that the job's receipt (one per part for a split job) is signed by the provider
    that ran it and is for this exact spec; return them."""
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


@cli.command()
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


FIGURE_NAMES = {pb.OFFER_FIGURES_CLAIMED: "claimed", pb.OFFER_FIGURES_MEASURED: "measured",
                pb.OFFER_FIGURES_CONTRADICTED: "contradicted"}


def offer_row(listing: mp.OfferListing, offer: pb.Offer) -> dict:
    """The fields of the query grammar (client/query.py) for one offer whose signature checked."""
    devices = list(offer.devices)
    d = devices[0]
    return {
        "provider": offer.provider_id,
        "gpus": len(devices),
        "free_gpus": listing.free_devices,
        "gpu_ram": round(min(x.memory_bytes for x in devices) / 2**30, 1),
        "gpu_name": d.name,
        "accelerator": ACCELERATOR_NAMES[d.accelerator],
        "compute_cap": float(d.compute_capability or 0),
        "tflops": round(min(x.benchmark.matmul_flops for x in devices) / 1e12, 3),
        "bandwidth": round(min(x.benchmark.memory_bandwidth_bytes_per_s
                               for x in devices) / 1e9, 1),
        "price": offer_prices(offer)[0],
        "interruptible_price": round(offer_prices(offer)[1], 6),
        "reliability": round(listing.reliability, 3),
        "mtbf_h": round(listing.mtbf_s / 3600, 2),
        "uptime": round(listing.uptime_7d, 3),
        "completed": listing.leases_completed,
        "lost": listing.leases_lost,
        "check_rate": round(listing.check_rate, 3),
        "checks_passed": listing.checks_passed,
        "kind": [kind_name(k) for k in offer.kinds],
        "figures": FIGURE_NAMES.get(listing.figures, "unknown"),
        "figures_detail": listing.figures_detail,
        "limits": limits_text(offer),
    }


LIMIT_NAMES = {pb.LIMIT_METHOD_NONE: "none", pb.LIMIT_METHOD_CGROUP_V2: "cgroup-v2",
               pb.LIMIT_METHOD_CGROUP_V1: "cgroup-v1", pb.LIMIT_METHOD_RLIMIT: "rlimit"}


def limits_text(offer: pb.Offer) -> str:
    """How the offer says its jobs' memory, processes and CPU are limited, e.g.
    "memory:cgroup-v2 pids:rlimit cpu:none" ("unknown" from an older provider)."""
    if not offer.HasField("job_limits"):
        return "unknown"
    return " ".join(f"{name}:{LIMIT_NAMES.get(getattr(offer.job_limits, name), 'unknown')}"
                    for name in ("memory", "pids", "cpu"))


@cli.command()
@click.argument("query_text", metavar="[QUERY]", required=False, default="")
@click.option("--sort", "sort_by", default="price", show_default=True,
              help="Field to sort by; prefix with - for descending (e.g. -reliability).")
@click.option("--fields", "list_fields", is_flag=True, help="List the fields a query can use.")
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
@command
async def offers(market: Broker, query_text: str, sort_by: str, list_fields: bool,
                 limit: int, as_json: bool) -> None:
    """Search the live offers (signatures checked), e.g.

        gpumarket offers 'gpu_ram>=24 reliability>0.95 price<=1.5 kind=training' --sort price

    Operators: = != < <= > >= and `in [a,b]`; on text fields = means contains.
    """
    from gpumarket.client import query

    if list_fields:
        for name, (kind, text) in query.FIELDS.items():
            click.echo(f"{name:12} {kind:7} {text}")
        return
    clauses = query.parse(query_text)
    sort_field, descending = query.sort_key(sort_by)
    async with market.client(_identity_if_any()) as broker:
        listings = await broker.search_offers(mp.SearchOffersRequest(limit=1000))
    rows = []
    for listing in listings:
        offer, signer = open_envelope(listing.offer, pb.Offer)
        if signer != offer.provider_id:
            continue  # not signed by the provider it names
        row = offer_row(listing, offer)
        if all(c.matches(row) for c in clauses):
            rows.append((row, offer))
    rows.sort(key=lambda r: (r[0][sort_field] if not isinstance(r[0][sort_field], list)
                             else ",".join(r[0][sort_field])), reverse=descending)
    rows = rows[:limit]
    if as_json:
        dump([{**row, "offer": MessageToDict(o, preserving_proto_field_name=True)}
               for row, o in rows])
        return
    table = Table("devices", "accel", "GiB/dev", "TFLOP/s", "figures", "price/h",
                  "interruptible/h", "free",
                  "reliability", "MTBF h", "checked", "kinds", "limits")
    table.add_column("provider", no_wrap=True)
    for row, _ in rows:
        table.add_row(f"{row['gpus']}× {row['gpu_name']}", row["accelerator"],
                      f"{row['gpu_ram']:g}", f"{row['tflops']:.3g}", row["figures"],
                      f"{row['price']:g}", f"{row['interruptible_price']:g}",
                      str(row["free_gpus"]), f"{row['reliability']:.2f}",
                      f"{row['mtbf_h']:.1f}", f"{row['check_rate']:.0%}", ",".join(row["kind"]),
                      row["limits"], short(row["provider"]))
    out.print(table)
    for row, _ in rows:
        if row["figures"] == "contradicted":
            err.print(f"provider {short(row['provider'])}: figures contradicted:"
                      f" {row['figures_detail']}")
    if not rows:
        err.print("no offers match")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


@cli.command()
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-n", "limit", type=click.IntRange(1, 50), default=5, show_default=True,
              help="How many candidates to show.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
@command
async def quote(market: Broker, job_file: Path, limit: int, as_json: bool) -> None:
    """Show where JOB_FILE would run: the best candidates with expected runtime, cost and the
    chance of finishing without an interruption, and what excluded the other offers."""
    job = jobfile.load(job_file)
    identity = load_identity()
    client_id = identity.id
    async with market.client(identity) as broker:
        refs = await upload_inputs(broker, job)  # the broker sizes the job from its model config
        spec = build_spec(job, refs, now_ms())
        resp = await broker.quote(spec, limit, client_id)
    if as_json:
        dump(MessageToDict(resp, preserving_proto_field_name=True))
        return
    if resp.estimated_memory_bytes or resp.work_flops:
        out.print(f"job needs about {resp.estimated_memory_bytes / 2**30:.2f} GiB per device and"
                  f" {resp.work_flops:.3g} FLOPs of work")
    tier = TIER_NAMES.get(spec.tier, "standard")
    table = Table("gpu", f"price/h ({tier})", "standard/h", "interruptible/h", "runtime",
                  "expected", "wall time", "cost", "P(no interruption)", "reliability", "free")
    table.add_column("provider", no_wrap=True)
    for c in resp.candidates:
        table.add_row(c.gpu_name, f"{c.price_per_gpu_hour:g}",
                      f"{c.standard_price_per_gpu_hour:g}",
                      f"{c.interruptible_price_per_gpu_hour:g}", _duration(c.runtime_s),
                      _duration(c.expected_s), _duration(c.estimated_s),
                      f"{c.expected_cost:.4g}", f"{c.p_uninterrupted:.1%}",
                      f"{c.reliability:.2f}", str(c.free_devices), short(c.provider_id))
    if resp.candidates:
        out.print(table)
        out.print(f"wall time (start to receipt) of the best: {resp.candidates[0].estimate_basis}")
    out.print(f"submitting it holds {fmt(resp.hold)} credits: {resp.hold_basis}")
    excluded = ", ".join(f"{n} by {k}" for k, n in sorted(resp.excluded.items(),
                                                          key=lambda kv: (-kv[1], kv[0])))
    out.print(f"{len(resp.candidates)} of {resp.offers} offers shown"
              + (f"; excluded: {excluded}" if excluded else ""))
    if resp.explanation:
        out.print(resp.explanation)


for _command in money.COMMANDS:
    cli.add_command(_command)
cli.add_command(endpoints.endpoint)
cli.add_command(tasks.tasks_command)
cli.add_command(tasks.resubmit_command)


def main() -> None:
    try:
        kinds.load_plugins(os.environ.get("GPUMARKET_KINDS", ""))
    except GpumarketError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    cli(prog_name="gpumarket")
