"""Devices offered as slices (docs/provider.md, Slices): the rules both roles apply.

A provider may offer one device (its card: a GPU, or the CPU device) as several slices, each a
device of its own in the offer with ``slice_of`` naming the card's index and a share of the
card's memory and compute. The card stays offered whole too: a job that needs all of it
leases the card, a smaller one a slice. A card and its slices are never leased at once
(``blocked``); sibling slices are. A slice runs jobs of one device only.

No grpc here: the broker checks offers with ``check_offer``, the provider and the broker
both keep devices busy with ``blocked``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

MAX_SLICES = 8          # slices of one card (MIG cuts an A100/H100 into at most 7)
MIN_SHARE = 1 / 64      # the smallest share a slice may have
SHARE_SLACK = 1e-6      # shares of one card may sum to 1 + this (rounding of 1/3 and alike)


class SliceError(ValueError):
    """An offer's (or a config's) slices break a rule: the message says which, in one line."""


def check_shares(shares: Iterable[float], where: str) -> tuple[float, ...]:
    """The shares of one card's slices, checked: 2 to MAX_SLICES of them, each a finite
    number in [MIN_SHARE, 1], summing to at most 1. Raises SliceError naming ``where``."""
    out = tuple(shares)
    if not 2 <= len(out) <= MAX_SLICES:
        raise SliceError(f"{where}: {len(out):,} slices of one device; a device is offered"
                         f" as 2 to {MAX_SLICES} slices")
    for s in out:
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) \
                or not MIN_SHARE <= s <= 1:
            raise SliceError(f"{where}: a slice's share must be a number from"
                             f" {MIN_SHARE:g} to 1, not {s!r}")
    if sum(out) > 1 + SHARE_SLACK:
        raise SliceError(f"{where}: the slices' shares sum to {sum(out):.4g}, more than the"
                         " whole device")
    return tuple(float(s) for s in out)


def blocked(devices: Iterable[tuple[int, int | None]], taken: Iterable[int]) -> set[int]:
    """The devices not free to lease while ``taken`` are leased: those, the card of each
    slice taken, and every slice of a card taken whole (a card busy only through one of
    its slices leaves that slice's siblings free). ``devices``: (index, slice_of or None)
    of every device offered."""
    taken = set(taken)
    out = set(taken)
    for index, card in devices:
        if card is None:
            continue
        if index in taken:
            out.add(card)
        if card in taken:
            out.add(index)
    return out


def overlapping(devices: Iterable[tuple[int, int | None]], wanted: Iterable[int]) -> bool:
    """Whether ``wanted`` (the devices of one lease) holds a card and one of its slices, or
    two slices of one card: never one lease's."""
    wanted = set(wanted)
    cards = [card for index, card in devices if card is not None and index in wanted]
    return len(cards) != len(set(cards)) or bool(set(cards) & wanted)


def check_offer(devices) -> None:
    """Raise SliceError if the slices among an offer's ``devices`` (pb.Device) break a rule:
    a slice names a whole device of the same offer and of the same accelerator; a card has
    at most MAX_SLICES slices; each memory and compute share is a number in [MIN_SHARE, 1]
    and those of one card sum to at most 1; a slice claims no more memory than its share
    of its card's."""
    by_index = {d.index: d for d in devices}
    cards: dict[int, list] = {}
    for d in devices:
        if d.HasField("slice_of"):
            cards.setdefault(d.slice_of, []).append(d)
    for card_index, slices in sorted(cards.items()):
        where = f"offer.devices: device {card_index}"
        if len(slices) > MAX_SLICES:
            raise SliceError(f"{where} is offered as {len(slices):,} slices; at most"
                             f" {MAX_SLICES}")
        card = by_index.get(card_index)
        if card is None or card.HasField("slice_of"):
            raise SliceError(f"{where}: a slice names no whole device of this offer")
        for name in ("memory_share", "compute_share"):
            shares = [getattr(s, name) for s in slices]
            for share in shares:
                if not math.isfinite(share) or not MIN_SHARE <= share <= 1:
                    raise SliceError(f"{where}: a slice's {name.replace('_', ' ')} must be"
                                     f" a number from {MIN_SHARE:g} to 1, not {share!r}")
            if sum(shares) > 1 + SHARE_SLACK:
                raise SliceError(f"{where}: its slices' {name.replace('_', ' ')}s sum to"
                                 f" {sum(shares):.4g}, more than the whole device")
        for s in slices:
            if s.accelerator != card.accelerator:
                raise SliceError(f"{where}: slice {s.index} is of another accelerator than"
                                 " its device")
            if s.memory_bytes > card.memory_bytes * s.memory_share + 1:
                raise SliceError(f"{where}: slice {s.index} claims more memory than its"
                                 f" share ({s.memory_share:g}) of the device's")
