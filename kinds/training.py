"""Training: a causal language model trained with torch from a transformers config (from
scratch) or a model directory (fine-tuning) on a JSONL of texts; resumable from checkpoints
of model, optimizer, scheduler, RNG and data position."""

from __future__ import annotations

from typing import Any

from gpumarket.kinds.base import Kind
from gpumarket.kinds.schema import UINT32, Param, ParamError
from gpumarket.proto.v1 import types_pb2 as pb


class Training(Kind):
    def rules(self, values: dict[str, Any]) -> None:
        if bool(values["model_config"]) == bool(values["base_model"]):
            raise ParamError("training", "give exactly one of model_config or base_model")
        if values["warmup_steps"] > values["steps"]:
            raise ParamError("training.warmup_steps", "more than training.steps")

    def config_input(self, values: dict[str, Any]) -> tuple[str, bool] | None:
        name = values["model_config"] or values["base_model"]
        return (name, bool(values["base_model"])) if name else None


KIND = Training(
    name="training", number=pb.JOB_KIND_TRAINING, proto_field="training",
    runner="gpumarket.provider.runners.training", warm=True, sizing="training",
    params=(
        Param("model_config", "file", input_name="model_config.json",
              doc="a transformers config.json: train from scratch"),
        Param("base_model", "file_or_dir", input_name="base_model.tar",
              doc="a model directory (or its tar): fine-tune it"),
        Param("dataset", "file", required=True, input_name="dataset.jsonl",
              doc='JSONL, one {"text": ...} object per line'),
        Param("steps", "int", required=True, min=1, max=10_000_000),
        Param("batch_size", "int", required=True, min=1, max=65_536),
        Param("seq_len", "int", required=True, min=2, max=1_048_576),
        Param("learning_rate", "float", required=True, above=0, below=10),
        Param("seed", "int", default=0),
        Param("warmup_steps", "int", max=UINT32),
        Param("checkpoint_every", "int", max=UINT32,
              doc="steps between checkpoints; 0 = the broker decides"),
    ),
)
