"""What a broker keeps of its offer Book between placement passes (issue 36).

At 10,000 offers a pass read every provider's record (``views.histories``: three queries
over 10,000 rows), made every offer's views again and the Book's columns from them: about a
quarter of a second a pass on this machine, a pass for every few hundred submissions. What
most of it rests on moves only when a provider reports something (a session opened or
closed, an offer advertised, a lease ended) or with the clock (a record's online time), so:

- ``KeptHistories``: each provider's record as last read, read again for the providers
  whose offer is new or changed or one of whose leases ended since the last pass (its count
  of active leases fell), and for all of them every ``HISTORY_S``: a record is at most that
  old (in its online time and age; in a lease it lost only where another was leased to it
  since the last pass, its count unchanged);
- market/offers.KeptOffers keeps each offer's views with what they were made from, and
  makes again only those whose inputs changed (the same view objects otherwise);
- ``KeptBook``: the last Book's columns, the rows of changed views patched in place
  (``matcher.COLUMNS``, the table ``Book.__init__`` fills them from), and a copy of them
  handed to each pass (a pass takes devices from its Book; the one kept is nobody's).

tests/test_kept_book.py holds a kept Book to a fresh one after random changes.
"""

from __future__ import annotations

from datetime import datetime

import numpy as np

from gpumarket.broker.market import matcher
from gpumarket.broker.market.matcher import Book, OfferView
from gpumarket.broker.market.reliability import ProviderHistory
from gpumarket.proto.v1 import types_pb2 as pb

HISTORY_S = 5.0         # seconds a provider's record is used before it is read again anyway
# Patching more rows than this share of the Book costs more than making the Book again.
PATCH_SHARE = 0.5


class KeptHistories:
    """Providers' records (``ProviderHistory``) kept between passes: ``due`` says whose to
    read, ``keep`` takes what was read and answers every live provider's."""

    def __init__(self, max_age_s: float = HISTORY_S) -> None:
        self.max_age_ms = int(max_age_s * 1000)
        self._by_provider: dict[str, ProviderHistory] = {}
        self._seen: dict[str, tuple[pb.Offer, int]] = {}     # its offer and active leases
        self.read_at_ms: int | None = None

    def due(self, offers: list[pb.Offer], loads: dict[str, int], now_ms: int) -> list[str]:
        """The providers of ``offers`` whose records to read now: every one when the kept
        records are ``HISTORY_S`` old; else those not kept, whose offer is another message
        than at the last pass (a session opened again, an offer advertised), or whose
        active leases are fewer (one ended: lost, failed or completed moves the record)."""
        if self.read_at_ms is None or now_ms - self.read_at_ms >= self.max_age_ms:
            return [o.provider_id for o in offers]
        out = []
        kept, seen = self._by_provider, self._seen
        for o in offers:
            p = o.provider_id
            last = seen.get(p)
            if p not in kept or last is None or last[0] is not o or loads.get(p, 0) < last[1]:
                out.append(p)
        return out

    def keep(self, offers: list[pb.Offer], loads: dict[str, int], read: dict[str,
             ProviderHistory], now_ms: int) -> dict[str, ProviderHistory]:
        """Keep ``read`` (the records ``due`` named, read at ``now_ms``); return the record
        of every provider of ``offers``, forgetting those of providers gone."""
        if self.read_at_ms is None or now_ms - self.read_at_ms >= self.max_age_ms:
            self._by_provider = {}
            self.read_at_ms = now_ms
        self._by_provider.update(read)
        self._seen = {o.provider_id: (o, loads.get(o.provider_id, 0)) for o in offers}
        if len(self._by_provider) > len(self._seen):
            self._by_provider = {p: h for p, h in self._by_provider.items() if p in self._seen}
        return self._by_provider


class KeptBook:
    """The last Book, kept: ``book`` patches the rows whose views changed and hands out a
    copy; where the views are not the same providers in the same order (a session opened or
    closed) or too many changed, it makes the Book anew."""

    def __init__(self) -> None:
        self._base: Book | None = None
        self._windowed: set[int] = set()     # rows whose policy has hours of availability

    def book(self, views: list[OfferView], now: datetime) -> Book:
        """A Book of ``views`` at ``now``, equal to ``Book(views, now)``, the caller's to
        take devices from."""
        base = self._base
        if base is None or not self._patch(base, views):
            base = self._base = Book(views, now)
            self._windowed = {i for i, x in enumerate(base.offers) if x.policy.windows}
        return self._copy(base, now)

    def _patch(self, base: Book, views: list[OfferView]) -> bool:
        """Patch ``base``'s rows whose views are other objects than it holds; False (and
        ``base`` untouched) where a patch cannot make it equal to a new Book: another
        provider or slice layout on a row, a job kind the Book has no bit for, too many
        rows changed."""
        old = base.offers
        if len(old) != len(views):
            return False
        rows = [i for i, (a, b) in enumerate(zip(old, views)) if a is not b]
        if len(rows) > PATCH_SHARE * len(views):
            return False
        bits = base._kind_bit
        for i in rows:
            a, b = old[i], views[i]
            if a.provider_id != b.provider_id or a.cards != b.cards or \
                    any(k not in bits for k in b.kinds):
                return False
        columns = [(getattr(base, name), value) for name, _, value in matcher.COLUMNS]
        for i in rows:
            x = views[i]
            old[i] = x
            for column, value in columns:
                column[i] = value(x)
            base.free_devices[i] = list(x.free)
            base.free[i] = len(base.free_devices[i])
            base.kinds[i] = sum(bits[k] for k in x.kinds)
            if x.cards:
                base.leased[x.provider_id] = set(x.busy)
            if x.policy.windows:
                self._windowed.add(i)
            else:
                self._windowed.discard(i)
                base.available[i] = True
        if rows:
            base._restricted_idx = np.flatnonzero(base.restricted)
            base._capped_idx = np.flatnonzero(base.max_job > 0)
        return True

    def _copy(self, base: Book, now: datetime) -> Book:
        """``base`` as a Book of its own at ``now``: every column and what a placement
        changes copied (the caller takes devices from it; the next patch changes ``base``
        while an older copy may still be read), its caches empty, its hours of
        availability at ``now``."""
        book = object.__new__(Book)
        for name, value in vars(base).items():
            setattr(book, name, value.copy() if isinstance(value, np.ndarray) else value)
        book.offers = list(base.offers)
        book.free_devices = list(base.free_devices)
        book.leased = {p: set(d) for p, d in base.leased.items()}
        book._static, book._clients, book._factors = {}, {}, {}
        book.now = now
        for i in self._windowed:
            book.available[i] = book.offers[i].policy.available(now)
        return book

