"""Training: a causal language model trained with torch from a transformers config (from
scratch) or a model directory (fine-tuning) on a JSONL of texts; resumable from checkpoints
of model, optimizer, scheduler, RNG and data position."""

from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path
from typing import Any

from gpumarket.kinds.base import Kind
from gpumarket.kinds.output_compare import sha256_file
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
    # same device class and software): the checkpoint's files, or at the end every file it
    # delivered — bitwise, but for the few whose bytes legitimately differ between honest
    # runs, compared by what they say (``BY_MEANING``). A file only one side has differs.
    def evidence(self, names: set[str]) -> set[str]:
        return set(names)

    def compare(self, expect: dict[str, Path], got: dict[str, Path], scope: dict
                ) -> tuple[bool, str]:
        if "checkpoint.tar" in expect:
            want = _tar_hashes(expect["checkpoint.tar"])
        else:
            want = {name: _meaning(name, path) for name, path in expect.items()}
        if not want:
            return False, "nothing to compare"
        for name in sorted(want):
            if name not in got:
                return False, f"the replay returned no {name}"
            if _meaning(name, got[name]) != want[name]:
                return False, f"{name} differs"
        if "checkpoint.tar" not in expect and (extra := sorted(set(got) - set(want))):
            return False, f"the checked result has no {', '.join(extra)[:200]}"
        return True, f"{', '.join(sorted(want))} identical"


def _config(path: Path) -> str:
    """A transformers config as its settings, without the version of the library that
    wrote it (two honest providers may run different transformers releases)."""
    import json

    settings = json.loads(path.read_text())
    if isinstance(settings, dict):
        settings.pop("transformers_version", None)
    return json.dumps(settings, sort_keys=True)


def _metrics(path: Path) -> str:
    """The run's figures that are results (its final loss, its steps), not timings."""
    import json

    figures = json.loads(path.read_text())
    if not isinstance(figures, dict):
        raise ValueError("metrics.json is not an object")
    return json.dumps({k: figures.get(k) for k in ("final_loss", "steps")}, sort_keys=True)


# Delivered files compared by what they say rather than byte for byte; every other file of a
# training result (weights, loss curve, anything else) is compared by its sha256.
BY_MEANING = {"config.json": _config, "generation_config.json": _config,
              "metrics.json": _metrics}


def _meaning(name: str, path: Path) -> str:
    rule = BY_MEANING.get(name)
    return rule(path) if rule else sha256_file(path)


CHECKPOINT_FILES = ("model.safetensors", "state.safetensors", "state.json")


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
    checkpoints=True,
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
