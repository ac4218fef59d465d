"""What a broker keeps of its offer Book between passes (market/kept_book.py, issue 36): after
any sequence of what changes a market — sessions opening and closing, offers advertised
again, placements taking devices, leases ending, records and stakes moving — the kept Book
(its rows patched) places as a Book made afresh from the same views; a pass's taking devices
from its Book leaves the kept one as it was; and providers' records are read again when
their offers change or a lease of theirs ends, and all of them once they are old."""

from __future__ import annotations

import random

import pytest

from gpumarket.broker.market import kept_book, matcher, offers
from gpumarket.broker.market.matcher import Book, JobNeeds
from gpumarket.broker.market.reliability import ProviderHistory
from gpumarket.proto.v1 import types_pb2 as pb
from tests.test_kept_offers import NOW, Market, advertised


def rows(book: Book) -> list[tuple]:
    """Every row of ``book`` as plain values — its view, each column, its free devices,
    hours, kinds (by number: the bits may be numbered otherwise), its provider's leased
    devices, whether it is restricted or capped — and the provider index: what makes two
    Books place alike."""
    kinds = {bit: k for k, bit in book._kind_bit.items()}
    restricted, capped = set(book._restricted_idx.tolist()), set(book._capped_idx.tolist())
    out = [(x, *(getattr(book, name)[i].item() for name, _, _ in matcher.COLUMNS),
            tuple(book.free_devices[i]), int(book.free[i]), bool(book.available[i]),
            frozenset(k for bit, k in kinds.items() if int(book.kinds[i]) & bit),
            frozenset(book.leased[x.provider_id]) if x.cards else None,
            i in restricted, i in capped)
           for i, x in enumerate(book.offers)]
    return [*out, book.views, book.index, book.now]


def take_some(rng: random.Random, book: Book) -> None:
    """What a pass does to its Book: place a few jobs (devices taken, loads up)."""
    for n in range(rng.randint(0, 3)):
        book.place(JobNeeds(f"j{n}", pb.JOB_KIND_TRAINING, 1, 0, matcher.ANY, 100.0))


def run(seed: int, kept: kept_book.KeptBook, steps: int = 300) -> int:
    """Apply ``steps`` random events to a market, building its Book after each the kept way
    and afresh; return the first step at which they differ (-1: none did)."""
    rng = random.Random(seed)
    market = Market(rng)
    views = offers.KeptOffers()
    for step in range(steps):
        market.step()
        book = kept.book(views.views(*market.inputs()), NOW)
        if rows(book) != rows(Book(market.fresh(), NOW)):
            return step
        take_some(rng, book)        # the pass's own copy: the kept Book must not see this
    return -1


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_kept_book_places_as_a_fresh_one_after_any_changes(seed):
    assert run(seed, kept_book.KeptBook()) == -1


def test_a_market_that_stays_put_patches_rather_than_rebuilds():
    rng = random.Random(5)
    market = Market(rng)
    for _ in range(30):
        market.open_session()
    kept, views = kept_book.KeptBook(), offers.KeptOffers()
    first = kept.book(views.views(*market.inputs()), NOW)
    base = kept._base
    market.place(sorted(market.offers)[0])
    market.observe(sorted(market.offers)[1])
    again = kept.book(views.views(*market.inputs()), NOW)
    assert kept._base is base and again is not base and again is not first
    assert rows(again) == rows(Book(market.fresh(), NOW))


class NoFreeDevices(kept_book.KeptBook):
    """A keeper that drops an update: a patched row keeps its old free devices."""

    def _patch(self, base, views):
        before = list(base.free_devices), base.free.copy()
        patched = super()._patch(base, views)
        if patched:
            base.free_devices[:], base.free[:] = before
        return patched


class SharedColumns(kept_book.KeptBook):
    """A keeper that hands out the kept Book itself: a pass's placements change it."""

    def _copy(self, base, now):
        return base


@pytest.mark.parametrize("keeper", [NoFreeDevices, SharedColumns])
def test_a_dropped_update_is_found(keeper):
    assert run(1, keeper()) >= 0


def offer(provider_id: str) -> pb.Offer:
    return advertised(random.Random(provider_id), provider_id)


def test_records_are_read_again_for_what_moved_them_and_all_once_old():
    kept = kept_book.KeptHistories(max_age_s=5)
    live = [offer("a"), offer("b"), offer("c")]
    loads = {"a": 2, "b": 1}

    def history(p: str, uptime: float) -> dict[str, ProviderHistory]:
        return {p: ProviderHistory(uptime_s=uptime, leases_lost=0, leases_completed=0)}

    assert kept.due(live, loads, 1_000) == ["a", "b", "c"]
    read = {p: h for p in "abc" for h in history(p, 1.0).values()}
    assert kept.keep(live, loads, read, 1_000) == read
    assert kept.due(live, loads, 2_000) == []               # nothing moved
    live[1] = pb.Offer.FromString(live[1].SerializeToString())  # b advertised again
    loads = {"a": 1, "b": 1, "c": 3}                        # a lease of a ended, c leased
    assert kept.due(live, loads, 2_000) == ["a", "b"]
    got = kept.keep(live, loads, {**history("a", 2.0), **history("b", 2.0)}, 2_000)
    assert got["a"].uptime_s == 2.0 and got["c"].uptime_s == 1.0
    live = live[:2] + [offer("d")]                          # c went, d came
    assert kept.due(live, loads, 3_000) == ["d"]
    assert set(kept.keep(live, loads, history("d", 0.0), 3_000)) == {"a", "b", "d"}
    assert kept.due(live, loads, 6_000) == ["a", "b", "d"]  # 5 s since all were read
