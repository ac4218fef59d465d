"""How much the broker trusts a provider, from what it observed. Plain code, no grpc.

MTBF (mean time between failures) = (observed online time + PRIOR_UPTIME_S) /
(leases lost + PRIOR_FAILURES): a new provider is assumed to fail about once an hour and earns
a longer MTBF by staying up. A lease its provider reported ``failed`` weighs like a lost one
until a second provider reports the same job failing too (endings.fail: the job's own failure,
``crashed``): a provider's word alone that a job failed is its own failure.

Score in [0, 1] (docs/matching.md):
    completion = (completed + 1) / (completed + LOSS_WEIGHT x lost + 2)
    uptime     = (online in the window + 0.5 x PRIOR_WINDOW_S) / (window + PRIOR_WINDOW_S)
    tenure     = 1 - exp(-age / TENURE_S)
    score      = completion x sqrt(uptime) x (0.6 + 0.4 x tenure)
A new provider scores 0.5 x 0.71 x 0.6 ≈ 0.21; trust is slow to earn (tenure, the priors)
and fast to lose (each lost lease counts LOSS_WEIGHT times).

Checkpoint interval (Young, 1974): sqrt(2 x checkpoint cost x MTBF), clamped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PRIOR_UPTIME_S = 3600.0
PRIOR_FAILURES = 1.0
LOSS_WEIGHT = 3.0
PRIOR_WINDOW_S = 6 * 3600.0
WINDOW_S = 7 * 86400.0
TENURE_S = 3 * 86400.0
DEFAULT_CHECKPOINT_COST_S = 2.0
MIN_INTERVAL_S = 5.0
MAX_INTERVAL_S = 3600.0
RESTART_S = 30.0               # lease expiry + start-up, paid again after each failure


@dataclass(frozen=True)
class ProviderHistory:
    uptime_s: float            # seconds online in sessions, as the broker saw them
    leases_lost: int           # leases that ended because the provider vanished or went silent
    leases_completed: int      # leases that ended with a verified receipt
    uptime_window_s: float = 0.0   # seconds online within the last WINDOW_S
    window_s: float = 0.0          # length of that window the provider has existed for
    age_s: float = 0.0             # time since first seen
    leases_failed: int = 0         # leases it reported failed that no other provider confirmed


def mtbf_s(h: ProviderHistory) -> float:
    """Estimated mean time between failures, in seconds."""
    return (h.uptime_s + PRIOR_UPTIME_S) / (failures(h) + PRIOR_FAILURES)


def failures(h: ProviderHistory) -> int:
    """Leases it lost, and leases it reported failed alone: both count as its failures."""
    return h.leases_lost + h.leases_failed


def score(h: ProviderHistory) -> float:
    completion = (h.leases_completed + 1) / (h.leases_completed + LOSS_WEIGHT * failures(h) + 2)
    uptime = (h.uptime_window_s + 0.5 * PRIOR_WINDOW_S) / (h.window_s + PRIOR_WINDOW_S)
    tenure = 1 - math.exp(-h.age_s / TENURE_S)
    return completion * math.sqrt(min(1.0, uptime)) * (0.6 + 0.4 * tenure)


def checkpoint_interval_s(checkpoint_cost_s: float, mtbf: float) -> float:
    """Young's optimal checkpoint interval, clamped to [MIN_INTERVAL_S, MAX_INTERVAL_S]."""
    cost = checkpoint_cost_s if checkpoint_cost_s > 0 else DEFAULT_CHECKPOINT_COST_S
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, math.sqrt(2.0 * cost * mtbf)))


def expected_time_s(runtime_s: float, mtbf: float, checkpoint_cost_s: float) -> float:
    """Expected wall time to finish ``runtime_s`` of work on a provider with this MTBF:
    checkpoint writes, plus per failure half an interval redone and a restart."""
    cost = checkpoint_cost_s if checkpoint_cost_s > 0 else DEFAULT_CHECKPOINT_COST_S
    tau = checkpoint_interval_s(cost, mtbf)
    return runtime_s * (1 + cost / tau) + (runtime_s / mtbf) * (tau / 2 + RESTART_S)


def p_uninterrupted(time_s: float, mtbf: float) -> float:
    return math.exp(-time_s / mtbf)
