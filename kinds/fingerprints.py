"""Activation fingerprints of generated text (TOPLOC's idea, docs/verification.md): while it
generates, a provider keeps, every EVERY generated tokens (and at its last one), the top-k
entries by magnitude of the last hidden state (the output embedding's input) at the position
that produced that token: their indices and values rounded to float16. A checker runs ONE
prefill pass of the prompt plus the provider's tokens, takes the same entries, and compares
them within tolerances measured from honest replays (bench/fingerprint_spread.py).

Plain Python (struct, base64): the broker compares without torch. No grpc here.
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from dataclasses import dataclass

EVERY = 32            # generated tokens per fingerprint (TOPLOC's chunk)
K_MAX = 128           # entries of a fingerprint (TOPLOC's k)
MAX_INDEX = 0xFFFF    # indices are stored as uint16: hidden sizes up to 65,535
HALF_MAX = 65504.0    # the largest float16
MAX_TEXT = 4 * (4 * K_MAX) // 3 + 8   # characters of one encoded fingerprint, at most


def k_for(hidden_size: int) -> int:
    """How many entries a fingerprint of a ``hidden_size``-wide state keeps: K_MAX, or a
    quarter of the state on a model narrower than 4 x K_MAX. A top-k that holds most of the
    vector says nothing by which entries it picked (every model's top-48 of 64 overlap
    mostly); a quarter keeps the choice selective (measured: bench/fingerprint_spread.py)."""
    return max(1, min(K_MAX, hidden_size // 4))


def positions(generated: int) -> list[int]:
    """The generated tokens (0-based) whose producing hidden state is fingerprinted: the last
    of every EVERY, and the last one."""
    if generated <= 0:
        return []
    return sorted({*range(EVERY - 1, generated, EVERY), generated - 1})


def encode(indices: list[int], values: list[float]) -> str:
    """One fingerprint as text: uint16 indices then float16 values, little-endian, base64
    (4 bytes an entry: 512 bytes at k = 128). Values past float16's range are clamped."""
    k = len(indices)
    clamped = [min(HALF_MAX, max(-HALF_MAX, v)) if math.isfinite(v) else 0.0 for v in values]
    return base64.b64encode(struct.pack(f"<{k}H{k}e", *indices, *clamped)).decode()


class FingerprintError(ValueError):
    """A fingerprint that is not one (wrong size, repeated indices, a value not finite)."""


def decode(text: object) -> tuple[list[int], list[float]]:
    """(indices, values) of an encoded fingerprint. Raises FingerprintError."""
    if not isinstance(text, str) or len(text) > MAX_TEXT:
        raise FingerprintError("not a fingerprint")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise FingerprintError("not base64") from exc
    if not raw or len(raw) % 4 or len(raw) // 4 > K_MAX:
        raise FingerprintError(f"{len(raw)} bytes is not a fingerprint")
    k = len(raw) // 4
    fields = struct.unpack(f"<{k}H{k}e", raw)
    indices, values = list(fields[:k]), list(fields[k:])
    if len(set(indices)) != k:
        raise FingerprintError("an index repeats")
    if not all(math.isfinite(v) for v in values):
        raise FingerprintError("a value is not finite")
    return indices, values


@dataclass(frozen=True)
class Tolerance:
    """How far an honest replay's fingerprint may be from the provider's: the share of the
    top-k indices both hold (at least ``overlap``), and on those, the mean and the largest
    difference of a value, relative to the mean and the largest magnitude of the replay's
    values (at most ``mean_err`` and ``max_err``)."""

    overlap: float
    mean_err: float
    max_err: float


# From bench/fingerprint_spread.py (docs/verification.md has the table): the tests' tiny Llama
# (hidden 64) and a wider random one (512), generated at batch 1, 4 and 8 on 1 or 2 threads
# in float32 or bfloat16, checked by a prefill at another batch size, thread count or dtype
# on this 2-core CPU. Float32 against float32 differed by at most 4.6e-6 (mean) and 3.3e-4
# (max: one float16 rounding step); anything with bfloat16 in it by 5.4e-3 and 1.7e-2, with
# 94 % of the indices shared (one of 16). A float32 model's weights rounded to bfloat16 and
# run as float32: every row at least 1.2e-3 (mean). Another random init: at most 38 % shared.
FLOAT32 = Tolerance(overlap=0.90, mean_err=3e-4, max_err=2e-3)
HALF = Tolerance(overlap=0.75, mean_err=2e-2, max_err=6e-2)


def tolerance(dtype: str) -> Tolerance:
    """The tolerance for a job that asked for ``dtype``: FLOAT32 only where it asked for
    float32 (a provider may run "auto" in bfloat16 on a GPU, honestly); HALF otherwise."""
    return FLOAT32 if dtype == "float32" else HALF


def difference(want: tuple[list[int], list[float]], have: tuple[list[int], list[float]]
               ) -> tuple[float, float, float]:
    """(overlap, mean_err, max_err) of the provider's fingerprint ``want`` against the
    replay's ``have`` (see Tolerance)."""
    a = dict(zip(*want))
    b = dict(zip(*have))
    common = [i for i in b if i in a]
    overlap = len(common) / max(len(a), len(b))
    if not common:
        return overlap, math.inf, math.inf
    errors = [abs(a[i] - b[i]) for i in common]
    mags = [abs(b[i]) for i in common]
    scale_mean = sum(mags) / len(mags)
    scale_max = max(abs(v) for v in b.values())
    if scale_max == 0:
        return overlap, (0.0 if max(errors) == 0 else math.inf), \
            (0.0 if max(errors) == 0 else math.inf)
    return (overlap, (sum(errors) / len(errors)) / max(scale_mean, 1e-30),
            max(errors) / scale_max)


def same_fingerprints(want: object, have: object, tol: Tolerance) -> tuple[bool, str]:
    """Whether the replay's fingerprints of a row (``have``: a list of encoded ones) are the
    provider's (``want``) within ``tol``: (agrees, where they differ)."""
    if not isinstance(want, list) or not isinstance(have, list):
        return False, "no fingerprints"
    if len(want) != len(have):
        return False, f"{len(want)} fingerprints where the replay made {len(have)}"
    for n, (w, h) in enumerate(zip(want, have)):
        try:
            overlap, mean_err, max_err = difference(decode(w), decode(h))
        except FingerprintError as exc:
            return False, f"fingerprint {n}: {exc}"
        if not overlap >= tol.overlap:
            return False, (f"fingerprint {n}: {overlap:.0%} of the top entries shared (at"
                           f" least {tol.overlap:.0%})")
        if not mean_err <= tol.mean_err:
            return False, (f"fingerprint {n}: values differ by {mean_err:.1e} on average (at"
                           f" most {tol.mean_err:.0e})")
        if not max_err <= tol.max_err:
            return False, (f"fingerprint {n}: a value differs by {max_err:.1e} of the largest"
                           f" (at most {tol.max_err:.0e})")
    return True, ""


# A greedy provider's token must be its replay's top token up to rounding: the replay's logit
# of it within TOKEN_GAP standard deviations (of that position's logits) of the replay's top
# logit. Measured (bench/fingerprint_spread.py): 0 float32 against float32, at most 0.037
# with bfloat16 on either side; one altered token of a row, at least 1.7.
TOKEN_GAP = {"float32": 0.05, "half": 0.25}


def token_gap_limit(dtype: str) -> float:
    return TOKEN_GAP["float32"] if dtype == "float32" else TOKEN_GAP["half"]
