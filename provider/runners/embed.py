"""The embed runner: one vector per text of a JSONL, with a transformers encoder and mean
pooling over the attention mask (the sentence-transformers recipe), resumable per batch.

    python -m gpumarket.provider.runners.embed WORKDIR

Writes outputs/embeddings.jsonl ({"index", "embedding"}) or outputs/embeddings.npy
(float32, one row per text, input order) and outputs/metrics.json.
"""

from __future__ import annotations

import base64
import json
import sys
import time
from pathlib import Path

from gpumarket.provider.runners.inference import (
    Results, attention_words, batch_for_memory, bucket, choose_attention, free_memory,
    percentiles, read_items, run_main, torch_device, torch_dtype, unpack_model,
)
from gpumarket.provider.runners.report import Reporter
from gpumarket.provider.runners.base import JobError, read_job

DEFAULT_BATCH = 32  # texts a batch on the CPU, and where the job gives none
MAX_BATCH = 1024  # texts a batch on CUDA, chosen from free memory


def choose_batch(params: dict, model, device, max_len: int) -> int:
    """The job's batch_size, else on CUDA as many texts of ``max_len`` tokens as MEMORY_SHARE
    of the free memory holds one layer's activations of (hidden states, the MLP's
    intermediate, attention scores where a kernel makes them), at most MAX_BATCH; on the
    CPU, DEFAULT_BATCH."""
    if params.get("batch_size"):
        return int(params["batch_size"])
    free = free_memory(device)
    if free is None:
        return DEFAULT_BATCH
    cfg = model.config
    hidden = getattr(cfg, "hidden_size", 1024)
    inner = getattr(cfg, "intermediate_size", 4 * hidden)
    heads = getattr(cfg, "num_attention_heads", 16)
    size = next(model.parameters()).element_size()
    per_text = max_len * (6 * hidden + 2 * inner) * size + heads * max_len * max_len * size
    return batch_for_memory(free, per_text, MAX_BATCH)


def pool(hidden, mask, normalize: bool):
    """One vector per row of ``hidden`` (batch, tokens, dim): the mean of its token vectors
    over the attention ``mask`` (batch, tokens), L2-normalised if ``normalize``. The embed job
    and the embedding endpoint share it, so both give the same vectors."""
    import torch

    weights = mask.unsqueeze(-1).to(hidden.dtype)
    vectors = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    if normalize:
        vectors = torch.nn.functional.normalize(vectors, dim=-1)
    return vectors


def embed(workdir: Path, report: Reporter) -> None:
    import numpy as np
    import torch
    from transformers import AutoModel, AutoTokenizer

    job = read_job(workdir)
    p = job.params
    texts = read_items(job.inputs[p["texts"]], "text", "texts")
    fmt = p.get("output_format") or "jsonl"
    if fmt not in ("jsonl", "npy"):
        raise JobError(f"output_format {fmt!r} is not jsonl or npy")
    device = torch_device(job)
    model_dir = unpack_model(job, "model", workdir)
    remote_code = bool(p.get("trust_remote_code"))  # the daemon checked its policy allows it
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True,
                                                  trust_remote_code=remote_code)
        model = AutoModel.from_pretrained(model_dir, local_files_only=True, use_safetensors=True,
                                          trust_remote_code=remote_code,
                                          dtype=torch_dtype(p.get("dtype", ""), device))
    except (OSError, ValueError) as exc:
        raise JobError(f"model: cannot load ({str(exc).splitlines()[0]})") from exc
    model = model.to(device).eval()
    normalize = not p.get("keep_scale", False)
    max_len = min(int(getattr(tokenizer, "model_max_length", 512) or 512), 8192)
    longest = max(len(ids) for ids in tokenizer(texts, truncation=True, max_length=max_len)[
        "input_ids"]) if device.type == "cuda" and not p.get("batch_size") else 0
    step = bucket(device)
    step = step if step and max_len % step == 0 else None  # never past the model's positions
    results = Results(workdir, job, len(texts), choose_batch(p, model, device, longest),
                      report)
    attention = choose_attention(model, device, results.batch_size)
    results.figures.update(attention, bucket_tokens=float(step or 0))
    print(f"embedding {len(texts)} texts with {type(model).__name__} on {device},"
          f" batch {results.batch_size}"
          f"{' (from free memory)' if device.type == 'cuda' and not p.get('batch_size') else ''},"
          f" attention {attention_words(model, attention)}", flush=True)
    began, tokens, latencies = time.perf_counter(), 0, []
    for indices in results.batches():
        start = time.perf_counter()
        enc = tokenizer([texts[i] for i in indices], return_tensors="pt", padding=True,
                        truncation=True, max_length=max_len,
                        pad_to_multiple_of=step).to(device)
        with torch.inference_mode():
            hidden = model(**enc).last_hidden_state
        vectors = pool(hidden, enc["attention_mask"], normalize).float().cpu().numpy()
        tokens += int(enc["attention_mask"].sum())
        latencies.append(time.perf_counter() - start)
        # float32 bytes in base64: a quarter of the size of a JSON list, and no float repr
        results.add([{"index": i, "vector": base64.b64encode(vectors[row].tobytes()).decode(),
                      "tokens": int(enc["attention_mask"][row].sum())}
                     for row, i in enumerate(indices)],
                    texts_per_s=len(results.done) / max(time.perf_counter() - began, 1e-9))
    elapsed = time.perf_counter() - began
    ordered = results.in_order()
    out = workdir / "outputs"
    out.mkdir(exist_ok=True)
    matrix = np.stack([np.frombuffer(base64.b64decode(r["vector"]), dtype=np.float32)
                       for r in ordered])
    if fmt == "npy":
        np.save(out / "embeddings.npy", matrix)
    else:
        with open(out / "embeddings.jsonl", "w", encoding="utf-8") as f:
            for r, vector in zip(ordered, matrix):
                f.write(json.dumps({"index": r["index"], "embedding": vector.tolist()}) + "\n")
    done_now = len(texts) - results.resumed_from
    metrics = {"texts": float(len(texts)), "dimensions": float(matrix.shape[1]),
               "tokens": float(sum(r["tokens"] for r in ordered)),
               "texts_per_s": done_now / elapsed if elapsed > 0 else 0.0,
               "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
               "embed_seconds": elapsed, "batch_size": float(results.batch_size),
               # the precision it computed in: a check's tolerance follows it (kinds/embed.py)
               "float_bits": float(torch.finfo(next(model.parameters()).dtype).bits),
               "resumed_from_step": float(results.resumed_from), **results.figures,
               **percentiles(latencies, "batch_s")}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"done: {len(texts)} texts, {metrics['texts_per_s']:,.1f} texts/s", flush=True)
    report.done(**metrics)


def warm_up() -> None:
    from transformers import AutoModel, AutoTokenizer  # noqa: F401


def main() -> int:
    return run_main("embed", embed)


if __name__ == "__main__":
    sys.exit(main())
