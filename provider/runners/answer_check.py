"""A check of an endpoint's answers by their fingerprints (docs/verification.md): each
sampled answer is a request as the engine got it, the token ids the replica says it
generated and the fingerprints it committed to in its final message (engine_protocol.Final).
One prefill pass of each request's prompt (tokenized as the engine does: engine.
parse_completion) plus those ids, judged by the generate kind's fingerprint rule for the
endpoint's dtype, greedy requests by the token gap too. An embed endpoint's answers are its
vectors: the checker embeds each sampled request's inputs again with the endpoint's model
(``embed_check``), and the broker compares the vectors by the embed kind's rule."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from gpumarket.kinds.endpoint import ANSWERS, answer_rows
from gpumarket.kinds.engine_protocol import BadRequest, Complete
from gpumarket.kinds.generate import fingerprint_rule
from gpumarket.provider.runners import fingerprint
from gpumarket.provider.runners.base import JobError
from gpumarket.provider.runners.engine import RequestError, parse_completion

MAX_SAMPLES = 64      # answers one check prefills (in batches of BATCH)
BATCH = 8


def replay_answers(tokenizer, model, device, max_seq_len: int, samples: list[dict]
                   ) -> list[dict]:
    """The checker's side: per sample ({"request": a Complete as a dict, "token_ids":
    [...]}; never the replica's fingerprints), one prefill pass of the request's prompt plus
    those ids: {"fingerprints": [...], "token_gap": x, "greedy": bool}, with "draws" (how
    the ids sit in the request's temperature and top_p's distribution: kinds/draws.py) for
    a sampled request, or {"error": why} for
    a sample that is not one (a request the engine would refuse, ids outside the
    vocabulary). At most MAX_SAMPLES; the rest {"error": ...}."""
    out: list[dict | None] = [None] * len(samples)
    todo = []
    for n, sample in enumerate(samples[:MAX_SAMPLES]):
        try:
            request = Complete.from_dict(sample["request"])
            prompt_ids, sampling = parse_completion(request, tokenizer, max_seq_len)
            ids = sample["token_ids"]
            if not isinstance(ids, list) or not all(
                    type(t) is int and 0 <= t < len(tokenizer) for t in ids):
                raise ValueError("token ids outside the vocabulary")
            if len(prompt_ids) + len(ids) > max_seq_len:
                raise ValueError(f"longer than the endpoint's max_seq_len {max_seq_len}")
        except (BadRequest, RequestError, KeyError, TypeError, ValueError) as exc:
            out[n] = {"error": f"not a sample that can be checked ({exc})"[:300]}
            continue
        todo.append((n, prompt_ids, ids, None if sampling.temperature <= 0
                     else (sampling.temperature, sampling.top_p)))
    for start in range(0, len(todo), BATCH):
        batch = todo[start:start + BATCH]
        checked = fingerprint.prefill_rows(model, [(p, g) for _, p, g, _ in batch], device,
                                           [drawing for *_, drawing in batch])
        for (n, _, _, drawing), seen in zip(batch, checked):
            out[n] = {**seen, "greedy": drawing is None}
    return [o if o is not None else {"error": "not checked: too many samples"} for o in out]


def check_answers(tokenizer, model, device, max_seq_len: int, samples: list[dict],
                  dtype: str) -> list[tuple[bool, str]]:
    """Per sample (as replay_answers takes, with the replica's "fingerprints"): (agrees,
    where it differs), by the generate kind's fingerprint rule for ``dtype`` (the broker's
    comparison, kinds/endpoint.py, applies the same rule)."""
    out = []
    for sample, replayed in zip(samples, replay_answers(tokenizer, model, device,
                                                        max_seq_len, samples)):
        if "error" in replayed:
            out.append((False, replayed["error"]))
            continue
        same = fingerprint_rule(dtype, replayed["greedy"], not replayed["greedy"])
        out.append(same({"completion": "", "fingerprints": sample.get("fingerprints")},
                        {"completion": "", **replayed}))
    return out


def run_check(job, workdir: Path, report) -> None:
    """A check lease of an endpoint (its ``check_claimed``: the sampled requests and the
    replica's token ids, answers.jsonl): load the endpoint's model as a replica would, replay
    each answer by one prefill, and write outputs/answers.jsonl (index, fingerprints,
    token gap; or an error) and metrics.json. Raises JobError."""
    from gpumarket.provider.runners.engine import Settings
    from gpumarket.provider.runners.generate import load, torch_float_bits
    from gpumarket.provider.runners.inference import torch_device, torch_dtype, unpack_model

    if not job.check_claimed:
        raise JobError("a check of answers needs the sampled answers (check_claimed)")
    try:
        claimed = answer_rows(Path(job.check_claimed))
    except (OSError, ValueError, TypeError) as exc:
        raise JobError(f"the sampled answers are unreadable ({exc})") from exc
    settings = Settings.from_params(job.params)
    if settings.task == "embed":
        embed_check(job, workdir, claimed, report)
        return
    device = torch_device(job)
    model_dir = unpack_model(job, "model", workdir)
    tokenizer, model = load(model_dir, device, torch_dtype(settings.dtype, device),
                            settings.trust_remote_code)
    if not fingerprint.usable(model):
        raise JobError("model: no fingerprints can be made of it (no output embedding)")
    from gpumarket.provider.runners.engine import model_seq_len

    seq = model_seq_len(settings, model.config)
    order = sorted(claimed)
    began = time.perf_counter()
    replayed = replay_answers(tokenizer, model, device, seq, [claimed[i] for i in order])
    elapsed = time.perf_counter() - began
    returned(workdir, order, replayed, {"prefill_seconds": elapsed,
                                        "float_bits": float(torch_float_bits(model))},
             f"{len(order)} answers prefilled in {elapsed:.2f}s", report)


def returned(workdir: Path, order: list[int], replayed: list[dict], metrics: dict,
             said: str, report) -> None:
    """What a check of answers returns: outputs/answers.jsonl (index and the replay's record
    of each sampled answer) and metrics.json (its figures, ``answers`` among them)."""
    out_dir = workdir / "outputs"
    out_dir.mkdir(exist_ok=True)
    with open(out_dir / ANSWERS, "w", encoding="utf-8") as f:
        for i, record in zip(order, replayed):
            f.write(json.dumps({"index": i, **record}) + "\n")
    metrics = {"answers": float(len(order)), **metrics}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"answer check: {said}", flush=True)
    report.done(**metrics)


def replay_embeddings(engine, samples: list[dict]) -> list[dict]:
    """The checker's side of an embed endpoint's check: per sample ({"request": an Embed as
    a dict}; never the replica's vectors), the vectors the endpoint's model gives its inputs
    (the replica's own engine, provider/runners/engine.py EmbedEngine, on this provider):
    {"embeddings": [...]}, or {"error": why} for a request the engine would refuse. At most
    MAX_SAMPLES; the rest {"error": ...}."""
    from gpumarket.kinds.engine_protocol import Embed

    out = []
    for n, sample in enumerate(samples):
        if n >= MAX_SAMPLES:
            out.append({"error": "not checked: too many samples"})
            continue
        try:
            texts = Embed.from_dict(sample["request"]).input
        except (BadRequest, KeyError, TypeError, ValueError, AttributeError) as exc:
            out.append({"error": f"not a sample that can be checked ({exc})"[:300]})
            continue
        final = asyncio.run(engine.embed(texts))     # as the replica's engine answers it
        out.append({"embeddings": final.embeddings} if final.error is None else
                   {"error": f"not a sample that can be checked ({final.error})"[:300]})
    return out


def embed_check(job, workdir: Path, claimed: dict[int, dict], report) -> None:
    """An embed endpoint's check: load the endpoint's model as its replicas do
    (engine.load_engine), embed each sampled request's inputs, and write
    outputs/answers.jsonl (index, embeddings; or an error) and metrics.json with the float
    width the model computed in (its tolerance: kinds/embed.py). Raises JobError."""
    from gpumarket.provider.runners.engine import load_engine
    from gpumarket.provider.runners.generate import torch_float_bits

    engine = load_engine(job, workdir)
    order = sorted(claimed)
    began = time.perf_counter()
    try:
        replayed = replay_embeddings(engine, [claimed[i] for i in order])
    finally:
        asyncio.run(engine.close())
    elapsed = time.perf_counter() - began
    returned(workdir, order, replayed, {"embed_seconds": elapsed,
                                        "float_bits": float(torch_float_bits(engine.model))},
             f"{len(order)} embed answers replayed in {elapsed:.2f}s", report)
