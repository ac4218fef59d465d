"""The generate runner: completions for a JSONL of prompts, with transformers on torch (left
padding, real batches) or with vLLM (runners/vllm_engine.py) when the job asks for it,
resumable per batch, with per-request latency figures.

    python -m gpumarket.provider.runners.generate WORKDIR

Reads WORKDIR/job.json; writes outputs/completions.jsonl (input order) and
outputs/metrics.json. Figures per request: time to first token, time per output token,
prompt and output tokens; over the job: their P50/P95/P99 and tokens/s.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from gpumarket.provider.runners.inference import (
    Results, percentiles, read_items, run_main, torch_device, torch_dtype, unpack_model,
)
from gpumarket.provider.runners.report import Reporter
from gpumarket.provider.runners.base import JobError, read_job

CPU_BATCH = 8
MAX_BATCH = 128


def load(model_dir: Path, device, dtype, remote_code: bool = False):
    """The tokenizer and model; the model's own code runs only if the job asked for it and
    the provider's policy allowed it (the daemon refuses the lease otherwise)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True,
                                                  trust_remote_code=remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, local_files_only=True, trust_remote_code=remote_code, use_safetensors=True,
            dtype=dtype)
    except (OSError, ValueError) as exc:
        raise JobError(f"model: cannot load ({str(exc).splitlines()[0]})") from exc
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise JobError("model: the tokenizer has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, model.to(device).eval()


def choose_batch(params: dict, model, device, longest_tokens: int) -> int:
    """The job's batch_size, else from free memory: what the KV cache of one sequence of the
    longest prompt plus max_tokens takes, into half the free memory."""
    import torch

    if params.get("batch_size"):
        return int(params["batch_size"])
    if device.type != "cuda":
        return CPU_BATCH
    cfg = model.config
    layers = getattr(cfg, "num_hidden_layers", 32)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", 32)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * layers * kv_heads * head_dim * model.dtype.itemsize
    per_seq = per_token * (longest_tokens + int(params.get("max_tokens") or 64))
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(MAX_BATCH, int(free * 0.5 // max(per_seq, 1))))


class StepClock:
    """A stopping criterion that never stops: it notes when each generation step ends."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate(workdir: Path, report: Reporter) -> None:
    job = read_job(workdir)
    p = job["params"]
    prompts = read_items(job["inputs"][p["prompts"]], "prompt", "prompts")
    model_dir = unpack_model(job, "model", workdir)
    if p.get("engine") == "vllm":
        from gpumarket.provider.runners import vllm_engine

        run = vllm_engine.run
    else:
        run = with_transformers
    results, new_tokens, elapsed, engine = run(job, prompts, model_dir, workdir, report)
    ordered = results.in_order()
    out_dir = workdir / "outputs"
    out_dir.mkdir(exist_ok=True)
    with open(out_dir / "completions.jsonl", "w", encoding="utf-8") as f:
        for record in ordered:
            f.write(json.dumps(record) + "\n")
    metrics = {"prompts": float(len(prompts)),
               "prompt_tokens": float(sum(r["prompt_tokens"] for r in ordered)),
               "output_tokens": float(sum(r["output_tokens"] for r in ordered)),
               "tokens_per_s": new_tokens / elapsed if elapsed > 0 else 0.0,
               "generate_seconds": elapsed, "batch_size": float(results.batch_size),
               "resumed_from_step": float(results.resumed_from),
               **percentiles([r["ttft_s"] for r in ordered if r["ttft_s"] is not None],
                             "ttft_s"),
               **percentiles([r["tpot_s"] for r in ordered
                              if r["output_tokens"] > 1 and r["tpot_s"] is not None],
                             "tpot_s")}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"done: {len(prompts)} prompts, {metrics['output_tokens']:.0f} tokens,"
          f" {metrics['tokens_per_s']:,.1f} tokens/s with {engine}", flush=True)
    report.done(**metrics)


def with_transformers(job: dict, prompts: list[str], model_dir: Path, workdir: Path,
                      report: Reporter) -> tuple[Results, int, float, str]:
    """Generate every prompt not done yet; return (results, new tokens, seconds generating,
    what ran it)."""
    import torch
    from transformers import StoppingCriteriaList

    p = job["params"]
    device = torch_device(job)
    tokenizer, model = load(model_dir, device, torch_dtype(p.get("dtype", ""), device),
                            bool(p.get("trust_remote_code")))
    lengths = [len(ids) for ids in tokenizer(prompts)["input_ids"]]
    batch = choose_batch(p, model, device, max(lengths))
    results = Results(workdir, job, len(prompts), batch, report)
    max_tokens = int(p.get("max_tokens") or 64)
    temperature = float(p.get("temperature") or 0.0)
    top_p = float(p.get("top_p") or 1.0)
    stops = list(p.get("stop") or [])
    seed = int(p.get("seed") or 0)
    print(f"generating for {len(prompts)} prompts with {type(model).__name__} on {device}"
          f" ({model.dtype}), batch {results.batch_size}, max_tokens {max_tokens}", flush=True)
    began, new_tokens = time.perf_counter(), 0
    for indices in results.batches():
        enc = tokenizer([prompts[i] for i in indices], return_tensors="pt", padding=True)
        enc = {k: v.to(device) for k, v in enc.items()}
        torch.manual_seed(seed * 1_000_003 + indices[0])  # the batch's own draw: resumable
        clock = StepClock()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                **enc, max_new_tokens=max_tokens, do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_p=top_p if temperature > 0 else None, top_k=None,
                pad_token_id=tokenizer.pad_token_id,
                stopping_criteria=StoppingCriteriaList([clock]),
                stop_strings=stops or None, tokenizer=tokenizer if stops else None)
        generated = out[:, enc["input_ids"].shape[1]:].cpu()
        records = []
        for row, i in enumerate(indices):
            ids = generated[row].tolist()
            n = len(ids)
            eos = tokenizer.eos_token_id
            while n and ids[n - 1] == tokenizer.pad_token_id and ids[n - 1] != eos:
                n -= 1
            finish = "length" if n >= max_tokens else "stop"
            if eos is not None and eos in ids[:n]:
                n = ids.index(eos) + 1
                finish = "stop"
            text = tokenizer.decode(ids[:n], skip_special_tokens=True)
            for s in stops:
                if s in text:
                    text, finish = text[:text.index(s)], "stop"
            first = clock.times[0] - start if clock.times else 0.0
            last = clock.times[min(n, len(clock.times)) - 1] - start if n and clock.times else first
            records.append({
                "index": i, "completion": text, "finish_reason": finish,
                "prompt_tokens": lengths[i], "output_tokens": n, "ttft_s": first,
                "tpot_s": (last - first) / (n - 1) if n > 1 else 0.0,
            })
            new_tokens += n
        elapsed = time.perf_counter() - began
        results.add(records, tokens_per_s=new_tokens / max(elapsed, 1e-9))
        results.say(f"prompts {len(results.done)}/{len(prompts)}  tokens/s"
                    f" {new_tokens / max(elapsed, 1e-9):,.1f}")
    return results, new_tokens, time.perf_counter() - began, f"transformers on {device}"


def warm_up() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401


def main() -> int:
    return run_main("generate", generate)


if __name__ == "__main__":
    sys.exit(main())
