"""How a sampled row's tokens were drawn (docs/verification.md, "Sampled tokens"): the
checker's prefill computes, at each generated position, the distribution the row's own
temperature and top_p give (the provider's sampler: logits / temperature, softmax, the
smallest set of most likely tokens whose mass reaches top_p), and of the provider's token:

- how far it falls outside that nucleus: the nucleus's least likely member's logit less
  its logit, in standard deviations of that position's logits (at most 0 for every token an
  honest sampler can draw, up to rounding: the greedy token gap's measure, a greedy draw
  being a nucleus of one);
- its tail mass within the nucleus, ``u``: the nucleus mass of the tokens at most as likely
  as it, over the nucleus mass. An honest draw's ``u`` is at least uniform on (0, 1]
  (P(u <= a) <= a, whatever the model and temperature), so the row's least ``u`` times its
  token count, and Fisher's -2 sum(log u) against a chi-square of 2n degrees, are p-values
  with a known bound: a token swapped for one the model found unlikely, or a row drawn from
  another model, gets a p-value no honest row reaches.

The checker sends the figures (``figures``: tokens, outside, least, fisher); the broker
judges them here, without torch. No grpc here.
"""

from __future__ import annotations

import math

# A row whose least u or whose Fisher statistic has a p-value below this fails. The bound is
# analytic (an honest row reaches it once in P_LIMIT rows, whatever the model) and the
# measured honest rows stay orders above it (bench/sampled_spread.py).
P_LIMIT = 1e-9
LEAST_U = 1e-300      # the floor of a token's u (the checker's float64)


# How far outside the nucleus an honest token may fall by rounding, in standard deviations
# of its position's logits. Measured (bench/sampled_spread.py, 8 rows x 48 tokens x 5
# samplings x 4 providers x 3 models): a float32 provider against a float32 checker at most
# 0.017 (the sampler's own float32 cumulative sum moving the edge by one token of a flat
# distribution), a bfloat16 provider at most 0.156 (a peaked model at top_p 0.5). A token
# swapped for one the model found unlikely: many standard deviations.
OUTSIDE_MARGIN = {"float32": 0.1, "half": 0.5}


def outside_margin(dtype: str) -> float:
    return OUTSIDE_MARGIN["float32"] if dtype == "float32" else OUTSIDE_MARGIN["half"]


# Poisson terms more than this many standard deviations from the mode, and this many more
# beyond the window's end, are below exp(-800) of the largest: left out of the sum.
SD_WINDOW = 40
EDGE_TERMS = 2000


def chi2_sf_even(x: float, dof: int) -> float:
    """P(X >= x) for X chi-square with an even ``dof``: exp(-x/2) sum_{k < dof/2}
    (x/2)^k / k!, summed in log space (no scipy on the broker). Only the terms within
    SD_WINDOW standard deviations of the Poisson mode (x/2), and EDGE_TERMS beyond, are
    summed: the rest do not move a float64 sum, and a checker's stated token count (up to
    1,048,576) then costs the broker a few thousand terms, not a term a token."""
    if x <= 0:
        return 1.0
    half, terms = x / 2, dof // 2
    reach = SD_WINDOW * math.sqrt(half) + EDGE_TERMS
    low = max(0, int(min(terms, half) - reach))
    high = min(terms, int(half + reach) + 1)
    if low >= high:
        return 1.0
    logs = [k * math.log(half) - math.lgamma(k + 1) for k in range(low, high)]
    top = max(logs)
    return min(1.0, math.exp(-half + top + math.log(sum(math.exp(v - top) for v in logs))))


def p_values(figures: dict) -> tuple[float, float]:
    """(p of the least u, p of Fisher's statistic) of a row's ``figures``: the chance an
    honest row of that many tokens reaches them, at most."""
    n = int(figures["tokens"])
    least = max(float(figures["least"]), LEAST_U)
    p_least = min(1.0, -math.expm1(n * math.log1p(-least)) if least < 1 else 1.0)
    return p_least, chi2_sf_even(float(figures["fisher"]), 2 * n)


def valid(figures: object) -> bool:
    """Whether ``figures`` (the checker's word) are a row's figures at all."""
    if not isinstance(figures, dict):
        return False
    try:
        n = figures["tokens"]
        values = [float(figures[k]) for k in ("outside", "least", "fisher")]
    except (KeyError, TypeError, ValueError):
        return False
    return (type(n) is int and 0 <= n <= 1_048_576 and all(math.isfinite(v) for v in values)
            and 0 <= values[1] <= 1 and values[2] >= 0)


def judge(figures: object, dtype: str) -> tuple[bool | None, str]:
    """Whether a sampled row's tokens were drawn as its sampling says, by the checker's
    ``figures`` for a job that asked ``dtype``: (True, ""), (False, why), or (None, why)
    where the checker sent none (an old checker: the row is judged by its fingerprints
    alone)."""
    if figures is None:
        return None, "the checker sent no sampling figures"
    if not valid(figures):
        return False, "the checker's sampling figures are not figures"
    if figures["tokens"] == 0:
        return True, ""
    margin = outside_margin(dtype)
    if float(figures["outside"]) > margin:
        return False, (f"a sampled token falls outside the nucleus (top_p): its logit"
                       f" {float(figures['outside']):.2f} standard deviations below the"
                       f" nucleus's edge (at most {margin:g})")
    p_least, p_fisher = p_values(figures)
    if p_least < P_LIMIT:
        return False, (f"a sampled token is one the model finds unlikely (p = {p_least:.1e}"
                       f" over {figures['tokens']} tokens; at least {P_LIMIT:g})")
    if p_fisher < P_LIMIT:
        return False, (f"the sampled tokens are not the model's draws (Fisher p ="
                       f" {p_fisher:.1e}; at least {P_LIMIT:g})")
    return True, ""
