"""How far honest sampled rows' draw figures go, and how far cheats' (kinds/draws.py;
docs/verification.md has the figures and the limits they set).

    .venv/bin/python bench/sampled_spread.py [--rows 16] [--tokens 48]

A provider samples (``model.generate`` as the generate runner calls it: temperature, top_p,
top_k off) at batch 1, 4 or 8, on 1 or 2 threads, in float32 or bfloat16, at several
temperatures and top_p; a checker runs one float32 prefill (fingerprint.prefill_rows) of
prompt + the provider's tokens at batch 4 on 2 threads, with each row's sampling. Per
setting: the largest nucleus excess ("outside"), the least p-value of the least u and of
Fisher's statistic over the rows (kinds/draws.p_values), and rows judged wrong. Then the
cheats, checked the same way: 1, 2 or 3 tokens of each row swapped for tokens the model
found unlikely (drawn from the least likely tenth of the vocabulary at that position, at
temperature 1), and rows sampled by another random init of the same architecture. Models
(``--models``): the tests' tiny Llama (hidden 64), a wider random Llama (hidden 512), and
"peaked": the tiny Llama with its output embedding scaled by PEAK (a random init's logits
have a standard deviation of 0.16, nearly uniform over the vocabulary; a trained model's
are peaked, which is what makes an unlikely token unlikely; scaled, about 4).

Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fingerprint_spread import PROMPTS, load, wide_llama  # noqa: E402

SETTINGS = [(0.3, 1.0), (0.7, 0.9), (1.0, 1.0), (1.0, 0.5), (1.5, 0.95)]
PEAK = 25.0
PROVIDERS = [(1, 1, "float32"), (4, 2, "float32"), (8, 1, "bfloat16"), (4, 2, "bfloat16")]


def sample(tokenizer, model, prompts, batch, threads, tokens, temperature, top_p, seed):
    """(prompt ids, generated ids) per prompt, sampled as the generate runner samples."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    out = []
    for start in range(0, len(prompts), batch):
        rows = prompts[start:start + batch]
        enc = tokenizer(rows, return_tensors="pt", padding=True)
        with torch.inference_mode():
            ids = model.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens,
                                 do_sample=True, temperature=temperature, top_p=top_p,
                                 top_k=None, pad_token_id=tokenizer.pad_token_id)
        for r, text in enumerate(rows):
            out.append((tokenizer(text)["input_ids"], ids[r, enc["input_ids"].shape[1]:]
                        .tolist()))
    return out


def check(model, rows, temperature, top_p, batch=4, threads=2) -> list[dict]:
    import torch

    from gpumarket.provider.runners.fingerprint import prefill_rows

    torch.set_num_threads(threads)
    out = []
    for start in range(0, len(rows), batch):
        part = rows[start:start + batch]
        out += [r["draws"] for r in prefill_rows(model, part, torch.device("cpu"),
                                                   [(temperature, top_p)] * len(part))]
    return out


def summary(draws: list[dict], dtype: str) -> dict:
    from gpumarket.kinds import draws as dr

    ps = [dr.p_values(d) for d in draws]
    return {"outside": max(d["outside"] for d in draws),
            "p_least": min(p for p, _ in ps), "p_fisher": min(p for _, p in ps),
            "wrong": sum(not dr.judge(d, dtype)[0] for d in draws)}


def swapped(model, rows, n_swaps: int, rng: random.Random):
    """Each row with ``n_swaps`` tokens replaced by ones from the least likely tenth of the
    vocabulary at that position (the right model's logits at temperature 1)."""
    import torch

    from gpumarket.provider.runners.fingerprint import _forward

    out = []
    for p, g in rows:
        logits, _, _, _ = _forward(model, [(p, g)], torch.device("cpu"), len(g) + 1)
        logits = logits[0, -len(g) - 1:-1]
        g = list(g)
        for j in rng.sample(range(len(g)), n_swaps):
            order = logits[j].argsort().tolist()          # least likely first
            g[j] = rng.choice(order[:max(1, len(order) // 10)])
        out.append((p, g))
    return out


def peaked(target: Path, seed: int) -> Path:
    """The tests' tiny Llama of ``seed`` with its output embedding scaled by PEAK."""
    from safetensors.torch import load_file, save_file

    from tests.models import tiny_causal_lm

    out = tiny_causal_lm(target / f"peaked-{seed}", seed)
    weights = load_file(out / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * PEAK
    save_file({k: v.contiguous() for k, v in weights.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--models", default="tiny,wide,peaked")
    args = ap.parse_args()
    from tests.models import tiny_causal_lm

    prompts = PROMPTS[:args.rows]
    root = Path(tempfile.mkdtemp(prefix="sampled-spread-"))
    figures: dict = {"honest_rows": 0, "false_positives": 0, "outside_max": {},
                     "p_least_min": 1.0, "p_fisher_min": 1.0}
    rng = random.Random(7)
    makers = {"tiny": lambda seed: tiny_causal_lm(root / f"r{seed}", seed),
              "wide": lambda seed: wide_llama(root, seed),
              "peaked": lambda seed: peaked(root, seed)}
    for name in args.models.split(","):
        right, other = makers[name](0), makers[name](1)
        tok, checker = load(right, "float32")
        print(f"== {name}: honest (checked float32, batch 4, 2 threads)")
        for temperature, top_p in SETTINGS:
            for batch, threads, dtype in PROVIDERS:
                _, model = load(right, dtype)
                rows = sample(tok, model, prompts, batch, threads, args.tokens, temperature,
                              top_p, seed=batch * 10 + threads)
                s = summary(check(checker, rows, temperature, top_p), "" if dtype !=
                            "float32" else "float32")
                print(f"  T {temperature:<4} top_p {top_p:<5} batch {batch} threads {threads}"
                      f" {dtype:<9} outside {s['outside']:.4f}  p_least {s['p_least']:.1e}"
                      f"  p_fisher {s['p_fisher']:.1e}  wrong {s['wrong']}")
                key = "float32" if dtype == "float32" else "half"
                figures["outside_max"][key] = max(figures["outside_max"].get(key, 0.0),
                                                  s["outside"])
                figures["p_least_min"] = min(figures["p_least_min"], s["p_least"])
                figures["p_fisher_min"] = min(figures["p_fisher_min"], s["p_fisher"])
                figures["honest_rows"] += len(rows)
                figures["false_positives"] += s["wrong"]
        _, model = load(right, "float32")
        _, cheat = load(other, "float32")
        print(f"== {name}: cheats (float32 provider, checked float32)")
        for temperature, top_p in SETTINGS:
            rows = sample(tok, model, prompts, 4, 2, args.tokens, temperature, top_p, 1)
            for n in (1, 2, 3):
                s = summary(check(checker, swapped(checker, rows, n, rng), temperature,
                                  top_p), "")
                key = f"{name}_swap{n}_caught"
                figures.setdefault(key, []).append(s["wrong"] / len(rows))
                print(f"  T {temperature:<4} top_p {top_p:<5} {n} swapped: caught"
                      f" {s['wrong']}/{len(rows)}  p_least {s['p_least']:.1e}")
            rows = sample(tok, cheat, prompts, 4, 2, args.tokens, temperature, top_p, 1)
            s = summary(check(checker, rows, temperature, top_p), "")
            figures.setdefault(f"{name}_other_model_caught", []).append(
                s["wrong"] / len(rows))
            print(f"  T {temperature:<4} top_p {top_p:<5} another model: caught"
                  f" {s['wrong']}/{len(rows)}  p_fisher {s['p_fisher']:.1e}")
    figures.update(detection(figures))
    print(json.dumps(figures))
    return 0


def detection(figures: dict) -> dict:
    """detection_p_20_jobs_generate_sampled_* (bench/verification.py's measure): a new
    provider doctoring every job so, checked at the real rate, a check of one batch (here:
    the 8 rows) catching it if any of its rows is caught; per class, at its worst sampling
    setting, on each model measured."""
    from bench.verification import simulate_jobs

    out = {}
    for key, shares in figures.items():
        if key.endswith("_caught") and isinstance(shares, list):
            p = 1.0 if min(shares) > 0 else 0.0
            name = key[:-len("_caught")]
            out[f"detection_p_20_jobs_generate_sampled_{name}"] = round(
                simulate_jobs(p, 20, 20_000, 5), 4)
            # the settings with a nucleus (top_p < 1) alone
            nucleus = [c for c, (_, top_p) in zip(shares, SETTINGS) if top_p < 1]
            out[f"detection_p_20_jobs_generate_sampled_{name}_top_p"] = round(
                simulate_jobs(1.0 if min(nucleus) > 0 else 0.0, 20, 20_000, 5), 4)
    return out


if __name__ == "__main__":
    sys.exit(main())
