"""Embed: one vector per text with an encoder model (mean pooling over the attention mask),
as JSONL or a float32 .npy, resumable per batch."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumarket.kinds.inference import Inference, model_params
from gpumarket.kinds.schema import Param, ParamError
from gpumarket.proto.v1 import types_pb2 as pb


class Embed(Inference):
    def rules(self, values: dict[str, Any]) -> None:
        super().rules(values)
        if values["engine"] == "vllm":
            raise ParamError("embed.engine", "embed jobs run on transformers")

    # A replay's vectors are compared with the provider's within what honest replays were
    # measured to differ by (bench/embed_spread.py; docs/verification.md), per vector: in
    # all (distance) and in any one element, so a change can neither spread thin over every
    # element nor hide in one. The .npy format is not checked.
    output = "embeddings.jsonl"
    count_metric = "texts"
    agreement = "within the embed tolerance of the replay's precision"

    def evidence(self, names: set[str]) -> set[str]:
        return names & {"embeddings.jsonl"}

    def row_rule(self, got: dict[str, Path], scope: dict
                 ) -> Callable[[dict, dict], tuple[bool, str]]:
        tol = tolerance(replay_float_bits(got.get("metrics.json")))
        return lambda want, have: same_vector(want.get("embedding"), have.get("embedding"),
                                              tol)

    def same_row(self, want: dict, have: dict) -> tuple[bool, str]:
        return same_vector(want.get("embedding"), have.get("embedding"), HALF)


@dataclass(frozen=True)
class Tolerance:
    """How far an honest replay's vector may be from the provider's, relative to the larger
    norm of the two: in all (``rel_l2``: the distance) and in any one element (``rel_max``)."""

    rel_l2: float
    rel_max: float


# From bench/embed_spread.py (MiniLM, the embed runner, 96 texts, this 2-core CPU): float32
# replays at batch 1, 8 and 32 and 1 or 2 threads differ by at most 8.8e-7 (distance) and
# 1.3e-7 (one element) of the norm; bfloat16 ones by 9.2e-3 and 2.0e-3, and bfloat16 from
# float32 by 1.4e-2 and 3.1e-3. A vector at cosine c from the true one is sqrt(2(1 - c)) of
# the norm away: 0.032 at cosine 0.9995, 0.045 at 0.999.
FLOAT32 = Tolerance(rel_l2=1e-3, rel_max=1e-4)   # ~1,100x and ~760x the measured spread
HALF = Tolerance(rel_l2=2e-2, rel_max=5e-3)      # ~2.2x and ~2.6x: bfloat16 and float16


def tolerance(float_bits: int) -> Tolerance:
    """The tolerance for a replay that computed in ``float_bits``-bit floats (anything but
    32, or unknown, gets the half-precision one)."""
    return FLOAT32 if float_bits == 32 else HALF


def replay_float_bits(metrics: Path | None) -> int:
    """The float width the replay's runner says it computed in (its metrics.json
    ``float_bits``), 0 if it says none. The checker's word, not the checked provider's: a
    checked provider cannot loosen its own check, and a checker that lied could as well
    return the provider's vectors."""
    if metrics is None:
        return 0
    try:
        bits = json.loads(Path(metrics).read_text()).get("float_bits")
    except (OSError, ValueError, AttributeError):
        return 0
    return int(bits) if type(bits) in (int, float) and bits in (16, 32) else 0


def same_vector(a: Any, b: Any, tol: Tolerance) -> tuple[bool, str]:
    """Whether vector ``b`` (the replay's) is ``a`` (the provider's) within ``tol``:
    (agrees, where they differ)."""
    if not (isinstance(a, list) and isinstance(b, list)) or len(a) != len(b) or not a:
        return False, "the vectors differ in length"
    if not all(type(x) is float and math.isfinite(x) for x in (*a, *b)):
        return False, "a vector holds something that is not a finite number"
    try:
        norm = max(math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b)))
        distance = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))
        element = max(abs(x - y) for x, y in zip(a, b))
    except OverflowError:
        return False, "the vectors cannot be compared"
    if norm == 0:
        return True, ""
    if not distance / norm <= tol.rel_l2:
        return False, (f"the vectors are {distance / norm:.1e} of their norm apart (at most"
                       f" {tol.rel_l2:.0e})")
    if not element / norm <= tol.rel_max:
        return False, (f"an element differs by {element / norm:.1e} of the norm (at most"
                       f" {tol.rel_max:.0e})")
    return True, ""


KIND = Embed(
    name="embed", number=pb.JOB_KIND_EMBED, proto_field="embed",
    runner="gpumarket.provider.runners.embed", sizing="inference", verify="rows",
    checkpoints=True,
    params=model_params() + (
        Param("texts", "file", required=True, input_name="texts.jsonl",
              doc='JSONL, one {"text": ...} object per line'),
        Param("batch_size", "int", max=65_536, doc="0 = 32"),
        Param("output_format", "str", choices=("", "jsonl", "npy")),
        Param("keep_scale", "bool", file_name="normalize", from_file=lambda v: not v,
              doc="job file: normalize = false keeps the vectors' scale"),
    ),
)
