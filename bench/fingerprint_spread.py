"""How far honest activation fingerprints of generated text differ, and how far cheats' do
(kinds/fingerprints.py; docs/verification.md has the figures and the tolerances they set).

    .venv/bin/python bench/fingerprint_spread.py [--rows 16] [--tokens 64]

A provider generates (greedy, the generate runner's recording: fingerprint.Recorder around
``model.generate``) at batch 1, 4 or 8, on 1 or 2 threads, in float32 or bfloat16; a checker
runs one prefill (fingerprint.prefill) of prompt + the provider's tokens at another batch
size, thread count and dtype. Per pair: the least overlap of top-k indices, the largest mean
and max value error (kinds/fingerprints.difference) over every fingerprint, and the largest
token gap (the provider's token's logit below the replay's top, in standard deviations).
An endpoint's batch engine answering the same prompts together (float32, bfloat16) is
checked the same way. Then the cheats, each checked by an honest float32 prefill: another random init of the same
architecture (a swapped model), the float32 model's weights rounded to bfloat16 and run in
float32 (passed off as float32), one token of each row altered (text and fingerprints kept
as if honest, or recomputed for the altered tokens), random tokens. Two models: the tests'
tiny Llama (hidden 64, k 16) and a wider random Llama (hidden 512, k 128).

Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [
    "the quick brown fox", "a marketplace for idle gpus", "providers advertise devices",
    "checkpoints let a job resume", "the broker matches each job", "rendering jobs and",
    "training inference and", "a price and the broker", "jumps over the lazy dog",
    "idle gpus runs training", "resume on another provider", "after a failure the",
    "devices with a price", "the lazy dog jumps", "a job resume on", "runs inference",
]


def wide_llama(target: Path, seed: int) -> Path:
    """A 4-layer, 512-wide random Llama with the tests' tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tests.models import tiny_causal_lm

    tiny = tiny_causal_lm(target / "tok")
    tok = AutoTokenizer.from_pretrained(tiny)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1024,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    out = target / f"wide-{seed}"
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def load(model_dir: Path, dtype: str, round_bf16: bool = False):
    import torch

    from gpumarket.provider.runners.generate import load as runner_load

    tokenizer, model = runner_load(model_dir, torch.device("cpu"), getattr(torch, dtype))
    if round_bf16:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
    return tokenizer, model


def generate(tokenizer, model, prompts: list[str], batch: int, threads: int, tokens: int):
    """(prompt ids, generated ids, fingerprints) per prompt, as the generate runner records
    them, and the seconds generating took."""
    import torch

    from gpumarket.provider.runners.fingerprint import Recorder

    torch.set_num_threads(threads)
    out, began = [], time.perf_counter()
    for start in range(0, len(prompts), batch):
        rows = prompts[start:start + batch]
        enc = tokenizer(rows, return_tensors="pt", padding=True)
        with torch.inference_mode(), Recorder(model) as rec:
            ids = model.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)
        gen = ids[:, enc["input_ids"].shape[1]:].tolist()
        prints = rec.rows([len(g) for g in gen])
        for r, text in enumerate(rows):
            out.append((tokenizer(text)["input_ids"], gen[r], prints[r]))
    return out, time.perf_counter() - began


def check(model, rows, batch: int, threads: int):
    """fingerprint.prefill of (prompt ids, generated ids) rows in batches; and its seconds."""
    import torch

    from gpumarket.provider.runners.fingerprint import prefill

    torch.set_num_threads(threads)
    out, began = [], time.perf_counter()
    for start in range(0, len(rows), batch):
        out += prefill(model, rows[start:start + batch], torch.device("cpu"))
    return out, time.perf_counter() - began


def row_figures(claimed, replay) -> list[dict]:
    """Per row, its worst figures over its fingerprints."""
    from gpumarket.kinds import fingerprints as fp

    out = []
    for (_, _, want), (have, gap) in zip(claimed, replay):
        row = {"overlap": 1.0, "mean_err": 0.0, "max_err": 0.0, "token_gap": gap}
        for w, h in zip(want, have):
            overlap, mean_err, max_err = fp.difference(fp.decode(w), fp.decode(h))
            row["overlap"] = min(row["overlap"], overlap)
            row["mean_err"] = max(row["mean_err"], mean_err)
            row["max_err"] = max(row["max_err"], max_err)
        out.append(row)
    return out


def spread(claimed, replay) -> dict:
    """The worst figures over every fingerprint of every row (an honest pair's spread)."""
    rows = row_figures(claimed, replay)
    return {"overlap": min(r["overlap"] for r in rows),
            **{k: max(r[k] for r in rows) for k in ("mean_err", "max_err", "token_gap")}}


def weakest(claimed, replay) -> dict:
    """Over the rows, the least of each row's worst figure (a cheat's closest row)."""
    rows = row_figures(claimed, replay)
    return {"overlap": max(r["overlap"] for r in rows),
            **{k: min(r[k] for r in rows) for k in ("mean_err", "max_err", "token_gap")}}


def judged(claimed, replay, dtype: str, greedy: bool = True) -> tuple[int, int]:
    """(rows judged wrong, rows) under the tolerance for a job asking ``dtype``."""
    from gpumarket.kinds import fingerprints as fp

    tol, limit, wrong = fp.tolerance(dtype), fp.token_gap_limit(dtype), 0
    for (_, _, want), (have, gap) in zip(claimed, replay):
        same, _ = fp.same_fingerprints(want, have, tol)
        wrong += not same or (greedy and gap > limit)
    return wrong, len(claimed)


def serve(model_dir: Path, dtype: str, prompts: list[str], tokens: int):
    """The prompts answered together by an endpoint's batch engine (rows joining between
    decode steps, engine.Stream's recording), greedy: (prompt ids, token ids, fingerprints)
    per prompt, as a check of sampled answers would get them."""
    import asyncio

    from gpumarket.kinds.engine_protocol import Complete, Final
    from gpumarket.kinds.runner_job import RunnerJob
    from gpumarket.provider.runners.engine import load_engine

    params = {"model": "", "model_name": model_dir.name, "task": "", "dtype": dtype,
              "max_seq_len": 0, "max_concurrency": 8, "engine": "batch",
              "trust_remote_code": False}

    async def run() -> list:
        engine = load_engine(RunnerJob(params=params, model_dir=str(model_dir)), model_dir)
        out: dict = {}

        async def one(i: int) -> None:
            await asyncio.sleep(0.005 * i)
            async for event in engine.complete(f"r{i}", Complete(
                    prompt=prompts[i], max_tokens=tokens, temperature=0)):
                if isinstance(event, Final):
                    out[i] = event
        try:
            await asyncio.gather(*(one(i) for i in range(len(prompts))))
        finally:
            await engine.close()
        return [out[i] for i in range(len(prompts))]

    tok = load(model_dir, "float32")[0]
    return [(tok(p)["input_ids"], f.token_ids, f.fingerprints)
            for p, f in zip(prompts, asyncio.run(run()))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    from tests.models import tiny_causal_lm

    prompts = (PROMPTS * ((args.rows + len(PROMPTS) - 1) // len(PROMPTS)))[:args.rows]
    rng = random.Random(7)
    figures: dict = {}
    honest_rows = honest_wrong = 0
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny": (tiny_causal_lm(Path(tmp) / "tiny0", 0),
                           tiny_causal_lm(Path(tmp) / "tiny1", 1)),
                  "wide": (wide_llama(Path(tmp), 0), wide_llama(Path(tmp), 1))}
        for name, (right, other) in models.items():
            loaded = {d: load(right, d) for d in ("float32", "bfloat16")}
            tok = loaded["float32"][0]
            runs = {}
            for dtype in ("float32", "bfloat16"):
                for batch, threads in ((1, 1), (4, 2), (8, 2)):
                    runs[(dtype, batch, threads)] = generate(
                        tok, loaded[dtype][1], prompts, batch, threads, args.tokens)
            print(f"\n{name}: honest generate (dtype, batch, threads) checked by a prefill"
                  f" (dtype, batch, threads): worst over {len(prompts)} rows")
            print(f"{'generated':<22}{'prefill':<22}{'overlap':>8}{'mean_err':>10}"
                  f"{'max_err':>10}{'token_gap':>10}{'wrong':>7}")
            worst = {}
            for (gd, gb, gt), (claimed, gen_s) in runs.items():
                for cd, cb, ct in (("float32", 8, 2), ("float32", 1, 1), ("bfloat16", 8, 2),
                                   ("bfloat16", 2, 1)):
                    if (gd, gb) == (cd, cb):
                        continue
                    rows = [(p, g) for p, g, _ in claimed]
                    replay, check_s = check(loaded[cd][1], rows, cb, ct)
                    s = spread(claimed, replay)
                    # a job that asked float32, provider and checker both float32: tight
                    job_dtype = "float32" if gd == cd == "float32" else "auto"
                    wrong, n = judged(claimed, replay, job_dtype)
                    honest_rows, honest_wrong = honest_rows + n, honest_wrong + wrong
                    cls = "float32" if job_dtype == "float32" else "half"
                    w = worst.setdefault(cls, {"overlap": 1.0, "mean_err": 0.0,
                                               "max_err": 0.0, "token_gap": 0.0})
                    w["overlap"] = min(w["overlap"], s["overlap"])
                    for key in ("mean_err", "max_err", "token_gap"):
                        w[key] = max(w[key], s[key])
                    print(f"{f'{gd} b{gb} t{gt}':<22}{f'{cd} b{cb} t{ct}':<22}"
                          f"{s['overlap']:>8.2f}{s['mean_err']:>10.1e}{s['max_err']:>10.1e}"
                          f"{s['token_gap']:>10.3f}{wrong:>5}/{n}")
                    if (gd, gb, gt, cd, cb) == ("float32", 8, 2, "float32", 1):
                        figures[f"{name}_prefill_over_generate"] = check_s / gen_s
            for dtype in ("float32", "bfloat16"):
                answers = serve(right, dtype, prompts, args.tokens)
                replay, _ = check(loaded["float32"][1], [(p, g) for p, g, _ in answers], 8, 2)
                s = spread(answers, replay)
                job_dtype = "float32" if dtype == "float32" else "auto"
                wrong, n = judged(answers, replay, job_dtype)
                honest_rows, honest_wrong = honest_rows + n, honest_wrong + wrong
                print(f"{f'endpoint {dtype}':<22}{'float32 b8 t2':<22}{s['overlap']:>8.2f}"
                      f"{s['mean_err']:>10.1e}{s['max_err']:>10.1e}{s['token_gap']:>10.3f}"
                      f"{wrong:>5}/{n}")
                figures[f"{name}_endpoint_{dtype}_honest"] = s
            figures[f"{name}_honest_worst"] = worst

            # cheats, each checked by an honest float32 prefill at batch 8
            honest, _ = runs[("float32", 8, 2)]
            rows = [(p, g) for p, g, _ in honest]
            cheats = {}
            _, swapped = load(other, "float32")
            cheats["swapped_model"], _ = generate(tok, swapped, prompts, 8, 2, args.tokens)
            _, rounded = load(right, "float32", round_bf16=True)
            cheats["bf16_rounded_as_float32"], _ = generate(tok, rounded, prompts, 8, 2,
                                                            args.tokens)
            altered = []
            for p, g, prints in honest:
                g = list(g)
                j = rng.randrange(len(g))
                g[j] = (g[j] + 1 + rng.randrange(len(tok) - 1)) % len(tok)
                altered.append((p, g, prints))
            cheats["one_token_altered"] = altered
            refit, _ = check(loaded["float32"][1], [(p, g) for p, g, _ in altered], 8, 2)
            cheats["one_token_altered_refingerprinted"] = [
                (p, g, prints) for (p, g, _), (prints, _) in zip(altered, refit)]
            randoms = [(p, [rng.randrange(len(tok)) for _ in g], prints)
                       for p, g, prints in honest]
            refit, _ = check(loaded["float32"][1], [(p, g) for p, g, _ in randoms], 8, 2)
            cheats["random_tokens_refingerprinted"] = [
                (p, g, prints) for (p, g, _), (prints, _) in zip(randoms, refit)]
            print(f"\n{name}: cheats checked by an honest float32 prefill: the row closest to"
                  " honest (largest overlap, least errors), and rows caught under the float32"
                  " tolerance / the half one")
            for cheat, claimed in cheats.items():
                replay, _ = check(loaded["float32"][1], [(p, g) for p, g, _ in claimed], 8, 2)
                s = weakest(claimed, replay)
                tight = judged(claimed, replay, "float32")[0]
                loose = judged(claimed, replay, "auto")[0]
                print(f"  {cheat:<36} overlap {s['overlap']:.2f}  mean_err {s['mean_err']:.1e}"
                      f"  max_err {s['max_err']:.1e}  token_gap {s['token_gap']:.2f}"
                      f"  caught {tight}/{len(claimed)} / {loose}/{len(claimed)}")
                figures[f"{name}_{cheat}_caught_float32"] = tight / len(claimed)
                figures[f"{name}_{cheat}_caught_half"] = loose / len(claimed)
    figures["honest_rows_judged"] = honest_rows
    figures["false_positives"] = honest_wrong
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
