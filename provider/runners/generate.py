"""The generate runner: completions for a JSONL of prompts, with transformers on torch (left
padding, real batches) or with vLLM (runners/vllm_engine.py) when the job asks for it,
resumable per batch, with per-request latency figures.

    python -m gpumarket.provider.runners.generate WORKDIR

Reads WORKDIR/job.json; writes outputs/completions.jsonl (input order, with each row's
generated token ids), outputs/fingerprints.jsonl (with transformers: each row's activation
fingerprints, kinds/fingerprints.py) and outputs/metrics.json. Figures per request: time to
first token, time per output token, prompt and output tokens; over the job: their
P50/P95/P99 and tokens/s.

A check lease that carries the checked provider's completions (``check_claimed``) generates
nothing: it runs one prefill pass over each checked row's prompt and claimed tokens and
writes the fingerprints it sees (``prefill_check``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gpumarket.provider.runners.inference import (
    Results, attention_words, batch_for_memory, bucket, choose_attention, free_memory,
    kv_bytes_per_token, percentiles, read_items, run_main, torch_device, torch_dtype,
    unpack_model,
)
from gpumarket.provider.runners import fingerprint
from gpumarket.provider.runners.report import Reporter
from gpumarket.provider.runners.base import JobError, read_job

if TYPE_CHECKING:
    from gpumarket.kinds.runner_job import RunnerJob

CPU_BATCH = 8
MAX_BATCH = 256
COMPILE = True  # the switch for compile_pays: off, a job never compiles
COMPILE_S = 32.0  # seconds to compile the 953M Llama's static-cache forward on an H100
COMPILED_STEP_SHARE = 0.27  # a compiled decode step's time over an eager one's, same card


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
    """The job's batch_size, else on CUDA from free memory: as many sequences of the longest
    prompt (padded to its bucket) plus max_tokens as MEMORY_SHARE of the free memory holds
    the KV cache of, at most MAX_BATCH; on the CPU, CPU_BATCH (measured: docs/provider.md)."""
    if params.get("batch_size"):
        return int(params["batch_size"])
    free = free_memory(device)
    if free is None:
        return CPU_BATCH
    step = bucket(device) or 1
    tokens = -(-longest_tokens // step) * step + int(params.get("max_tokens") or 64)
    return batch_for_memory(free, kv_bytes_per_token(model.config, model.dtype) * tokens,
                            MAX_BATCH)


def compile_pays(device, steps_left: int, step_s: float) -> bool:
    """Whether the static cache and the compiled forward pay for the rest of a job: on CUDA
    only, when the decode steps still to run, at ``step_s`` each, would save more than twice
    the compile's cost at the compiled step's share of the time (COMPILE_S and
    COMPILED_STEP_SHARE as measured on an H100, issue 31: 32 s to compile, 3.4 ms a step
    against 12.5 ms)."""
    if device.type != "cuda" or not COMPILE:
        return False
    return steps_left * step_s * (1 - COMPILED_STEP_SHARE) > 2 * COMPILE_S


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
    p = job.params
    prompts = read_items(job.inputs[p["prompts"]], "prompt", "prompts")
    model_dir = unpack_model(job, "model", workdir)
    if job.check_claimed:
        return prefill_check(job, prompts, model_dir, workdir, report)
    if p.get("engine") == "vllm":
        from gpumarket.provider.runners import vllm_engine

        run = vllm_engine.run
    else:
        run = with_transformers
    results, new_tokens, elapsed, engine = run(job, prompts, model_dir, workdir, report)
    ordered = results.in_order()
    out_dir = workdir / "outputs"
    out_dir.mkdir(exist_ok=True)
    write_outputs(out_dir, ordered)
    metrics = {"prompts": float(len(prompts)),
               "prompt_tokens": float(sum(r["prompt_tokens"] for r in ordered)),
               "output_tokens": float(sum(r["output_tokens"] for r in ordered)),
               "tokens_per_s": new_tokens / elapsed if elapsed > 0 else 0.0,
               "generate_seconds": elapsed, "batch_size": float(results.batch_size),
               "resumed_from_step": float(results.resumed_from), **results.figures,
               **percentiles([r["ttft_s"] for r in ordered if r["ttft_s"] is not None],
                             "ttft_s"),
               **percentiles([r["tpot_s"] for r in ordered
                              if r["output_tokens"] > 1 and r["tpot_s"] is not None],
                             "tpot_s")}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"done: {len(prompts)} prompts, {metrics['output_tokens']:.0f} tokens,"
          f" {metrics['tokens_per_s']:,.1f} tokens/s with {engine}", flush=True)
    report.done(**metrics)


def write_outputs(out_dir: Path, ordered: list[dict]) -> None:
    """completions.jsonl, and fingerprints.jsonl where every row has its fingerprints (a
    separate file: a checker is given the completions, never what it is compared with)."""
    with open(out_dir / "completions.jsonl", "w", encoding="utf-8") as f:
        for record in ordered:
            f.write(json.dumps({k: v for k, v in record.items() if k != "fingerprints"})
                    + "\n")
    if ordered and all("fingerprints" in r for r in ordered):
        with open(out_dir / "fingerprints.jsonl", "w", encoding="utf-8") as f:
            for record in ordered:
                f.write(json.dumps({"index": record["index"],
                                    "fingerprints": record["fingerprints"]}) + "\n")


def with_transformers(job: RunnerJob, prompts: list[str], model_dir: Path, workdir: Path,
                      report: Reporter) -> tuple[Results, int, float, str]:
    """Generate every prompt not done yet; return (results, new tokens, seconds generating,
    what ran it). On CUDA, prompts are padded to a bucket of lengths, SDPA's cuDNN kernel is
    on only if it measured faster, and once a batch has run, the rest of a long job runs with
    the static cache and the compiled forward where that pays (compile_pays); the choices
    are in the log and in ``results.figures``."""
    p = job.params
    device = torch_device(job)
    tokenizer, model = load(model_dir, device, torch_dtype(p.get("dtype", ""), device),
                            bool(p.get("trust_remote_code")))
    lengths = [len(ids) for ids in tokenizer(prompts)["input_ids"]]
    batch = choose_batch(p, model, device, max(lengths))
    results = Results(workdir, job, len(prompts), batch, report)
    max_tokens = int(p.get("max_tokens") or 64)
    step = bucket(device)
    attention = choose_attention(model, device, results.batch_size)
    results.figures.update(attention, bucket_tokens=float(step or 0), compiled=0.0)
    print(f"generating for {len(prompts)} prompts with {type(model).__name__} on {device}"
          f" ({model.dtype}), batch {results.batch_size}"
          f"{' (from free memory)' if device.type == 'cuda' and not p.get('batch_size') else ''},"
          f" max_tokens {max_tokens}, attention {attention_words(model, attention)},"
          f" prompts padded to {f'a multiple of {step}' if step else 'the batch longest'}"
          " tokens", flush=True)
    # with the static cache every batch has one shape: the longest prompt's bucket, full rows
    width = -(-max(lengths) // (step or 1)) * (step or 1)
    todo = list(results.batches())
    began, new_tokens, static = time.perf_counter(), 0, False
    for n, indices in enumerate(todo):
        rows = [prompts[i] for i in indices]
        if static:
            rows += [rows[0]] * (results.batch_size - len(rows))
            enc = tokenizer(rows, return_tensors="pt", padding="max_length", max_length=width)
        else:
            enc = tokenizer(rows, return_tensors="pt", padding=True, pad_to_multiple_of=step)
        clock = _generate(model, tokenizer, {k: v.to(device) for k, v in enc.items()}, p,
                          indices[0], static)
        new_tokens += _record(results, tokenizer, indices, enc, clock, lengths, p,
                              time.perf_counter() - began, new_tokens)
        steps_left = (len(todo) - n - 1) * max_tokens
        if not static and n == 0 and len(clock.times) > 2 and compile_pays(
                device, steps_left, (clock.times[-1] - clock.times[0]) / (len(clock.times) - 1)):
            static = True
            results.figures["compiled"] = 1.0
            print(f"the remaining {steps_left:,} decode steps run with the static cache and"
                  " the compiled forward (it pays at this length)", flush=True)
    return results, new_tokens, time.perf_counter() - began, f"transformers on {device}"


def _generate(model, tokenizer, enc: dict, p: dict, first_index: int, static: bool):
    """One batch through ``model.generate``; returns its StepClock and leaves the output on
    the clock (``clock.out``)."""
    import contextlib

    import torch
    from transformers import StoppingCriteriaList

    temperature = float(p.get("temperature") or 0.0)
    stops = list(p.get("stop") or [])
    torch.manual_seed(int(p.get("seed") or 0) * 1_000_003 + first_index)  # resumable draw
    clock = StepClock()
    clock.start = time.perf_counter()
    extra = {"cache_implementation": "static"} if static else {}
    clock.recorder = fingerprint.Recorder(model) if fingerprint.usable(model) else None
    with torch.inference_mode(), clock.recorder or contextlib.nullcontext():
        clock.out = model.generate(
            **enc, max_new_tokens=int(p.get("max_tokens") or 64), do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_p=float(p.get("top_p") or 1.0) if temperature > 0 else None, top_k=None,
            pad_token_id=tokenizer.pad_token_id,
            stopping_criteria=StoppingCriteriaList([clock]),
            stop_strings=stops or None, tokenizer=tokenizer if stops else None,
            **fingerprint.AS_CHECKED, **extra)
    return clock


def _record(results: Results, tokenizer, indices: list[int], enc, clock, lengths: list[int],
            p: dict, elapsed: float, done_tokens: int) -> int:
    """Add one batch's completions to the results; returns its new tokens."""
    max_tokens = int(p.get("max_tokens") or 64)
    stops = list(p.get("stop") or [])
    generated = clock.out[:, enc["input_ids"].shape[1]:].cpu()
    records, new_tokens, kept = [], 0, []
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
        text, stopped = completion_text(tokenizer, ids[:n], stops)
        finish = "stop" if stopped else finish
        kept.append(n)
        first = clock.times[0] - clock.start if clock.times else 0.0
        last = clock.times[min(n, len(clock.times)) - 1] - clock.start \
            if n and clock.times else first
        records.append({
            "index": i, "completion": text, "finish_reason": finish,
            "prompt_tokens": lengths[i], "output_tokens": n, "ttft_s": first,
            "tpot_s": (last - first) / (n - 1) if n > 1 else 0.0, "token_ids": ids[:n],
        })
        new_tokens += n
    if clock.recorder is not None:
        for record, prints in zip(records, clock.recorder.rows(kept)):
            record["fingerprints"] = prints
    rate = (done_tokens + new_tokens) / max(elapsed, 1e-9)
    results.add(records, tokens_per_s=rate)
    results.say(f"prompts {len(results.done)}/{results.total}  tokens/s {rate:,.1f}")
    return new_tokens


def completion_text(tokenizer, ids: list[int], stops: list[str]) -> tuple[str, bool]:
    """The text of generated ``ids``, cut at the first stop string; and whether one cut it."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for s in stops:
        if s in text:
            return text[:text.index(s)], True
    return text, False


def prefill_check(job: RunnerJob, prompts: list[str], model_dir: Path, workdir: Path,
                  report: Reporter) -> None:
    """A check by fingerprints: for the batch of rows the check picks (as a replay would),
    read the checked provider's token ids from its completions (``job.check_claimed``), run
    one prefill pass over prompt + those tokens, and write each row's text decoded from them,
    the fingerprints the pass sees, the largest logit gap of the tokens and, for a sampled
    job, how the tokens sit in its temperature and top_p's distribution
    (fingerprint.prefill_rows) as completions.jsonl and fingerprints.jsonl."""
    p = job.params
    device = torch_device(job)
    tokenizer, model = load(model_dir, device, torch_dtype(p.get("dtype", ""), device),
                            bool(p.get("trust_remote_code")))
    if not fingerprint.usable(model):
        raise JobError("model: no fingerprints can be made of it (no output embedding)")
    results = Results(workdir, job, len(prompts), job.check_batch_size, report)
    claimed = claimed_tokens(Path(job.check_claimed), set(results.only),
                             len(tokenizer), int(p.get("max_tokens") or 64))
    stops = list(p.get("stop") or [])
    temperature = float(p.get("temperature") or 0.0)
    # sampled rows: how their tokens sit in the distribution the job's sampling gives
    drawing = (temperature, float(p.get("top_p") or 1.0)) if temperature > 0 else None
    began = time.perf_counter()
    for indices in results.batches():
        rows = [(tokenizer(prompts[i])["input_ids"], claimed.get(i, [])) for i in indices]
        checked = fingerprint.prefill_rows(model, rows, device,
                                           [drawing] * len(rows) if drawing else None)
        records = []
        for i, (prompt_ids, ids), seen in zip(indices, rows, checked):
            records.append({"index": i, "completion": completion_text(tokenizer, ids, stops)[0],
                            "prompt_tokens": len(prompt_ids), "output_tokens": len(ids),
                            **seen})
        results.add(records)
    elapsed = time.perf_counter() - began
    ordered = results.in_order()
    out_dir = workdir / "outputs"
    out_dir.mkdir(exist_ok=True)
    for record in ordered:
        record.setdefault("fingerprints", [])
    write_outputs(out_dir, ordered)
    metrics = {"prompts": float(len(prompts)), "prefill_seconds": elapsed,
               "float_bits": float(torch_float_bits(model)),
               "output_tokens": float(sum(r["output_tokens"] for r in ordered))}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"prefill check: {len(ordered)} rows, {metrics['output_tokens']:.0f} claimed tokens"
          f" in {elapsed:.2f}s", flush=True)
    report.done(**metrics)


def torch_float_bits(model) -> int:
    return 32 if next(model.parameters()).dtype.itemsize == 4 else 16


def claimed_tokens(path: Path, rows: set[int], vocab: int, max_tokens: int
                   ) -> dict[int, list[int]]:
    """The token ids the checked provider's completions give for ``rows``: each a list of at
    most ``max_tokens`` ids below ``vocab`` (anything else: JobError, a check that cannot
    run; the checked provider's word is hostile)."""
    out: dict[int, list[int]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise JobError("the checked completions are not JSONL") from exc
            index = record.get("index") if isinstance(record, dict) else None
            if type(index) is not int or index not in rows:
                continue
            ids = record.get("token_ids")
            if not isinstance(ids, list) or len(ids) > max_tokens or not all(
                    type(t) is int and 0 <= t < vocab for t in ids):
                ids = []     # compared as no tokens: it disagrees unless the row has none
            out[index] = ids
    return out


def warm_up() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401


def main() -> int:
    return run_main("generate", generate)


if __name__ == "__main__":
    sys.exit(main())
