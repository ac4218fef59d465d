"""What a job will need, from its inputs: memory per device and work in FLOPs.

The broker reads the model's config.json from the artifact store (the ``model_config``
input, or the config.json inside a ``base_model`` archive), bounded in size, and sizes the
job with model_size. Plain code, no grpc.
"""

from __future__ import annotations

import json
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpumarket.broker.market import model_size
from gpumarket.kinds import Kind, ParamError
from gpumarket.proto.errors import InvalidArgument
from gpumarket.proto.v1 import types_pb2 as pb

MAX_CONFIG_BYTES = 1 << 20
MAX_MEMBERS = 10_000        # archive entries read to find config.json
MAX_SCAN_S = 2.0            # ... and seconds spent on it


@dataclass(frozen=True)
class JobEstimate:
    memory_bytes: int          # per device; 0 = unknown
    work_flops: float          # 0 = unknown
    params: int


def _config_from_blob(path: Path, archive: bool) -> dict:
    if not archive:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise InvalidArgument("model config: larger than 1 MiB")
        return json.loads(path.read_text())
    with tarfile.open(path, "r:") as tar:
        member = _find_config(tar)
        if member is None or member.size > MAX_CONFIG_BYTES:
            raise InvalidArgument("base_model: no config.json of at most 1 MiB in the archive")
        return json.loads(tar.extractfile(member).read())


def _find_config(tar: tarfile.TarFile) -> tarfile.TarInfo | None:
    """The archive's config.json, looked for among its first MAX_MEMBERS entries and for at
    most MAX_SCAN_S (a stranger's archive may hold millions of entries: the broker reads
    headers, never all of them)."""
    deadline = time.monotonic() + MAX_SCAN_S
    for i, member in enumerate(iter(tar.next, None)):
        if member.name in ("config.json", "./config.json") and member.isfile():
            return member
        if i + 1 >= MAX_MEMBERS or time.monotonic() > deadline:
            raise InvalidArgument(f"model archive: no config.json among its first"
                                  f" {i + 1:,} entries (the broker reads at most"
                                  f" {MAX_MEMBERS:,}; put config.json near the start)")
    return None


def estimate(kind: Kind, values: dict, spec: pb.JobSpec,
             blob_path: Callable[[str], Path]) -> JobEstimate:
    """Size a job by its kind's sizing rule; raise InvalidArgument naming the input if its
    config is unusable. A kind without one (or without a config input) is of unknown size."""
    found = kind.config_input(values)
    rule = SIZING.get(kind.sizing)
    ref = {r.name: r for r in spec.inputs}.get(found[0]) if found else None
    if rule is None or ref is None:
        return JobEstimate(0, 0.0, 0)
    name, archive = found
    field = next(p.name for p in kind.params if values.get(p.name) == name)
    try:
        config = _config_from_blob(blob_path(ref.sha256), archive)
        shape = model_size.shape(config)
    except (OSError, ValueError, tarfile.TarError) as exc:
        raise InvalidArgument(f"{kind.name}.{field}: cannot read a model config ({exc})") from exc
    except InvalidArgument as exc:
        raise InvalidArgument(f"{kind.name}.{field}: {exc.message}") from exc
    try:
        kind.check_config(values, config)
    except ParamError as exc:
        raise InvalidArgument(str(exc)) from exc
    return rule(shape, values)


def _training(shape: model_size.ModelShape, values: dict) -> JobEstimate:
    tokens = values["steps"] * values["batch_size"] * values["seq_len"]
    # The runner keeps fp32 weights (with bf16 autocast on CUDA).
    memory = model_size.training_bytes(shape, "fp32", values["batch_size"], values["seq_len"])
    return JobEstimate(memory, model_size.training_flops(shape, tokens), shape.params)


def _inference(shape: model_size.ModelShape, values: dict) -> JobEstimate:
    """Weights in 16-bit plus a quarter for activations and the KV cache; the work is not
    known without reading the prompts, so it stays 0 (unknown)."""
    return JobEstimate(int(shape.params * 2 * 1.25), 0.0, shape.params)


SIZING = {"training": _training, "inference": _inference}
