"""The offers' Templates kept between placement passes (market/offers.KeptOffers): after any
sequence of what changes a market (sessions opening and closing, offers advertised again,
placements taking devices, leases ending, records and stakes moving), the views made from
the kept Templates are those ``offer_views`` makes afresh, and so is the Book of them."""

from __future__ import annotations

import random
from datetime import datetime, timezone

import numpy as np
import pytest

from gpumarket.broker.market import offers
from gpumarket.broker.market.matcher import Book
from gpumarket.broker.market.reliability import ProviderHistory
from gpumarket.proto.v1 import types_pb2 as pb

GIB = 1 << 30
NOW = datetime(2026, 11, 26, 12, 0, tzinfo=timezone.utc)     # one clock for both Books
BOOK_COLUMNS = ("price", "interruptible_price", "count", "free", "load", "accel", "memory",
                "cc", "flops", "rel", "stake", "mtbf", "max_job", "kinds", "restricted",
                "is_slice")


def advertised(rng: random.Random, provider_id: str) -> pb.Offer:
    """A provider's offer as a new message: 1-3 devices, CPU or GPU, sometimes a card cut
    into slices, a price, kinds and a policy drawn from ``rng``."""
    cuda = rng.random() < 0.5
    devices = [pb.Device(index=i, name="NVIDIA H100" if cuda else "test CPU",
                         accelerator=pb.ACCELERATOR_CUDA if cuda else pb.ACCELERATOR_CPU,
                         memory_bytes=rng.choice((16, 40, 80)) * GIB, cpu_cores=8,
                         compute_capability="9.0" if cuda else "",
                         benchmark=pb.Benchmark(matmul_flops=rng.choice((1e11, 5e11, 1e12)),
                                                matmul_dtype="fp32"))
               for i in range(rng.randint(1, 3))]
    if rng.random() < 0.3:      # the first card also offered as two halves
        devices += [pb.Device(index=10 + k, name=devices[0].name,
                              accelerator=devices[0].accelerator,
                              memory_bytes=devices[0].memory_bytes // 2, cpu_cores=4,
                              slice_of=0, memory_share=0.5, compute_share=0.5)
                    for k in range(2)]
    policy = pb.Policy(max_job_seconds=rng.choice((0, 3600)),
                       denied_clients=["mallory"] if rng.random() < 0.2 else [])
    return pb.Offer(provider_id=provider_id, devices=devices,
                    price_per_gpu_hour=rng.choice((0.5, 1.0, 2.5)),
                    kinds=rng.sample([pb.JOB_KIND_TRAINING, pb.JOB_KIND_GENERATE,
                                      pb.JOB_KIND_RENDER], rng.randint(1, 3)),
                    engines=["transformers"], policy=policy)


class Market:
    """What the broker reads before a pass, changed one event at a time."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.offers: dict[str, pb.Offer] = {}
        self.histories: dict[str, ProviderHistory] = {}
        self.busy: dict[str, set[int]] = {}
        self.loads: dict[str, int] = {}
        self.achieved: dict[str, float] = {}
        self.stakes: dict[str, int] = {}
        self.made = 0

    def open_session(self) -> None:
        self.made += 1
        provider = f"p{self.made}"
        self.offers[provider] = advertised(self.rng, provider)
        self.histories[provider] = ProviderHistory(uptime_s=0.0, leases_lost=0,
                                                   leases_completed=0)

    def close_session(self, provider: str) -> None:
        del self.offers[provider]

    def advertise_again(self, provider: str) -> None:
        self.offers[provider] = advertised(self.rng, provider)

    def advertise_same(self, provider: str) -> None:
        """The same offer as a new message (a remote offer read again)."""
        self.offers[provider] = pb.Offer.FromString(self.offers[provider].SerializeToString())

    def place(self, provider: str) -> None:
        free = [d.index for d in self.offers[provider].devices
                if d.index not in self.busy.get(provider, set())]
        if free:
            self.busy.setdefault(provider, set()).add(self.rng.choice(free))
            self.loads[provider] = self.loads.get(provider, 0) + 1

    def end_lease(self, provider: str) -> None:
        if self.busy.get(provider):
            self.busy[provider].discard(self.rng.choice(sorted(self.busy[provider])))
            self.loads[provider] -= 1

    def observe(self, provider: str) -> None:
        h = self.histories[provider]
        self.histories[provider] = ProviderHistory(
            uptime_s=h.uptime_s + self.rng.choice((1.0, 600.0)),
            leases_lost=h.leases_lost + (self.rng.random() < 0.3),
            leases_completed=h.leases_completed + (self.rng.random() < 0.7))
        if self.rng.random() < 0.3:
            self.achieved[provider] = self.rng.choice((1e10, 2e11))
        if self.rng.random() < 0.3:
            self.stakes[provider] = self.rng.choice((0, 100, 10_000))

    def step(self) -> None:
        live = sorted(self.offers)
        if not live or self.rng.random() < 0.15:
            self.open_session()
            return
        provider = self.rng.choice(live)
        self.rng.choice((self.close_session, self.advertise_again, self.advertise_same,
                         self.place, self.place, self.end_lease, self.observe))(provider)

    def inputs(self) -> tuple:
        live = list(self.offers.values())
        achieved = {p: f for p, f in self.achieved.items() if p in self.offers}
        return (live, self.histories, achieved, self.busy, self.loads,
                offers.claim_efficiency(live, achieved), self.stakes)

    def fresh(self) -> list:
        live, histories, achieved, busy, loads, efficiency, stakes = self.inputs()
        return [v for o in live for v in offers.offer_views(
            o, histories[o.provider_id], achieved.get(o.provider_id, 0.0),
            frozenset(busy.get(o.provider_id, ())), loads.get(o.provider_id, 0), efficiency,
            stakes.get(o.provider_id, 0))]


def same_books(kept: list, fresh: list) -> bool:
    a, b = Book(kept, now=NOW), Book(fresh, now=NOW)
    return (kept == fresh and a.views == b.views and a.free_devices == b.free_devices
            and all(np.array_equal(getattr(a, c), getattr(b, c)) for c in BOOK_COLUMNS))


def run(seed: int, kept: offers.KeptOffers, steps: int = 400) -> int:
    """Apply ``steps`` random events, comparing after each; return the first step at which
    the kept views differ from fresh ones (-1: none did)."""
    rng = random.Random(seed)
    market = Market(rng)
    for step in range(steps):
        market.step()
        if not same_books(kept.views(*market.inputs()), market.fresh()):
            return step
        assert len(kept) == len(market.offers)      # a closed session's Template is gone
    return -1


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kept_views_equal_fresh_ones_after_any_changes(seed):
    assert run(seed, offers.KeptOffers()) == -1


class Forgetful(offers.KeptOffers):
    """A keeper that drops an update: an offer advertised again keeps its old Template."""

    def template(self, offer):
        kept = self._by_provider.get(offer.provider_id)
        return kept[1] if kept is not None else super().template(offer)


def test_a_dropped_update_is_found():
    assert run(1, Forgetful()) >= 0


def test_an_unchanged_offer_keeps_its_template():
    rng = random.Random(7)
    offer = advertised(rng, "p1")
    kept = offers.KeptOffers()
    first = kept.template(offer)
    assert kept.template(offer) is first
    assert kept.template(pb.Offer.FromString(offer.SerializeToString())) is first
    changed = pb.Offer()
    changed.CopyFrom(offer)
    changed.price_per_gpu_hour += 1
    assert kept.template(changed) is not first
