"""A provider's standing as the broker sees it: offer, reliability, leases, earnings (from the
ledger). A row of ``providers`` is read once, into a ``Provider``, and by attribute after."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from sqlite_utils import Database

from gpumarket.broker.checks import verification
from gpumarket.broker.jobs import views
from gpumarket.broker.market import offers as offer_terms
from gpumarket.broker.market import reliability
from gpumarket.broker.money import ledger
from gpumarket.proto.v1 import types_pb2 as pb


@dataclass(frozen=True)
class Provider:
    """A row of ``providers`` as standing reads it (its public key aside)."""

    id: str
    first_seen_ms: int
    last_seen_ms: int
    online: bool
    banned: bool
    reconnect_within_ms: int = 0    # how long it said it takes to come back (0: not said)

    COLUMNS = "id, first_seen_ms, last_seen_ms, online, banned, reconnect_within_ms"

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Provider:
        """The provider of a row selected with ``COLUMNS``; raises KeyError if a column is
        missing."""
        made = {f.name: row[f.name] for f in fields(cls)}
        return cls(**{**made, "online": bool(made["online"]), "banned": bool(made["banned"])})


def providers(db: Database, provider_ids: list[str] | None) -> list[Provider]:
    """The given providers (None: every provider the broker has seen, the latest seen
    first)."""
    if provider_ids is None:
        rows = db.query(f"SELECT {Provider.COLUMNS} FROM providers ORDER BY last_seen_ms DESC")
    else:
        marks = ",".join("?" * len(provider_ids))
        rows = db.query(f"SELECT {Provider.COLUMNS} FROM providers WHERE id IN ({marks})",
                        provider_ids)
    return [Provider.from_row(r) for r in rows]


def _device_line(d: pb.Device) -> str:
    return f"{d.name} ({d.memory_bytes / 2**30:.1f} GiB)"


def standings(db: Database, provider_ids: list[str] | None, now: int) -> list[pb.ProviderStanding]:
    """Standing of the given providers (None: every provider the broker has seen)."""
    found = providers(db, provider_ids)
    ids = [p.id for p in found]
    offers = {r["provider_id"]: r["envelope"] for r in views.offers(db)}
    running = views.active_lease_counts(db)
    balances = {a: ledger.balance(db, a) for i in ids
                for a in (ledger.provider(i), ledger.stake(i))}
    checked = verification.standings(db)
    out = []
    for provider in found:
        h = views.provider_history(db, provider.id, now)
        standing = pb.ProviderStanding(
            provider_id=provider.id, online=provider.online, banned=provider.banned,
            reliability=reliability.score(h), leases_completed=h.leases_completed,
            leases_lost=reliability.failures(h), running=running.get(provider.id, 0),
            earned=balances.get(ledger.provider(provider.id), 0) / ledger.UNIT,
            stake=balances.get(ledger.stake(provider.id), 0),
            last_seen_ms=provider.last_seen_ms, first_seen_ms=provider.first_seen_ms)
        rate, passed, failed = checked.get(provider.id, (verification.rate(0), 0, 0))
        standing.check_rate, standing.checks_passed, standing.checks_failed = rate, passed, failed
        offer_envelope = offers.get(provider.id)
        if offer_envelope is not None:
            envelope = pb.Envelope.FromString(offer_envelope)
            offer = pb.Offer.FromString(envelope.payload)
            standing.price_per_gpu_hour = offer.price_per_gpu_hour
            standing.interruptible_price_per_gpu_hour = offer_terms.interruptible_price(offer)
            standing.devices.extend(_device_line(d) for d in offer.devices)
        out.append(standing)
    return out


def job_costs(db: Database, job_ids: list[str], now: int) -> dict[str, float]:
    """Credits each job has been charged so far: its settled progress (the ledger)."""
    return {j: ledger.job_money(db, j)["charged"] / ledger.UNIT for j in job_ids}
