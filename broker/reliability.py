"""How much the broker trusts a provider, from what it observed. Plain code, no grpc.

MTBF (mean time between failures) = (observed online time + prior time) /
(leases lost + prior failures). The prior counts as one failure in PRIOR_UPTIME_S of
uptime, so a new provider starts with a short MTBF and earns a longer one by staying up.

Checkpoint interval (Young, 1974): sqrt(2 x checkpoint cost x MTBF), clamped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PRIOR_UPTIME_S = 3600.0        # a new provider is assumed to fail once an hour
PRIOR_FAILURES = 1.0
DEFAULT_CHECKPOINT_COST_S = 2.0
MIN_INTERVAL_S = 5.0
MAX_INTERVAL_S = 3600.0


@dataclass(frozen=True)
class ProviderHistory:
    uptime_s: float            # seconds online in sessions, as the broker saw them
    leases_lost: int           # leases that ended because the provider vanished or went silent
    leases_completed: int      # leases that ended with a verified receipt


def mtbf_s(h: ProviderHistory) -> float:
    """Estimated mean time between failures, in seconds."""
    return (h.uptime_s + PRIOR_UPTIME_S) / (h.leases_lost + PRIOR_FAILURES)


def checkpoint_interval_s(checkpoint_cost_s: float, mtbf: float) -> float:
    """Young's optimal checkpoint interval, clamped to [MIN_INTERVAL_S, MAX_INTERVAL_S]."""
    cost = checkpoint_cost_s if checkpoint_cost_s > 0 else DEFAULT_CHECKPOINT_COST_S
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, math.sqrt(2.0 * cost * mtbf)))
