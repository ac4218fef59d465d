"""What the generate and embed runners share: the model directory, the JSONL input, results
kept per batch so a resumed job skips what is done, checkpoints of those results, figures.

A job's items are cut into fixed batches in input order (the batch size is kept in the
checkpoint, so a resumed attempt cuts them the same way and a seeded sampler draws the same
numbers for the same batch). After each batch its results are appended to ``results.jsonl``;
a checkpoint is a copy of that file. The final output is written in input order at the end.
"""

from __future__ import annotations

import json
import shutil
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from gpumarket.provider.runners.base import (  # noqa: F401 (run_main: the runners' import)
    Cadence, JobError, publish_checkpoint, run_main,
)
from gpumarket.provider.runners.report import Reporter

if TYPE_CHECKING:
    from gpumarket.kinds.runner_job import RunnerJob

RESULTS = "results.jsonl"
SAY_EVERY_S = 2.0


def unpack_model(job: RunnerJob, field: str, workdir: Path) -> Path:
    """Unpack the model archive named by params[field] into the work dir (safe extraction:
    no paths outside it, no links); or, for a job naming a model the provider holds, that
    model's directory."""
    if job.params.get(f"{field}_name"):
        local = Path(job.model_dir or "")
        if not (local / "config.json").is_file():
            raise JobError(f"{field}_name: this provider has no model"
                           f" {job.params[f'{field}_name']!r}")
        return local
    archive = job.inputs.get(job.params.get(field, ""))
    if not archive:
        raise JobError(f"{field}: no model archive among the job's inputs")
    target = workdir / "model"
    if target.exists():
        shutil.rmtree(target)
    target.mkdir()
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(target, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise JobError(f"{field}: not a readable model archive ({exc})") from exc
    if not (target / "config.json").exists():
        raise JobError(f"{field}: the archive has no config.json at its top level")
    return target


def read_items(path: str, key: str, what: str) -> list[str]:
    """The string field ``key`` of every JSONL line (blank lines skipped)."""
    items = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise JobError(f"{what} line {lineno}: not JSON") from exc
            value = record.get(key) if isinstance(record, dict) else None
            if not isinstance(value, str):
                raise JobError(f"{what} line {lineno}: needs a string field \"{key}\"")
            items.append(value)
    if not items:
        raise JobError(f"{what}: no items")
    return items


def percentiles(values: list[float], name: str) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {f"{name}_p50": at(0.50), f"{name}_p95": at(0.95), f"{name}_p99": at(0.99)}


class Results:
    """Results by item index, appended per batch to ``results.jsonl`` and checkpointed."""

    def __init__(self, workdir: Path, job: RunnerJob, total: int, batch_size: int,
                 report: Reporter) -> None:
        self.workdir, self.total, self.report = workdir, total, report
        self.path = workdir / RESULTS
        self.done: dict[int, dict] = {}
        self.figures: dict[str, float] = {}  # what the engine chose, for the job's metrics
        # A check redoes one batch of rows, as the checked provider batched them: the batch
        # at ``check_position`` among those from row ``check_from_row`` on.
        self.batch_size = job.check_batch_size or batch_size
        self.only: set[int] = set()
        if job.check_batch_size:
            b = self.batch_size
            first, count = -(-job.check_from_row // b), -(-total // b)
            pick = min(count - 1, first + int(job.check_position * max(1, count - first)))
            self.only = set(range(max(0, pick) * b, min(total, (max(0, pick) + 1) * b)))
        resume = job.resume_from
        if resume:
            meta = json.loads((Path(resume) / "state.json").read_text())
            self.batch_size = int(meta["batch_size"])
            shutil.copyfile(Path(resume) / RESULTS, self.path)
        elif self.path.exists():
            self.path.unlink()
        if self.path.exists():
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    record = json.loads(line)
                    self.done[record["index"]] = record
        self.resumed_from = len(self.done)
        self._said = 0.0
        if self.resumed_from:
            report.send("resumed", step=self.resumed_from)
            print(f"resuming: {self.resumed_from} of {total} items already done", flush=True)
        self.cadence = Cadence.for_job(job)

    def say(self, text: str) -> None:
        """A progress line for the job's log: at most one every SAY_EVERY_S, and the last
        (a line per batch of a fast model is thousands of lines for the broker to keep)."""
        now = time.monotonic()
        if now - self._said >= SAY_EVERY_S or len(self.done) >= self.total:
            self._said = now
            print(text, flush=True)

    def batches(self) -> Iterator[list[int]]:
        """The batches not done yet, each a list of item indices in input order."""
        if self.only:
            batch = sorted(i for i in self.only if 0 <= i < self.total)
            if batch and not all(i in self.done for i in batch):
                yield batch
            return
        for start in range(0, self.total, self.batch_size):
            batch = list(range(start, min(start + self.batch_size, self.total)))
            if not all(i in self.done for i in batch):
                yield batch

    def add(self, records: list[dict], **metrics: float) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
                self.done[record["index"]] = record
            # no fsync here: this working copy only feeds checkpoints, which are fsynced
        step = len(self.done)
        self.report.progress(step, self.total, **metrics)
        if step < self.total and self.cadence.due(step):
            self.checkpoint(step)

    def checkpoint(self, step: int) -> None:
        began = time.perf_counter()

        def write(tmp: Path) -> None:
            shutil.copyfile(self.path, tmp / RESULTS)
            (tmp / "state.json").write_text(json.dumps({"step": step,
                                                        "batch_size": self.batch_size}))

        final = publish_checkpoint(self.workdir / "checkpoints", step, write)
        took = time.perf_counter() - began
        self.cadence.written(took)
        self.report.checkpoint(step, str(final.relative_to(self.workdir)), took)

    def in_order(self) -> list[dict]:
        wanted = sorted(i for i in self.only if 0 <= i < self.total) if self.only \
            else range(self.total)
        missing = [i for i in wanted if i not in self.done]
        if missing:
            raise JobError(f"{len(missing)} items have no result (first: {missing[0]})")
        return [self.done[i] for i in wanted]


def torch_device(job: RunnerJob):
    import torch

    return torch.device("cuda" if job.device == "cuda" and torch.cuda.is_available()
                        else "cpu")


def torch_dtype(name: str, device):
    import torch

    if name in ("", "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise JobError(f"dtype {name!r} is not one of auto, {', '.join(table)}")
    return table[name]


# -- what the engines choose on the device they run on ------------------------------------
#
# On CUDA the choices below are made at run time, by measurement where one is cheap, and
# recorded in the job's log and metrics; on the CPU each keeps the path measured there
# (docs/provider.md, "Engines on a GPU": what was measured on which device, and what is
# still to be measured on a GPU).

CUDA_BUCKET = 64  # tokens: prompts padded to a multiple of this on CUDA (fewer new shapes)
MEMORY_SHARE = 0.5  # of the device's free memory, for the KV cache of a batch
ATTENTION_PROBES = 3  # sequence lengths never seen, timed per SDPA setting


def bucket(device) -> int | None:
    """The multiple prompt lengths are padded to: CUDA_BUCKET on CUDA (each new shape costs
    the first call of every kernel that is tuned or planned per shape: 70-95 ms a decode step
    with cuDNN's attention on an H100, issue 31); None on the CPU, where it adds work and no
    per-shape cost was measured."""
    return CUDA_BUCKET if device.type == "cuda" else None


def kv_bytes_per_token(config, dtype) -> int:
    """Bytes one token's keys and values take over every layer of a decoder of ``config``
    (its text config for a multimodal one) in ``dtype``."""
    import torch

    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(cfg, "num_hidden_layers", None) or 32
    heads = getattr(cfg, "num_attention_heads", None) or 32
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def free_memory(device) -> int | None:
    """Bytes free on a CUDA ``device`` now; None on the CPU (its batch sizes are measured
    defaults, not derived from memory)."""
    if device.type != "cuda":
        return None
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def batch_for_memory(free_bytes: int, per_sequence_bytes: int, cap: int) -> int:
    """How many sequences of ``per_sequence_bytes`` fit in MEMORY_SHARE of ``free_bytes``:
    at least 1, at most ``cap``."""
    fits = int(free_bytes * MEMORY_SHARE) // max(1, per_sequence_bytes)
    return max(1, min(cap, fits))


def choose_attention(model, device, batch: int) -> dict[str, float]:
    """On CUDA, choose by measurement whether SDPA may use cuDNN's kernel: time one decode
    step's attention (this model's heads and head size, ``batch`` rows, a padding mask as
    transformers passes one) on ATTENTION_PROBES sequence lengths never seen before, each
    setting on lengths of its own, first call included; cuDNN stays off unless it measured
    faster (flash and memory-efficient kernels have no per-shape plan). Sets torch's global
    switch for this process and returns the figures for the job's metrics:
    ``cudnn_sdpa`` (1 on, 0 off) and each setting's milliseconds per new length. Returns
    {} on the CPU or where this torch has no such switch."""
    import torch

    if device.type != "cuda" or not hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        return {}
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    heads = getattr(cfg, "num_attention_heads", None) or 16
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dtype = next(model.parameters()).dtype
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = max(1, min(batch, 256))

    def per_new_length(first_length: int) -> float:
        total = 0.0
        for i in range(ATTENTION_PROBES):
            length = first_length + 7 * i
            q = torch.randn(rows, heads, 1, head_dim, device=device, dtype=dtype)
            k = torch.randn(rows, heads, length, head_dim, device=device, dtype=dtype)
            mask = torch.ones(rows, 1, 1, length, device=device, dtype=torch.bool)
            mask[0, :, :, 0] = False                       # left padding in one row
            torch.cuda.synchronize(device)
            began = time.perf_counter()
            sdpa(q, k, k, attn_mask=mask)
            torch.cuda.synchronize(device)
            total += time.perf_counter() - began
        return total / ATTENTION_PROBES * 1000

    def setting(cudnn: bool, first_length: int) -> float:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        q = torch.randn(rows, heads, 1, head_dim, device=device, dtype=dtype)
        k = torch.randn(rows, heads, 64, head_dim, device=device, dtype=dtype)
        sdpa(q, k, k, attn_mask=torch.ones(rows, 1, 1, 64, device=device, dtype=torch.bool))
        return per_new_length(first_length)  # after the setting's one-time start-up

    with_cudnn = setting(True, 101)
    without = setting(False, 211)
    use_cudnn = with_cudnn < without
    torch.backends.cuda.enable_cudnn_sdp(use_cudnn)
    return {"cudnn_sdpa": float(use_cudnn), "attention_probe_cudnn_ms": with_cudnn,
            "attention_probe_no_cudnn_ms": without}


def attention_words(model, choice: dict[str, float]) -> str:
    """The attention an engine runs, in words for its log."""
    name = getattr(model.config, "_attn_implementation", None) or "default"
    if not choice:
        return name
    return (f"{name}, cuDNN SDPA {'on' if choice['cudnn_sdpa'] else 'off'} (a new sequence"
            f" length cost {choice['attention_probe_cudnn_ms']:.1f} ms with it,"
            f" {choice['attention_probe_no_cudnn_ms']:.1f} ms without)")
