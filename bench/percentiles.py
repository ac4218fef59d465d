"""Percentiles as bench/serving.py and bench/colocated.py report them: one nearest-rank
percentile (``pct``), a latency's p50 and p99 in milliseconds (``p50_p99_ms``), and the same
latency measured alone and beside other work (``alone_vs_colocated``). Imported by those
scripts (bench/ is on their ``sys.path``); prints nothing."""

from __future__ import annotations


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank; 0.0 if there are none."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else 0.0


def p50_p99_ms(seconds: list[float], name: str) -> dict[str, float]:
    """``{name}_p50_ms`` and ``{name}_p99_ms`` of latencies given in seconds."""
    return {f"{name}_p50_ms": pct(seconds, 0.5) * 1000,
            f"{name}_p99_ms": pct(seconds, 0.99) * 1000}


def ratio_interval(alone: list[float], colocated: list[float], q: float = 0.99,
                   draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 90 % bootstrap interval of ``pct(colocated, q) / pct(alone, q)``: both sides
    resampled with replacement ``draws`` times, the ratio's 5th and 95th percentiles. How far
    one run's ratio can be trusted: with a few hundred requests a side, a p99 is one of the
    few slowest requests, and the interval says how much two such runs may differ."""
    import random

    rng = random.Random(seed)
    ratios = sorted(pct(rng.choices(colocated, k=len(colocated)), q)
                    / max(pct(rng.choices(alone, k=len(alone)), q), 1e-9)
                    for _ in range(draws))
    return round(pct(ratios, 0.05), 3), round(pct(ratios, 0.95), 3)


def alone_vs_colocated(alone: list[float], colocated: list[float], prefix: str = "",
                       ratio_key: str = "colocated_ttft_p99_ratio") -> dict[str, float]:
    """TTFTs (seconds) measured alone and colocated: the ratio of their p99s (``ratio_key``)
    with its 90 % bootstrap interval (``ratio_key``_ci90, ``ratio_interval``) and the ratio
    of their p50s, then each side's p99 and p50 in milliseconds (to 0.1 ms), keys starting
    with ``prefix``."""
    return {ratio_key: round(pct(colocated, 0.99) / pct(alone, 0.99), 3),
            f"{ratio_key}_ci90": list(ratio_interval(alone, colocated)),
            f"{prefix}ttft_p50_ratio": round(pct(colocated, 0.5) / pct(alone, 0.5), 3),
            f"{prefix}alone_ttft_p99_ms": round(pct(alone, 0.99) * 1000, 1),
            f"{prefix}colocated_ttft_p99_ms": round(pct(colocated, 0.99) * 1000, 1),
            f"{prefix}alone_ttft_p50_ms": round(pct(alone, 0.5) * 1000, 1),
            f"{prefix}colocated_ttft_p50_ms": round(pct(colocated, 0.5) * 1000, 1)}
