"""gpumarket endpoint ...: put a model behind an OpenAI-compatible API (docs/serving.md).
An endpoint is a signed job of kind endpoint; its replicas are leases on providers, scaled by
the broker between the job file's min_replicas and max_replicas."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from gpumarket.client.console import clock, command, dump, load_identity, out
from gpumarket.proto.errors import InvalidArgument
from gpumarket.proto.jobspec import KINDS_BY_NAME, now_ms, state_name
from gpumarket.proto.v1 import types_pb2 as pb

if TYPE_CHECKING:   # annotations only: commands get it from the cli group
    from gpumarket.link.client import Broker

STATE_WORDS = {pb.JOB_STATE_RUNNING: "serving"}


def _state(state: int) -> str:
    return STATE_WORDS.get(state, state_name(state).lower())


def as_dict(message) -> dict:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(message, preserving_proto_field_name=True)


@click.group("endpoint")
def endpoint() -> None:
    """Serve a model behind an OpenAI-compatible API, on replicas leased from providers."""


@endpoint.command("create")
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
@command
async def create(market: Broker, job_file: Path, as_json: bool) -> None:
    """Create the endpoint JOB_FILE describes (kind = "endpoint"); print its name and API."""
    from gpumarket.client import jobfile
    from gpumarket.client.submit import build_spec, check_funds, upload_inputs
    from gpumarket.proto.envelope import seal

    job = jobfile.load(job_file)
    if job.kind != KINDS_BY_NAME["endpoint"]:
        raise InvalidArgument(f"{job_file}: kind must be \"endpoint\" (use gpumarket submit for"
                              " other jobs)")
    identity = load_identity()
    async with market.client(identity) as broker:
        await check_funds(broker, job)
        refs = await upload_inputs(broker, job)
        resp = await broker.submit(seal(identity, build_spec(job, refs, now_ms())))
        ep = await broker.endpoint(resp.job_id, events=0)
    if as_json:
        dump(as_dict(ep))
        return
    click.echo(f"endpoint {ep.name} ({ep.job_id}) created: {ep.min_replicas} to"
               f" {ep.max_replicas} replicas")
    click.echo(f"API: {ep.api_base or '(the broker serves no HTTP side)'}  model: {ep.name}")
    click.echo(f"next: gpumarket endpoint key {ep.name}   (a bearer key for its API)")


@endpoint.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
@command
async def list_(market: Broker, as_json: bool) -> None:
    """Your endpoints: state, replicas ready of live, load and latency."""
    from rich.table import Table

    async with market.client(load_identity()) as broker:
        found = await broker.endpoints()
    if as_json:
        dump([as_dict(e) for e in found])
        return
    table = Table(box=None)
    for col in ("name", "id", "state", "replicas", "in flight", "requests", "TTFT p50",
                "TPOT p50"):
        table.add_column(col)
    for e in found:
        ready = sum(r.ready for r in e.replicas)
        table.add_row(e.name, e.job_id, _state(e.state),
                      f"{ready}/{len(e.replicas)} ({e.min_replicas}-{e.max_replicas})",
                      str(e.load.in_flight), str(e.load.requests),
                      f"{e.load.ttft_p50_ms:.0f} ms", f"{e.load.tpot_p50_ms:.1f} ms")
    out.print(table if found else "no endpoints (gpumarket endpoint create FILE)")


@endpoint.command("show")
@click.argument("name")
@click.option("--events", type=click.IntRange(1, 1000), default=20, show_default=True,
              help="How many of its latest events to show.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
@command
async def show(market: Broker, name: str, events: int, as_json: bool) -> None:
    """An endpoint: its replicas (where they run, load, TPOT), latency percentiles, tokens
    served, keys, and its latest scaling decisions and replica moves."""
    from rich.table import Table

    from gpumarket.proto.present import short

    async with market.client(load_identity()) as broker:
        e = await broker.endpoint(name, events)
    if as_json:
        dump(as_dict(e))
        return
    load = e.load
    out.print(f"[bold]{e.name}[/bold] ({e.job_id})  {_state(e.state)}  task {e.task}"
              f"  replicas {e.min_replicas}-{e.max_replicas}, target {e.target} in flight each")
    if e.error:
        out.print(f"error: {e.error}")
    out.print(f"API: {e.api_base or '-'}  model: {e.name}")
    out.print(f"load: {load.in_flight} in flight, {load.queued} waiting;"
              f" {load.requests} requests ({load.errors} errors),"
              f" {load.prompt_tokens} prompt + {load.output_tokens} output tokens")
    out.print(f"TTFT p50 {load.ttft_p50_ms:.0f} ms, p99 {load.ttft_p99_ms:.0f} ms;"
              f"  TPOT p50 {load.tpot_p50_ms:.1f} ms, p99 {load.tpot_p99_ms:.1f} ms")
    table = Table(box=None, title="replicas", title_justify="left")
    for col in ("replica", "state", "provider", "ready", "in flight", "TPOT", "requests",
                "engine"):
        table.add_column(col)
    for r in e.replicas:
        table.add_row(r.job_id, _state(r.state), short(r.provider_id) if r.provider_id else "-",
                      ("draining" if r.draining else "yes") if r.ready else "no",
                      f"{r.in_flight}/{r.max_concurrency}" if r.ready else "-",
                      f"{r.tpot_ms:.1f} ms" if r.tpot_ms else "-", str(r.requests),
                      r.engine or "-")
    out.print(table)
    if e.keys:
        out.print("keys: " + ", ".join(
            k.key_id + (" (revoked)" if k.revoked_at_ms else "") for k in e.keys))
    events_table = Table(box=None, title="events", title_justify="left")
    for col in ("time", "event", "what"):
        events_table.add_column(col)
    for ev in e.events:
        events_table.add_row(clock(ev.at_ms), ev.type, ev.message)
    out.print(events_table)


@endpoint.command("key")
@click.argument("name")
@click.option("--revoke", "key_id", metavar="KEY_ID",
              help="Revoke this key (its id from `endpoint show`) instead of making one.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
@command
async def key(market: Broker, name: str, key_id: str | None, as_json: bool) -> None:
    """Make a bearer key for the endpoint's API (printed once; keep it), or revoke one."""
    async with market.client(load_identity()) as broker:
        if key_id:
            revoked = await broker.revoke_endpoint_key(name, key_id)
            if as_json:
                dump(as_dict(revoked))
            else:
                click.echo(f"key {revoked.key_id} revoked")
            return
        made = await broker.endpoint_key(name)
    if as_json:
        dump({"key_id": made.key.key_id, "key": made.secret})
        return
    click.echo(made.secret)
    click.echo(f"(key {made.key.key_id}; shown once. Revoke: gpumarket endpoint key {name}"
               f" --revoke {made.key.key_id})", err=True)


@endpoint.command("delete")
@click.argument("name")
@click.pass_obj
@command
async def delete(market: Broker, name: str) -> None:
    """Stop serving: every replica stops, the unspent hold goes back, its keys stop working."""
    from gpumarket.proto.envelope import seal
    from gpumarket.proto.v1 import marketplace_pb2 as mp

    identity = load_identity()
    async with market.client(identity) as broker:
        e = await broker.endpoint(name, events=1)
        state = await broker.cancel(seal(identity, mp.CancelOrder(job_id=e.job_id,
                                                                  at_ms=now_ms())))
    click.echo(f"endpoint {e.name} ({e.job_id}) {_state(state)}")


@endpoint.command("logs")
@click.argument("name")
@click.option("-n", "lines", type=click.IntRange(1, 100_000), default=200, show_default=True,
              help="At most this many of the latest lines per replica.")
@click.pass_obj
@command
async def logs(market: Broker, name: str, lines: int) -> None:
    """Its scaling decisions, then each live replica's log (its engine's stdout/stderr)."""
    async with market.client(load_identity()) as broker:
        e = await broker.endpoint(name, events=1000)
        for ev in e.events:
            click.echo(f"{clock(ev.at_ms)} {ev.type}: {ev.message}")
        for r in e.replicas:
            click.echo(f"--- replica {r.job_id} ({_state(r.state)}) ---")
            got = [line.text async for line in broker.logs(r.job_id)]
            for text in got[-lines:]:
                click.echo(text)
    sys.stdout.flush()
