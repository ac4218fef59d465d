"""Embed: one vector per text with an encoder model (mean pooling over the attention mask),
as JSONL or a float32 .npy, resumable per batch."""

from __future__ import annotations

import math
from typing import Any

from gpumarket.kinds.inference import Inference, model_params
from gpumarket.kinds.schema import Param, ParamError
from gpumarket.proto.v1 import types_pb2 as pb

COSINE_MIN = 0.999


class Embed(Inference):
    def rules(self, values: dict[str, Any]) -> None:
        super().rules(values)
        if values["engine"] == "vllm":
            raise ParamError("embed.engine", "embed jobs run on transformers")

    # Vectors of the same batch agree to float rounding; a wrong model or random vectors are
    # far off (unrelated unit vectors have a cosine near 0). The .npy format is not checked.
    count_metric = "texts"
    agreement = f"cosine >= {COSINE_MIN}"

    def evidence(self, names: set[str]) -> set[str]:
        return names & {"embeddings.jsonl"}

    def same_row(self, want: dict, have: dict) -> tuple[bool, str]:
        a, b = want.get("embedding"), have.get("embedding")
        if not (isinstance(a, list) and isinstance(b, list)) or len(a) != len(b) or not a:
            return False, "the vectors differ in length"
        if not all(type(x) is float and math.isfinite(x) for x in (*a, *b)):
            return False, "a vector holds something that is not a finite number"
        try:
            dot = sum(x * y for x, y in zip(a, b))
            norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
            cosine = dot / norm if norm > 0 else 0.0
        except (OverflowError, ZeroDivisionError):
            return False, "the vectors cannot be compared"
        if not cosine >= COSINE_MIN:
            return False, f"cosine {cosine:.4f} < {COSINE_MIN}"
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
