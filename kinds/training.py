"""Training: a causal language model trained with torch from a transformers config (from
scratch) or a model directory (fine-tuning) on a JSONL of texts; resumable from checkpoints
of model, optimizer, scheduler, RNG and data position."""

from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path
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

    # A replayed segment must reproduce the state bit for bit (exact resume gives that on the
    # same device class and software): the checkpoint's files, or at the end the weights and
    # the loss curve. Timings (metrics.json) differ and are not compared.
    def evidence(self, names: set[str]) -> set[str]:
        return names & (FINAL_EVIDENCE | set(CHECKPOINT_FILES))

    def compare(self, expect: dict[str, Path], got: dict[str, Path], scope: dict
                ) -> tuple[bool, str]:
        if "checkpoint.tar" in expect:
            want = _tar_hashes(expect["checkpoint.tar"])
        else:
            want = {name: _sha256(path) for name, path in expect.items()}
        if not want:
            return False, "nothing to compare"
        for name in sorted(want):
            if name not in got:
                return False, f"the replay returned no {name}"
            if _sha256(got[name]) != want[name]:
                return False, f"{name} differs"
        return True, f"{', '.join(sorted(want))} identical"


FINAL_EVIDENCE = {"model.safetensors", "loss.jsonl"}
CHECKPOINT_FILES = ("model.safetensors", "state.safetensors", "state.json")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _tar_hashes(path: Path) -> dict[str, str]:
    """sha256 of each checkpoint file in a checkpoint tar (checkpoints.pack's layout)."""
    out = {}
    limit = Path(path).stat().st_size
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar.getmembers():
                if member.issparse() or member.size > limit:
                    return {}     # not what checkpoints.pack writes: compares as nothing
                if member.name in CHECKPOINT_FILES and member.isfile():
                    h, f = hashlib.sha256(), tar.extractfile(member)
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
                    out[member.name] = h.hexdigest()
    except tarfile.TarError:
        return {}
    return out


KIND = Training(
    name="training", number=pb.JOB_KIND_TRAINING, proto_field="training",
    runner="gpumarket.provider.runners.training", warm=True, sizing="training", verify="replay",
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
