"""gpumarket-broker's operator commands: providers, jobs, ban, unban, backup, vacuum (and
copy-store, which works on the files of a stopped broker).

Each signs an AdminOrder with the operator's key (``--key``; the broker's own
data_dir/broker.key works on the broker's host) and calls the broker's Admin service.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import sys
from pathlib import Path

import click
from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.table import Table

from gpumarket.link.client import Broker
from gpumarket.link.channel import Trust
from gpumarket.proto.envelope import seal
from gpumarket.proto.present import job_dict, short, unique_prefix
from gpumarket.proto.errors import GpumarketError
from gpumarket.proto.identity import Identity, home_dir
from gpumarket.proto.money import fmt, parse_credits
from gpumarket.proto.jobspec import STATES_BY_NAME, kind_name, now_ms, state_name
from gpumarket.proto.v1 import admin_pb2 as ad
from gpumarket.proto.v1 import types_pb2 as pb

out = Console(highlight=False, soft_wrap=True)
KEY_ID_CHARS = 26      # a key's id: 26 base32 characters of its sha256


def _default_key() -> str:
    return os.environ.get("GPUMARKET_OPERATOR_KEY") or str(home_dir() / "client.key")


def admin_options(fn):
    """--broker and --key, and one line on stderr (exit 1) for a GpumarketError."""

    @click.option("--broker", envvar="GPUMARKET_BROKER", default="127.0.0.1:7070",
                  show_default=True,
                  help="Broker gRPC address (env GPUMARKET_BROKER); TLS to the broker's key.")
    @click.option("--broker-key", envvar="GPUMARKET_BROKER_KEY", default="",
                  help="The broker's key id to accept (or $GPUMARKET_BROKER_KEY); without it "
                  "the key seen first is trusted and remembered in known_brokers.")
    @click.option("--key", "key_file", type=click.Path(dir_okay=False, path_type=Path),
                  default=_default_key, show_default="$GPUMARKET_OPERATOR_KEY or "
                  "$GPUMARKET_HOME/client.key",
                  help="Operator key: the broker's data_dir/broker.key, or a key listed in "
                  "its config's `operators`.")
    @functools.wraps(fn)
    def wrapper(broker: str, broker_key: str, key_file: Path, **kwargs):
        try:
            if not key_file.exists():
                raise click.ClickException(f"no operator key at {key_file}")
            identity = Identity.load(key_file)
            target = Broker(broker, Trust(pin=broker_key, known=home_dir() / "known_brokers"))
            return asyncio.run(fn(target, identity, **kwargs))
        except GpumarketError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)

    return wrapper


def _order(identity: Identity, method: str, **fields) -> pb.Envelope:
    """An AdminOrder for ``method``, dated now and signed by the operator's key."""
    return seal(identity, ad.AdminOrder(method=method, at_ms=now_ms(), **fields))


async def _call(broker: Broker, identity: Identity, method: str, **fields) -> object:
    async with broker.client(identity) as client:
        if "target" in fields and len(fields["target"]) < KEY_ID_CHARS:
            # a provider's id may be given by any unique prefix, as tables show it
            listed = (await client.admin_call("ListProviders",
                                              _order(identity, "ListProviders"))).providers
            fields["target"] = unique_prefix(fields["target"],
                                             [p.provider_id for p in listed], "provider id")
        return await client.admin_call(method, _order(identity, method, **fields))


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@admin_options
async def providers(broker: Broker, identity: Identity, as_json: bool) -> None:
    """Every provider the broker has seen: online, banned, devices, price, reliability,
    leases, earnings, and its spot-check record (docs/verification.md)."""
    found = (await _call(broker, identity, "ListProviders")).providers
    if as_json:
        click.echo(json.dumps([MessageToDict(p, preserving_proto_field_name=True)
                               for p in found], indent=2))
        return
    table = Table("provider", "status", "devices", "price/GPU·h", "interruptible", "reliability", "done",
                  "lost", "running", "earned", "checked", "checks ok/failed")
    for p in found:
        status = "banned" if p.banned else ("online" if p.online else "offline")
        table.add_row(short(p.provider_id), status, "\n".join(p.devices) or "-",
                      f"{p.price_per_gpu_hour:.3f}" if p.devices else "-",
                      f"{p.interruptible_price_per_gpu_hour:.3f}" if p.devices else "-",
                      f"{p.reliability:.2f}", str(p.leases_completed), str(p.leases_lost),
                      str(p.running), f"{p.earned:.4f}", f"{p.check_rate:.0%}",
                      f"{p.checks_passed}/{p.checks_failed}")
    out.print(table)


@click.command()
@click.option("--state", "states", multiple=True,
              type=click.Choice(sorted(STATES_BY_NAME), case_sensitive=False),
              help="Only jobs in this state (repeatable).")
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@admin_options
async def jobs(broker: Broker, identity: Identity, states: tuple[str, ...], limit: int,
               as_json: bool) -> None:
    """Every client's jobs, newest first."""
    codes = [STATES_BY_NAME[s.upper()] for s in states]
    found = (await _call(broker, identity, "ListAllJobs", states=codes, limit=limit)).jobs
    if as_json:
        click.echo(json.dumps([job_dict(j) for j in found], indent=2))
        return
    table = Table("job", "client", "kind", "state", "progress", "attempt", "provider")
    for j in found:
        table.add_row(short(j.job_id), short(j.client_id), kind_name(j.kind),
                      state_name(j.state), f"{j.progress.step}/{j.progress.total}",
                      str(j.attempt), short(j.provider_id) or "-")
    out.print(table)


@click.command()
@click.argument("provider_id")
@click.option("--reason", default="", help="Why (kept in the broker's log).")
@admin_options
async def ban(broker: Broker, identity: Identity, provider_id: str, reason: str) -> None:
    """Ban a provider: its session ends, its offer goes, its running jobs are queued again
    for other providers, and it cannot connect until unbanned."""
    resp = await _call(broker, identity, "Ban", target=provider_id, reason=reason)
    out.print(f"banned {resp.provider_id}; {resp.leases_lost} running job(s) queued again")


@click.command()
@click.argument("provider_id")
@admin_options
async def unban(broker: Broker, identity: Identity, provider_id: str) -> None:
    """Let a banned provider connect again."""
    resp = await _call(broker, identity, "Unban", target=provider_id)
    out.print(f"unbanned {resp.provider_id}")


@click.command()
@click.argument("key_id")
@click.option("--reason", default="", help="Why (kept in the broker's database and log).")
@admin_options
async def revoke(broker: Broker, identity: Identity, key_id: str, reason: str) -> None:
    """Revoke a key (a client's or a provider's): every call signed by it is refused from
    now on; a provider's session ends and its running jobs are queued again."""
    resp = await _call(broker, identity, "Revoke", target=key_id, reason=reason)
    out.print(f"revoked {resp.key_id}; {resp.leases_lost} running job(s) queued again")


@click.command()
@click.argument("key_id")
@admin_options
async def unrevoke(broker: Broker, identity: Identity, key_id: str) -> None:
    """Accept a revoked key again."""
    resp = await _call(broker, identity, "Unrevoke", target=key_id)
    out.print(f"{resp.key_id} is accepted again")


@click.command()
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@admin_options
async def backup(broker: Broker, identity: Identity, path: Path) -> None:
    """Copy the broker's database to PATH (here) while it serves: SQLite's online backup,
    a consistent snapshot, checked by sha256 on arrival."""
    if path.exists():
        raise click.ClickException(f"{path} exists; give a new file name")
    if not path.parent.is_dir():
        raise click.ClickException(f"{path.parent} is not a directory")
    async with broker.client(identity) as client:
        size = await client.backup(_order(identity, "Backup"), path)
    out.print(f"backup written to {path} ({size:,} bytes)")


@click.command()
@admin_options
async def vacuum(broker: Broker, identity: Identity) -> None:
    """Rebuild the broker's database file to give free pages back to the disk."""
    resp = await _call(broker, identity, "Vacuum")
    out.print(f"vacuumed: {resp.bytes_before:,} → {resp.bytes_after:,} bytes")


@click.command("copy-store")
@click.argument("source", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("target")
def copy_store(source: Path, target: str) -> None:
    """Copy a stopped broker's SQLite database SOURCE (its data_dir/broker.db) into a new
    PostgreSQL store TARGET (postgresql://…), whole or not at all, then audit the ledger
    there: how a market that began on one broker moves to several (docs/deploy.md). Stop
    the broker first; start it again with --store TARGET. Blobs stay in data_dir/artifacts."""
    from gpumarket.broker.store.copy import copy_to_postgres
    from gpumarket.broker.store.store import is_postgres

    if not is_postgres(target):
        raise click.BadParameter(f"{target!r}: give a postgresql://… URL", param_hint="TARGET")
    try:
        copied = copy_to_postgres(source, target, said=out.print)
    except GpumarketError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    out.print(f"copied {sum(copied.values()):,} rows of {len(copied)} tables; ledger ok")


def _credits(text: str) -> int:
    try:
        return parse_credits(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="AMOUNT") from None


@click.group()
def admin() -> None:
    """The operator's money commands: credit accounts, audit the ledger."""


@admin.command()
@click.argument("key_id")
@click.argument("amount")
@click.option("--memo", required=True, help="Why (kept with the posting: the audit trail).")
@click.option("--stake", is_flag=True,
              help="Credit a provider's stake instead of a client's available balance.")
@admin_options
async def credit(broker: Broker, identity: Identity, key_id: str, amount: str, memo: str,
                 stake: bool) -> None:
    """Credit AMOUNT credits to client KEY_ID (its `gpumarket keys show` id), recorded in the
    ledger with your operator key and the memo: the one door money comes in by."""
    units = _credits(amount)
    if not stake and len(key_id) != KEY_ID_CHARS:
        raise click.BadParameter(f"{key_id!r}: give the client's whole key id"
                                 f" ({KEY_ID_CHARS} characters)", param_hint="KEY_ID")
    resp = await _call(broker, identity, "Credit", target=key_id, amount=units, reason=memo,
                       nonce=os.urandom(16), account="stake" if stake else "client")
    out.print(f"credited {fmt(units)} credits to {resp.account}; balance {fmt(resp.balance)}"
              f" (posting {resp.seq})")


@admin.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@admin_options
async def audit(broker: Broker, identity: Identity, as_json: bool) -> None:
    """Check the whole ledger: every posting sums to zero, every cached balance equals its
    entries, no account is below zero that may not be. Exit 1 if anything is wrong."""
    resp = await _call(broker, identity, "Audit")
    if as_json:
        click.echo(json.dumps(MessageToDict(resp, preserving_proto_field_name=True,
                                            always_print_fields_with_no_presence=True),
                              indent=2))
    else:
        out.print(f"{resp.postings:,} postings; " + ", ".join(
            f"{k} {fmt(v)}" for k, v in sorted(resp.totals.items())))
        for problem in resp.problems:
            out.print(f"problem: {problem}")
        out.print("ledger ok" if resp.ok else "LEDGER HAS PROBLEMS")
    if not resp.ok:
        sys.exit(1)


COMMANDS = (providers, jobs, ban, unban, revoke, unrevoke, backup, vacuum, admin, copy_store)
