"""Job arrays' task checks (docs/verification.md, Job arrays): how often one check of a lease
of n tasks, one of them doctored, replays the doctored task, measured by drawing the real
sample (broker/checks/task_checks.py ``sample``, the system's random source) against a
doctored task drawn at random; run by bench/verification.py, which turns the catch
probability into detection within 20 checked leases. The comparison of a replayed task's
files is a script's (bench/verification.py ``script_checks`` measures that a made-up JSON
file is caught by every replay)."""

from __future__ import annotations

import random

from gpumarket.broker.checks import task_checks

LEASES = (4, 8, 100, 1000)      # tasks a lease ran


def catch_rates(draws: int, seed: int = 9) -> dict[int, float]:
    """For each lease size n: the share of ``draws`` checks whose real sample holds the one
    doctored task (drawn uniformly, independently of the sample)."""
    rng = random.Random(seed)
    out = {}
    for n in LEASES:
        hits = sum(rng.randrange(n) in task_checks.sample(list(range(n)))
                   for _ in range(draws))
        out[n] = hits / draws
    return out
