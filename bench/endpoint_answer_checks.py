"""Checks of a generate endpoint's answers (docs/verification.md, Endpoint answers), measured
on the 4-layer, 512-wide random Llama of bench/fingerprint_spread.py in float32 on this CPU:
a replica's engine answers greedy requests sent together (the model loaded, 2 threads), and
a checker's answer_check prefill of the same answers judges them (check_answers, the
broker's rule). The batch engine (the CPU's endpoint engine): the seconds to serve and to
check (medians of ``rounds``), honest answers judged wrong, and the share of another random
init's answers one check finds wrong. The continuous engine (CUDA's default, which makes
its fingerprints by one prefill as each answer ends): honest answers judged wrong and
another init's caught. Run by bench/verification.py (``figures`` prints and derives the
detection figures); alone:

    cd bench && ../.venv/bin/python -c "import endpoint_answer_checks as m; print(m.measure())"
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np

import fingerprint_spread as fs


def serve(model_dir: Path, prompts: list[str], tokens: int, rounds: int, engine: str
          ) -> tuple[list[dict], list[float]]:
    """``prompts`` answered together by the endpoint's ``engine``, greedy, ``rounds`` times:
    the last round's answers as samples (request, token ids, fingerprints) and each round's
    seconds."""
    from gpumarket.kinds.engine_protocol import Complete, Final
    from gpumarket.kinds.runner_job import RunnerJob
    from gpumarket.provider.runners.engine import load_engine

    params = {"model": "", "model_name": model_dir.name, "task": "", "dtype": "float32",
              "max_seq_len": 0, "max_concurrency": 8, "engine": engine,
              "trust_remote_code": False}

    async def run() -> tuple[list[dict], list[float]]:
        loaded = load_engine(RunnerJob(params=params, model_dir=str(model_dir)), model_dir)
        times, out = [], {}

        async def one(i: int) -> None:
            request = Complete(prompt=prompts[i], max_tokens=tokens, temperature=0)
            async for event in loaded.complete(f"r{i}", request):
                if isinstance(event, Final):
                    out[i] = {"request": request.to_dict(), "token_ids": event.token_ids,
                              "fingerprints": event.fingerprints}
        try:
            for _ in range(rounds):
                began = time.perf_counter()
                await asyncio.gather(*(one(i) for i in range(len(prompts))))
                times.append(time.perf_counter() - began)
        finally:
            await loaded.close()
        return [out[i] for i in range(len(prompts))], times

    return asyncio.run(run())


def measure(answers: int = 16, tokens: int = 128, rounds: int = 3) -> dict:
    """The figures described above (``answers`` requests of ``tokens`` tokens)."""
    import torch

    from gpumarket.provider.runners.answer_check import check_answers

    torch.set_num_threads(2)
    prompts = (fs.PROMPTS * 4)[:answers]
    cpu = torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        right, other = fs.wide_llama(Path(tmp), 0), fs.wide_llama(Path(tmp), 1)
        honest, serve_s = serve(right, prompts, tokens, rounds, "batch")
        swapped, _ = serve(other, prompts, tokens, rounds, "batch")
        tok, model = fs.load(right, "float32")
        check_s, verdicts = [], []
        for _ in range(rounds):
            began = time.perf_counter()
            verdicts = check_answers(tok, model, cpu, 512, honest, "")
            check_s.append(time.perf_counter() - began)
        caught = check_answers(tok, model, cpu, 512, swapped, "")
        # the continuous engine: one round each (its time is not this figure's point)
        continuous = check_answers(tok, model, cpu, 512,
                                   serve(right, prompts, tokens, 1, "continuous")[0], "")
        continuous_caught = check_answers(tok, model, cpu, 512,
                                          serve(other, prompts, tokens, 1, "continuous")[0],
                                          "")
    return {"endpoint_serve_s": round(float(np.median(serve_s)), 3),
            "endpoint_check_s": round(float(np.median(check_s)), 3),
            "endpoint_check_over_serve": round(float(np.median(check_s) / np.median(serve_s)),
                                               4),
            "endpoint_tokens": sum(len(a["token_ids"]) for a in honest),
            "endpoint_false_positives": sum(not ok for ok, _ in verdicts),
            "endpoint_answers_caught_swapped": sum(not ok for ok, _ in caught) / len(caught),
            "endpoint_continuous_false_positives": sum(not ok for ok, _ in continuous),
            "endpoint_continuous_answers_caught_swapped":
                sum(not ok for ok, _ in continuous_caught) / len(continuous_caught)}


def figures(ep: dict) -> dict:
    """``ep`` (``measure``'s) with what follows from it at the broker's default answer
    check rate, printed: the checks' share of the serving compute, and how likely a replica
    serving another model is caught within 20 windows (new, and after a long record)."""
    from gpumarket.broker.serving.answer_samples import DEFAULT_RATE

    out = dict(ep)
    # A window's sampled answers are prefilled once; at the default rate that is
    # DEFAULT_RATE of the answers, each costing its prefill over its serving.
    out["inference_check_overhead_endpoint"] = round(
        DEFAULT_RATE * ep["endpoint_check_over_serve"], 5)
    p = 1.0 if ep["endpoint_answers_caught_swapped"] > 0 else 0.0
    # A new provider's replica has every window sampled (at least its first answer), and
    # each window with a sample is checked; a cheat never passes one, so it stays new.
    # Within its first 20 windows:
    caught = 1 - (1 - ep["endpoint_answers_caught_swapped"]) ** 20
    out["detection_p_20_jobs_endpoint_swapped_model"] = round(caught, 4)
    late = {}
    for n in (5, 50):
        # one that turns to it after a long clean record: only the rate samples
        window = 1 - (1 - DEFAULT_RATE * p) ** n
        late[n] = round(1 - (1 - window) ** 20, 4)
        out[f"detection_p_20_windows_endpoint_swapped_after_long_record_{n}_answers"] = \
            late[n]
    print(f"endpoint answers: the batch engine answered {16} requests x 128 tokens in"
          f" {ep['endpoint_serve_s']}s, a check prefilled them in {ep['endpoint_check_s']}s"
          f" ({ep['endpoint_check_over_serve']}x); at the default rate {DEFAULT_RATE}:"
          f" {out['inference_check_overhead_endpoint']} of the serving compute;"
          f" honest answers judged wrong: {ep['endpoint_false_positives']}; a swapped"
          f" model's answers caught per check: {ep['endpoint_answers_caught_swapped']:.2f};"
          f" a new replica serving another model caught within 20 windows with p ="
          f" {caught:.4f}; after a long record, with 5 or 50 answers a window:"
          f" {late[5]}, {late[50]}")
    # the continuous engine's replica, sampled and checked the same way
    continuous = 1 - (1 - ep["endpoint_continuous_answers_caught_swapped"]) ** 20
    out["detection_p_20_jobs_endpoint_continuous_swapped_model"] = round(continuous, 4)
    print(f"continuous engine's answers (fingerprints made by one prefill as each ends):"
          f" honest answers judged wrong: {ep['endpoint_continuous_false_positives']}; a"
          f" swapped model's caught per check:"
          f" {ep['endpoint_continuous_answers_caught_swapped']:.2f}; a new replica serving"
          f" another model caught within 20 windows with p = {continuous:.4f}")
    return out
