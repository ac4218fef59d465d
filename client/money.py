"""The client's money commands: balance, statement, topup (docs/ledger.md)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

from gpumarket.client.console import clock, command, dump, load_identity, out
from gpumarket.proto.jobspec import state_name
from gpumarket.proto.money import fmt, parse_credits

if TYPE_CHECKING:   # annotations only: commands get it from the cli group
    from gpumarket.link.client import Broker


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON (amounts in units).")
@click.pass_obj
@command
async def balance(market: Broker, as_json: bool) -> None:
    """Your credits on this broker: available for new jobs, held for unfinished ones, and
    what your jobs have been charged (1 credit = 1,000,000 units)."""
    async with market.client(load_identity()) as broker:
        acct = await broker.account(limit=1)
    if as_json:
        dump({k: getattr(acct, k) for k in ("key_id", "available", "held", "credited",
                                                "spent", "billing")})
        return
    out.print(f"available  {fmt(acct.available)} credits")
    out.print(f"held       {fmt(acct.held)} (for your unfinished jobs)")
    out.print(f"spent      {fmt(acct.spent)} (settled progress of your jobs)")
    out.print(f"credited   {fmt(acct.credited)} (by the broker's operator)")
    if not acct.billing:
        out.print("this broker does not enforce funds: it records usage only")


def print_lines(lines, as_json: bool) -> None:
    """Ledger lines, newest first: JSON lines, or a table with one row per posting and a
    column per account it moved (available, held, ...)."""
    if as_json:
        from google.protobuf.json_format import MessageToDict

        for line in lines:
            click.echo(json.dumps(MessageToDict(line, preserving_proto_field_name=True)))
        return
    from rich.table import Table

    postings: dict[int, list] = {}
    for line in lines:
        postings.setdefault(line.seq, []).append(line)
    accounts = [a for a in ("available", "held", "earned", "stake", "disputed")
                if any(x.account == a for x in lines)]
    rows = []
    for seq, group in postings.items():
        first = group[0]
        moved = {x.account: x.amount for x in group}
        steps = f"{first.step_from}→{first.step_to}" if first.type == "settle" else ""
        rows.append((clock(first.at_ms), first.type, first.job_id[:8], steps,
                     first.provider_id[:8],
                     *(("+" if moved[a] > 0 else "-") + fmt(abs(moved[a])) if a in moved else ""
                       for a in accounts), first.memo))
    names = ("time", "type", "job", "steps", "provider", *accounts, "memo")
    table = Table(box=None, header_style="bold", pad_edge=False)
    for i, name in enumerate(names):
        if name == "memo":      # the one column that gives way when the line is short
            table.add_column(name, no_wrap=True, overflow="ellipsis")
            continue
        width = max([len(name), *(len(r[i]) for r in rows)])
        table.add_column(name, no_wrap=True, min_width=width,
                         justify="right" if name in accounts else "left")
    for row in rows:
        table.add_row(*row)
    out.print(table)


@click.command()
@click.option("--job", "job_id", default="", help="Only this job's lines (an id or prefix).")
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print each line as a JSON object.")
@click.pass_obj
@command
async def statement(market: Broker, job_id: str, limit: int, as_json: bool) -> None:
    """Your ledger lines, newest first: credits, holds, each settled segment of progress
    (steps, provider, device-seconds), releases."""
    async with market.client(load_identity()) as broker:
        if job_id:
            job_id = await broker.job_id(job_id)
        acct = await broker.account(job_id=job_id, limit=limit)
    print_lines(acct.lines, as_json)


@click.command()
@click.argument("job_id")
@click.argument("amount")
@click.pass_obj
@command
async def topup(market: Broker, job_id: str, amount: str) -> None:
    """Add AMOUNT credits from your available balance to a job's hold; a job PAUSED because
    its hold ran out is queued again and resumes from its last checkpoint."""
    try:
        units = parse_credits(amount)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="AMOUNT") from None
    async with market.client(load_identity()) as broker:
        job_id = await broker.job_id(job_id)
        resp = await broker.top_up(job_id, units)
    click.echo(f"{job_id} {state_name(resp.state)}; hold {fmt(resp.billing.hold)},"
               f" charged {fmt(resp.billing.charged)}, left {fmt(resp.billing.remaining)}")


COMMANDS = (balance, statement, topup)
