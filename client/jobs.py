"""Your jobs on the broker: status, list, watch, logs, cancel."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import click

from gpumarket.client import tasks
from gpumarket.client.console import clock, command, dump, load_identity, out
from gpumarket.proto.jobspec import STATES_BY_NAME, kind_name, now_ms, state_name
from gpumarket.proto.money import fmt
from gpumarket.proto.v1 import types_pb2 as pb

if TYPE_CHECKING:   # annotations only: commands get it from the cli group
    from gpumarket.link.client import Broker


@click.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
@command
async def status(market: Broker, job_id: str, as_json: bool) -> None:
    """Show a job's state, progress and attempt history."""
    from rich.table import Table

    from gpumarket.proto.present import job_dict, short

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


@click.command("list")
@click.option("--state", "states", multiple=True,
              type=click.Choice(sorted(STATES_BY_NAME), case_sensitive=False),
              help="Only jobs in this state (repeatable).")
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
@command
async def list_(market: Broker, states: tuple[str, ...], limit: int, as_json: bool) -> None:
    """List your jobs, newest first (a broker shows each client only its own)."""
    from rich.table import Table

    from gpumarket.proto.present import job_dict, short

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


@click.command()
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


@click.command()
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


@click.command()
@click.argument("job_id")
@click.pass_obj
@command
async def cancel(market: Broker, job_id: str) -> None:
    """Cancel one of your jobs (a running one is stopped on its provider)."""
    from gpumarket.proto.envelope import seal
    from gpumarket.proto.v1 import marketplace_pb2 as mp

    identity = load_identity()
    async with market.client(identity) as broker:
        job_id = await broker.job_id(job_id)
        state = await broker.cancel(seal(identity, mp.CancelOrder(job_id=job_id, at_ms=now_ms())))
    click.echo(f"{job_id} {state_name(state)}")


COMMANDS = (status, list_, watch, logs, cancel)
