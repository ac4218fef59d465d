"""Train a causal language model with torch on a JSONL text dataset.

    python -m gpumarket.provider.runners.training WORKDIR

Reads WORKDIR/job.json (written by the daemon), trains with byte-level tokens
(ids 0-255, so any config with vocab_size >= 256 works), checkpoints every
``checkpoint_every`` steps, and writes the final weights (safetensors), the
config and the loss curve to WORKDIR/outputs.
"""

from __future__ import annotations

from gpumarket.provider.runners.base import listen_for_drain, read_job

listen_for_drain()

import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from gpumarket.provider.runners import checkpoint  # noqa: E402
from gpumarket.provider.runners.base import (  # noqa: E402, F401 (JobError, Cadence: re-exported)
    Cadence, JobError, drain_requested, run_main,
)
from gpumarket.provider.runners.distributed import World  # noqa: E402
from gpumarket.provider.runners.report import Reporter  # noqa: E402

if TYPE_CHECKING:
    from gpumarket.kinds.runner_job import RunnerJob


def load_tokens(path: Path, seq_len: int) -> torch.Tensor:
    chunks = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise JobError(f"dataset line {lineno}: not JSON") from exc
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise JobError(f"dataset line {lineno}: needs a string field \"text\"")
            chunks.append(text.encode("utf-8") + b"\n")
    data = b"".join(chunks)
    if len(data) <= seq_len + 1:
        raise JobError(f"dataset has {len(data)} bytes; needs more than seq_len + 1 ({seq_len + 1})")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batch_for(tokens: torch.Tensor, step: int, seed: int, batch: int, seq_len: int) -> torch.Tensor:
    """The batch of ``step``: a function of (seed, step) alone, so the data position
    is the step number and a resumed run sees the same batches."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - seq_len, (batch,), generator=g)
    return torch.stack([tokens[s: s + seq_len] for s in starts.tolist()])


def build_model(job: RunnerJob, workdir: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    params = job.params
    inputs = job.inputs
    if params.get("base_model"):
        target = workdir / "base_model"
        target.mkdir(exist_ok=True)
        try:
            with tarfile.open(inputs[params["base_model"]]) as tar:
                tar.extractall(target, filter="data")
        except (tarfile.TarError, OSError) as exc:
            raise JobError(f"base_model: not a readable model archive ({exc})") from exc
        try:
            model = AutoModelForCausalLM.from_pretrained(
                target, local_files_only=True, trust_remote_code=False, use_safetensors=True)
        except (OSError, ValueError) as exc:
            raise JobError(f"base_model: cannot load ({str(exc).splitlines()[0]})") from exc
    else:
        try:
            raw = json.loads(Path(inputs[params["model_config"]]).read_text())
            model_type = raw.pop("model_type")
            config = AutoConfig.for_model(model_type, **raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise JobError(f"model_config: not a usable transformers config ({exc})") from exc
        model = AutoModelForCausalLM.from_config(config)
    if model.config.vocab_size < 256:
        raise JobError(f"model vocab_size is {model.config.vocab_size}; byte tokens need >= 256")
    return model


def lr_lambda(warmup: int, total: int):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def deterministic_cuda() -> None:
    """What exact resume needs on CUDA, before the first CUDA op: cuBLAS with a fixed
    workspace (else torch's deterministic mode cannot make its matmuls repeatable, and says
    so), and cuDNN choosing the same deterministic kernels every run instead of the fastest
    it benchmarks. The CPU path needs none of it."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def train(workdir: Path, report: Reporter) -> None:
    job = read_job(workdir)
    p = job.params
    seed, steps, batch, seq_len = int(p["seed"]), int(p["steps"]), int(p["batch_size"]), int(p["seq_len"])
    cadence = Cadence.for_job(job)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    world = World(job.world_size,
                  job.device == "cuda" and torch.cuda.is_available())
    if world.cuda:
        deterministic_cuda()
    torch.use_deterministic_algorithms(True, warn_only=True)
    if batch % world.size:
        raise JobError(f"batch_size {batch} does not split evenly over {world.size} devices")
    device = world.device()
    world.start(workdir, "gpumarket.provider.runners.training")
    tokens = load_tokens(Path(job.inputs[p["dataset"]]), seq_len)
    model = build_model(job, workdir).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=float(p["learning_rate"]), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(int(p.get("warmup_steps", 0)), steps))
    use_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    losses: list[list[float]] = []
    start = 0
    stop_at = job.stop_at
    ckpt_root = workdir / "checkpoints"
    resume = job.resume_from
    if resume:
        meta = checkpoint.load(Path(resume), model, opt, sched)
        start, losses = int(meta["step"]), meta["losses"]
        if int(meta.get("world_size", 1)) != world.size:
            raise JobError(f"the checkpoint was written by {meta.get('world_size', 1)}"
                           f" processes; this attempt has {world.size}")
        report.send("resumed", step=start)
    net = world.wrap(model)
    t0, tokens_done = time.perf_counter(), 0
    ckpt_seconds, ckpt_count = 0.0, 0
    log_every = max(1, steps // 20)
    if world.main:
        print(f"training {type(model).__name__} ({sum(t.numel() for t in model.parameters()):,}"
              f" parameters) on {device}{' with bf16 autocast' if use_bf16 else ''}"
              f"{f' x {world.size} processes' if world.size > 1 else ''},"
              f" steps {start + 1}..{steps}", flush=True)

    def save(at: int) -> None:
        nonlocal ckpt_seconds, ckpt_count
        began = time.perf_counter()
        path = checkpoint.save(ckpt_root, at, model, opt, sched,
                               {"losses": losses, "world_size": world.size})
        took = time.perf_counter() - began
        ckpt_seconds += took
        ckpt_count += 1
        cadence.written(took)
        report.checkpoint(at, str(path.relative_to(workdir)), took)
        print(f"checkpoint at step {at} written in {took:.2f}s", flush=True)

    for step in range(start, steps):
        x = world.shard(batch_for(tokens, step, seed, batch, seq_len)).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            loss = net(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        value = world.mean(loss.detach())
        losses.append([step + 1, value])
        tokens_done += x.numel() * world.size
        elapsed = time.perf_counter() - t0
        if not world.main:
            continue
        report.progress(step + 1, steps, loss=value, lr=sched.get_last_lr()[0],
                        tokens_per_s=tokens_done / elapsed if elapsed > 0 else 0.0)
        if (step + 1) % log_every == 0 or step + 1 == steps:
            print(f"step {step + 1}/{steps} loss {value:.4f} lr {sched.get_last_lr()[0]:.2e}"
                  f" tokens/s {tokens_done / max(elapsed, 1e-9):,.0f}", flush=True)
        if step + 1 == stop_at < steps:
            # A check: the state at stop_at is the result, compared with the checkpoint the
            # checked provider reported there.
            out = workdir / "outputs"
            out.mkdir(exist_ok=True)
            checkpoint.write_files(out, step + 1, model, opt, sched,
                                   {"losses": losses, "world_size": world.size})
            print(f"check: state at step {stop_at} written", flush=True)
            report.done(steps=float(stop_at), resumed_from_step=float(start))
            world.finish()
            return
        if step + 1 < steps and (drain_requested() or cadence.due(step + 1)):
            save(step + 1)
            if drain_requested():
                report.drained(step + 1)
                return
    world.finish()
    if not world.main:
        return
    out = workdir / "outputs"
    out.mkdir(exist_ok=True)
    model.save_pretrained(out)
    with open(out / "loss.jsonl", "w") as f:
        for s, v in losses:
            f.write(json.dumps({"step": s, "loss": v}) + "\n")
    elapsed = time.perf_counter() - t0
    done_steps = steps - start
    metrics = {"final_loss": losses[-1][1] if losses else float("nan"), "steps": float(steps),
               "train_seconds": elapsed,
               "tokens_per_s": tokens_done / elapsed if elapsed > 0 else 0.0,
               "samples_per_s": done_steps * batch / elapsed if elapsed > 0 else 0.0,
               "step_seconds": elapsed / done_steps if done_steps else 0.0,
               "checkpoints": float(ckpt_count), "checkpoint_seconds": ckpt_seconds,
               "checkpoint_overhead": ckpt_seconds / elapsed if elapsed > 0 else 0.0,
               "resumed_from_step": float(start), "processes": float(world.size)}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"done: final loss {metrics['final_loss']:.4f}, {metrics['tokens_per_s']:,.0f}"
          f" tokens/s, {elapsed:.1f}s", flush=True)
    report.done(**metrics)


def warm_up() -> None:
    """Import what a job will need, ahead of the job (see runners/forkserver.py)."""
    import transformers  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401


def main() -> int:
    return run_main("training", train)


if __name__ == "__main__":
    sys.exit(main())
