"""The market's offers as a client sees them: `offers` searches the live offers (each
signature checked) with the query grammar (client/query.py); `quote` shows where a job file
would run, at what price and risk."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from gpumarket.client.console import command, dump, err, key_path, load_identity, out
from gpumarket.client.submit import build_spec, upload_inputs
from gpumarket.proto.jobspec import ACCELERATOR_NAMES, TIER_NAMES, kind_name, now_ms
from gpumarket.proto.money import fmt, offer_prices
from gpumarket.proto.v1 import types_pb2 as pb

if TYPE_CHECKING:   # annotations only: commands get it from the cli group
    from gpumarket.link.client import Broker
    from gpumarket.proto.identity import Identity
    from gpumarket.proto.v1 import marketplace_pb2 as mp


def _identity_if_any() -> Identity | None:
    from gpumarket.proto.identity import Identity

    return Identity.load(key_path()) if key_path().exists() else None


FIGURE_NAMES = {pb.OFFER_FIGURES_CLAIMED: "claimed", pb.OFFER_FIGURES_MEASURED: "measured",
                pb.OFFER_FIGURES_CONTRADICTED: "contradicted"}


def offer_row(listing: mp.OfferListing, offer: pb.Offer) -> dict:
    """The fields of the query grammar (client/query.py) for one offer whose signature checked."""
    devices = [x for x in offer.devices if not x.HasField("slice_of")] or list(offer.devices)
    parts = [x for x in offer.devices if x.HasField("slice_of")]
    d = devices[0]
    return {
        "provider": offer.provider_id,
        "gpus": len(devices),
        "free_gpus": listing.free_devices,
        "gpu_ram": round(min(x.memory_bytes for x in devices) / 2**30, 1),
        "slices": len(parts),
        "slice_ram": round(min((x.memory_bytes for x in parts), default=0) / 2**30, 1),
        "slice_shares": sorted((round(x.memory_share, 3) for x in parts), reverse=True),
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


@click.command()
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
    from google.protobuf.json_format import MessageToDict
    from rich.table import Table

    from gpumarket.client import query
    from gpumarket.proto.envelope import open_envelope
    from gpumarket.proto.present import short
    from gpumarket.proto.v1 import marketplace_pb2 as mp

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
        shares = "/".join(f"{x:g}" for x in row["slice_shares"])
        sliced = f" + {row['slices']} slices ({shares})" if row["slices"] else ""
        table.add_row(f"{row['gpus']}× {row['gpu_name']}{sliced}", row["accelerator"],
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


@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-n", "limit", type=click.IntRange(1, 50), default=5, show_default=True,
              help="How many candidates to show.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
@command
async def quote(market: Broker, job_file: Path, limit: int, as_json: bool) -> None:
    """Show where JOB_FILE would run: the best candidates with expected runtime, cost and the
    chance of finishing without an interruption, and what excluded the other offers."""
    from google.protobuf.json_format import MessageToDict
    from rich.table import Table

    from gpumarket.client import jobfile
    from gpumarket.proto.present import short

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


COMMANDS = (offers, quote)
