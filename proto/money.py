"""Money as every role shows and types it. The ledger counts integer units: 1 credit =
1,000,000 units (``UNIT``); prices in offers and job files are credits per device-hour."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

UNIT = 1_000_000


def units(credits: float) -> int:
    """Credits (a float price or budget) to units, rounded to the nearest unit."""
    return round(credits * UNIT)


def fmt(amount: int) -> str:
    """Units as credits for people: up to six decimals, at least two."""
    sign = "-" if amount < 0 else ""
    whole, frac = divmod(abs(amount), UNIT)
    return f"{sign}{whole:,}.{f'{frac:06d}'.rstrip('0').ljust(2, '0')}"


def parse_credits(text: str) -> int:
    """A positive amount of credits as typed ("25", "0.5") to units exactly; ValueError
    saying what is wrong otherwise."""
    try:
        value = Decimal(text.strip()) * UNIT
    except InvalidOperation:
        raise ValueError(f"{text!r} is not a number of credits") from None
    if not value.is_finite() or value <= 0 or value != value.to_integral_value():
        raise ValueError(f"{text!r}: a positive amount of credits with at most six decimals")
    return int(value)


def offer_prices(offer) -> tuple[float, float]:
    """(standard, interruptible): credits per device-hour a lease pays on a signed Offer at
    each tier (serving pays standard). Standard is the highest of the offer's and its
    devices' own prices; interruptible is the offer's interruptible share of its price
    applied to that, never more (an offer without one, 0, sells interruptible at standard)."""
    standard = max([offer.price_per_gpu_hour, *(d.price_per_hour for d in offer.devices)])
    asked = offer.interruptible_price_per_gpu_hour
    if asked <= 0:
        return standard, standard
    if offer.price_per_gpu_hour <= 0:
        return standard, min(asked, standard)
    return standard, standard * min(1.0, asked / offer.price_per_gpu_hour)
