"""A provider's standing as the broker sees it: offer, reliability, leases, earnings (from the
ledger)."""

from __future__ import annotations

from sqlite_utils import Database

from gpumarket.broker.checks import verification
from gpumarket.broker.jobs import views
from gpumarket.broker.market import offers as offer_terms
from gpumarket.broker.market import reliability
from gpumarket.broker.money import ledger
from gpumarket.proto.v1 import types_pb2 as pb

def _device_line(d: pb.Device) -> str:
    return f"{d.name} ({d.memory_bytes / 2**30:.1f} GiB)"


def standings(db: Database, provider_ids: list[str] | None, now: int) -> list[pb.ProviderStanding]:
    """Standing of the given providers (None: every provider the broker has seen)."""
    if provider_ids is None:
        rows = list(db.query("SELECT * FROM providers ORDER BY last_seen_ms DESC"))
    else:
        marks = ",".join("?" * len(provider_ids))
        rows = list(db.query(f"SELECT * FROM providers WHERE id IN ({marks})", provider_ids))
    ids = [r["id"] for r in rows]
    offers = {r["provider_id"]: r for r in views.offers(db)}
    running = views.active_lease_counts(db)
    balances = {a: ledger.balance(db, a) for i in ids
                for a in (ledger.provider(i), ledger.stake(i))}
    checked = verification.standings(db)
    out = []
    for row in rows:
        h = views.provider_history(db, row["id"], now)
        standing = pb.ProviderStanding(
            provider_id=row["id"], online=bool(row["online"]), banned=bool(row["banned"]),
            reliability=reliability.score(h), leases_completed=h.leases_completed,
            leases_lost=reliability.failures(h), running=running.get(row["id"], 0),
            earned=balances.get(ledger.provider(row["id"]), 0) / ledger.UNIT,
            stake=balances.get(ledger.stake(row["id"]), 0), last_seen_ms=row["last_seen_ms"],
            first_seen_ms=row["first_seen_ms"])
        rate, passed, failed = checked.get(row["id"], (verification.rate(0), 0, 0))
        standing.check_rate, standing.checks_passed, standing.checks_failed = rate, passed, failed
        offer_row = offers.get(row["id"])
        if offer_row is not None:
            envelope = pb.Envelope.FromString(offer_row["envelope"])
            offer = pb.Offer.FromString(envelope.payload)
            standing.price_per_gpu_hour = offer.price_per_gpu_hour
            standing.interruptible_price_per_gpu_hour = offer_terms.interruptible_price(offer)
            standing.devices.extend(_device_line(d) for d in offer.devices)
        out.append(standing)
    return out


def job_costs(db: Database, job_ids: list[str], now: int) -> dict[str, float]:
    """Credits each job has been charged so far: its settled progress (the ledger)."""
    return {j: ledger.job_money(db, j)["charged"] / ledger.UNIT for j in job_ids}
