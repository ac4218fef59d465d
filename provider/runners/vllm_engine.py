"""The vLLM engine for generate jobs: ``LLM.generate`` with one ``SamplingParams`` per
prompt, continuous batching inside each chunk of prompts, dtype and quantization passed
through, all visible GPUs as tensor-parallel ranks.

Needs the ``vllm`` extra and CUDA; providers advertise the engine only where both are
present, and this module is imported only for a job that asks for ``engine = "vllm"``.
Chunks play the part of the transformers engine's batches: results are appended and
checkpointed per chunk, and each prompt's sampling seed is derived from its index, so a
resumed job draws the same numbers for the prompts it still has to do.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from gpumarket.provider.runners.base import JobError
from gpumarket.provider.runners.inference import Results
from gpumarket.provider.runners.report import Reporter

if TYPE_CHECKING:
    from gpumarket.kinds.runner_job import RunnerJob

CHUNK = 256


def _timings(output, n: int) -> tuple[float | None, float | None]:
    """TTFT and TPOT from the request's own timestamps, where this vLLM version gives them."""
    m = getattr(output, "metrics", None)
    first = getattr(m, "first_token_time", None)
    arrival = getattr(m, "arrival_time", None)
    last = getattr(m, "last_token_time", None)
    if not (first and arrival):
        return None, None
    tpot = (last - first) / (n - 1) if last and n > 1 else None
    return first - arrival, tpot


def run(job: RunnerJob, prompts: list[str], model_dir: Path, workdir: Path,
        report: Reporter) -> tuple[Results, int, float, str]:
    """Generate every prompt not done yet; return (results, new tokens, seconds generating,
    what ran it)."""
    try:
        import torch
        from vllm import LLM, SamplingParams
    except ImportError as exc:
        raise JobError("engine vllm: the vllm package is not installed on this provider") from exc
    p = job.params
    if job.device != "cuda" or not torch.cuda.is_available():
        raise JobError("engine vllm: needs a CUDA device")
    max_tokens = int(p.get("max_tokens") or 64)
    temperature = float(p.get("temperature") or 0.0)
    top_p = float(p.get("top_p") or 1.0)
    seed = int(p.get("seed") or 0)
    stops = list(p.get("stop") or []) or None
    try:
        llm = LLM(model=str(model_dir), tokenizer=str(model_dir),
                  trust_remote_code=bool(p.get("trust_remote_code")),
                  dtype=p.get("dtype") or "auto", quantization=p.get("quantization") or None,
                  seed=seed, tensor_parallel_size=torch.cuda.device_count())
    except (OSError, ValueError, RuntimeError) as exc:
        raise JobError(f"model: vLLM cannot load it ({str(exc).splitlines()[0]})") from exc
    results = Results(workdir, job, len(prompts), int(p.get("batch_size") or CHUNK), report)
    print(f"generating for {len(prompts)} prompts with vLLM on {torch.cuda.device_count()}"
          f" GPU(s), chunks of {results.batch_size}, max_tokens {max_tokens}", flush=True)
    began, new_tokens = time.perf_counter(), 0
    for indices in results.batches():
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                 stop=stops, seed=seed * 1_000_003 + i) for i in indices]
        outputs = llm.generate([prompts[i] for i in indices], params, use_tqdm=False)
        records = []
        for i, out in zip(indices, outputs):
            completion = out.outputs[0]
            n = len(completion.token_ids)
            ttft, tpot = _timings(out, n)
            records.append({"index": i, "completion": completion.text,
                            "finish_reason": completion.finish_reason or "length",
                            "prompt_tokens": len(out.prompt_token_ids or []),
                            "output_tokens": n, "ttft_s": ttft, "tpot_s": tpot})
            new_tokens += n
        elapsed = time.perf_counter() - began
        results.add(records, tokens_per_s=new_tokens / max(elapsed, 1e-9))
        results.say(f"prompts {len(results.done)}/{len(prompts)}  tokens/s"
                    f" {new_tokens / max(elapsed, 1e-9):,.1f}")
    return (results, new_tokens, time.perf_counter() - began,
            f"vLLM on {torch.cuda.device_count()} GPU(s)")
