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

from gpumarket.broker import model_size
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


def estimate(spec: pb.JobSpec, blob_path: Callable[[str], Path]) -> JobEstimate:
    """Size a job; raise InvalidArgument naming the input if its config is unusable."""
    if spec.WhichOneof("params") in ("generate", "embed"):
        return _inference_estimate(spec, blob_path)
    t = spec.training
    refs = {r.name: r for r in spec.inputs}
    name = t.model_config or t.base_model
    ref = refs.get(name)
    if ref is None:
        return JobEstimate(0, 0.0, 0)
    try:
        cfg = _config_from_blob(blob_path(ref.sha256), archive=bool(t.base_model))
        shape = model_size.shape(cfg)
    except (OSError, ValueError, tarfile.TarError) as exc:
        raise InvalidArgument(f"training.{'base_model' if t.base_model else 'model_config'}:"
                              f" cannot read a model config ({exc})") from exc
    except InvalidArgument as exc:
        raise InvalidArgument(f"training: {exc.message}") from exc
    tokens = t.steps * t.batch_size * t.seq_len
    # The runner keeps fp32 weights (with bf16 autocast on CUDA).
    memory = model_size.training_bytes(shape, "fp32", t.batch_size, t.seq_len)
    return JobEstimate(memory, model_size.training_flops(shape, tokens), shape.params)


def _inference_estimate(spec: pb.JobSpec, blob_path: Callable[[str], Path]) -> JobEstimate:
    """Weights in 16-bit plus a quarter for activations and the KV cache; the work is not
    known without reading the prompts, so it stays 0 (unknown)."""
    field = spec.WhichOneof("params")
    ref = {r.name: r for r in spec.inputs}.get(getattr(spec, field).model)
    if ref is None:
        return JobEstimate(0, 0.0, 0)
    try:
        shape = model_size.shape(_config_from_blob(blob_path(ref.sha256), archive=True))
    except (OSError, ValueError, tarfile.TarError) as exc:
        raise InvalidArgument(f"{field}.model: cannot read a model config ({exc})") from exc
    except InvalidArgument as exc:
        raise InvalidArgument(f"{field}.model: {exc.message}") from exc
    return JobEstimate(int(shape.params * 2 * 1.25), 0.0, shape.params)
