"""Embed: one vector per text with an encoder model (mean pooling over the attention mask),
as JSONL or a float32 .npy, resumable per batch."""

from __future__ import annotations

from typing import Any

from gpumarket.kinds.inference import Inference, model_params
from gpumarket.kinds.schema import Param, ParamError
from gpumarket.proto.v1 import types_pb2 as pb


class Embed(Inference):
    def rules(self, values: dict[str, Any]) -> None:
        super().rules(values)
        if values["engine"] == "vllm":
            raise ParamError("embed.engine", "embed jobs run on transformers")


KIND = Embed(
    name="embed", number=pb.JOB_KIND_EMBED, proto_field="embed",
    runner="gpumarket.provider.runners.embed", sizing="inference",
    params=model_params() + (
        Param("texts", "file", required=True, input_name="texts.jsonl",
              doc='JSONL, one {"text": ...} object per line'),
        Param("batch_size", "int", max=65_536, doc="0 = 32"),
        Param("output_format", "str", choices=("", "jsonl", "npy")),
        Param("keep_scale", "bool", file_name="normalize", from_file=lambda v: not v,
              doc="job file: normalize = false keeps the vectors' scale"),
    ),
)
