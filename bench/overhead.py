"""Marketplace overhead: the same generate, embed and render work run directly with the
engine (a plain transformers / bpy script in a fresh process) and through a local marketplace
(broker + provider processes, signed job, inputs uploaded, leased, run, results uploaded), in
one run; the ratio is the marketplace's throughput over the engine's own.

    .venv/bin/python bench/overhead.py [--prompts 10000] [--texts 16000] [--frames 24]

The direct run is timed from process start to its output written (imports and model load
included: a user running the engine pays them too); the marketplace run from `gpumarket
submit --watch` starting to it exiting with the job SUCCEEDED (client-side signing, upload,
queueing, lease, the runner's process and its imports, result upload). Sizes are chosen so
that each piece of work lasts about a minute on a 2-core CPU. The last line is one JSON
object with ratio_generate, ratio_embed, ratio_render, the seconds behind them and the
receipts' own figures (tokens/s, TTFT, TPOT, texts/s, s/frame, frames/hour). Target: every
ratio >= 0.95.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GEN = dict(max_tokens=16, batch_size=8)
EMBED_BATCH = 32
RENDER = dict(resolution_x=320, resolution_y=240, samples=32)
# the receipt's own figures, reported beside the ratios
FIGURES = {"generate": ("tokens_per_s", "ttft_s_p50", "tpot_s_p50", "tpot_s_p99"),
           "embed": ("texts_per_s", "tokens_per_s"),
           "render": ("seconds_per_frame", "frames_per_hour")}


# -- the engines, used directly ------------------------------------------------------------

def direct_generate(model_dir: str, prompts_path: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True).eval()
    prompts = [json.loads(line)["prompt"] for line in open(prompts_path)]
    with open(out, "w") as f:
        for i in range(0, len(prompts), GEN["batch_size"]):
            enc = tok(prompts[i:i + GEN["batch_size"]], return_tensors="pt", padding=True)
            with torch.inference_mode():
                ids = model.generate(**enc, max_new_tokens=GEN["max_tokens"], do_sample=False,
                                     pad_token_id=tok.pad_token_id)
            for row in ids[:, enc["input_ids"].shape[1]:]:
                f.write(json.dumps({"completion": tok.decode(row, skip_special_tokens=True)})
                        + "\n")


def direct_embed(model_dir: str, texts_path: str, out: str) -> None:
    import numpy as np
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, use_safetensors=True).eval()
    texts = [json.loads(line)["text"] for line in open(texts_path)]
    vectors = []
    for i in range(0, len(texts), EMBED_BATCH):
        enc = tok(texts[i:i + EMBED_BATCH], return_tensors="pt", padding=True, truncation=True)
        with torch.inference_mode():
            hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        vectors.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
    np.save(out, np.concatenate(vectors))


def direct_render(scene: str, frames: str, out: str) -> None:
    import bpy

    bpy.context.preferences.filepaths.use_scripts_auto_execute = False
    bpy.ops.wm.open_mainfile(filepath=scene, load_ui=False, use_scripts=False)
    s = bpy.context.scene
    s.render.engine, s.cycles.device = "CYCLES", "CPU"
    s.render.resolution_x, s.render.resolution_y = RENDER["resolution_x"], RENDER["resolution_y"]
    s.cycles.samples = RENDER["samples"]
    s.render.image_settings.file_format = "PNG"
    first, last = map(int, frames.split("-"))
    for frame in range(first, last + 1):
        s.frame_set(frame)
        s.render.filepath = f"{out}/frame_{frame:06d}"
        bpy.ops.render.render(write_still=True)


def timed_direct(kind: str, *args: str) -> float:
    began = time.monotonic()
    r = subprocess.run([sys.executable, __file__, "--direct", kind, *args],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise SystemExit(f"direct {kind} failed: {r.stderr[-2000:]}")
    return time.monotonic() - began


# -- the same work through a local marketplace ---------------------------------------------

def timed_market(market, job_file: Path, timeout: float = 3600) -> tuple[float, str]:
    """Seconds from `gpumarket submit --watch` starting to it ending with the job SUCCEEDED:
    what a user waits (one CLI process that streams events, no polling)."""
    began = time.monotonic()
    r = market.cli("submit", str(job_file), "--watch", timeout=timeout)
    seconds = time.monotonic() - began
    job_id = r.stdout.split()[0] if r.stdout.split() else "?"
    if r.returncode != 0:
        raise SystemExit(f"job {job_id} did not succeed: {r.stdout[-1000:]} {r.stderr[-1000:]}")
    return seconds, job_id


def toml_table(kind: str, params: dict) -> str:
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in params.items())
    return f'name = "overhead-{kind}"\nkind = "{kind}"\nmax_price = 5.0\n\n[{kind}]\n{lines}\n'


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10000)
    ap.add_argument("--texts", type=int, default=16000)
    ap.add_argument("--frames", type=int, default=24)
    ap.add_argument("--direct", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.direct:
        kind, *rest = args.direct
        {"generate": direct_generate, "embed": direct_embed, "render": direct_render}[kind](*rest)
        return 0

    from tests.helpers import Marketplace
    from tests.models import copy_minilm, tiny_causal_lm

    root = Path(tempfile.mkdtemp(prefix="gpumarket-overhead-"))
    words = "the quick brown fox jumps over a lazy dog near the river bank".split()
    model = tiny_causal_lm(root / "tiny-lm")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(
        words[(i + k) % len(words)] for k in range(2 + i % 6))}) + "\n"
        for i in range(args.prompts)))
    minilm = copy_minilm(root / "minilm")
    texts = root / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": " ".join(
        words[(i * 7 + k) % len(words)] for k in range(4 + i % 12))}) + "\n"
        for i in range(args.texts)))
    scene = root / "scene.blend"
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_scene.py"), str(scene),
                    "--frames", str(args.frames)], check=True, capture_output=True)
    (root / "frames").mkdir()

    figures: dict[str, float] = {}
    print("direct: the engines alone")
    figures["direct_generate_s"] = timed_direct("generate", str(model), str(prompts),
                                                str(root / "direct.jsonl"))
    figures["direct_embed_s"] = timed_direct("embed", str(minilm), str(texts),
                                             str(root / "direct.npy"))
    figures["direct_render_s"] = timed_direct("render", str(scene), f"1-{args.frames}",
                                              str(root / "frames"))
    for kind in ("generate", "embed", "render"):
        print(f"  {kind}: {figures[f'direct_{kind}_s']:.1f}s")

    jobs = {
        "generate": toml_table("generate", {"model": str(model), "prompts": str(prompts),
                                            **GEN, "checkpoint_every": 10_000}),
        "embed": toml_table("embed", {"model": str(minilm), "texts": str(texts),
                                      "batch_size": EMBED_BATCH, "output_format": "npy",
                                      "checkpoint_every": 1_000_000}),
        "render": toml_table("render", {"scene": str(scene), "frame_start": 1,
                                        "frame_end": args.frames, "device": "cpu",
                                        **RENDER, "checkpoint_every": 100_000}),
    }
    (root / "market").mkdir()
    market = Marketplace(root / "market")
    try:
        market.start_broker()
        market.cli("keys", "init")
        market.start_provider("p1")
        market.wait_for_offers(1)
        print("through the marketplace: submit to SUCCEEDED")
        for kind, text in jobs.items():
            path = root / f"{kind}.toml"
            path.write_text(text)
            seconds, job_id = timed_market(market, path)
            figures[f"market_{kind}_s"] = seconds
            r = market.cli("results", job_id, "-o", str(root / f"{kind}-out"), "--json")
            receipt = json.loads(r.stdout)["metrics"] if r.returncode == 0 else {}
            for key in FIGURES[kind]:
                if key in receipt:
                    figures[f"{kind}_{key}"] = receipt[key]
            figures[f"ratio_{kind}"] = figures[f"direct_{kind}_s"] / seconds
            print(f"  {kind}: {seconds:.1f}s (job {job_id}), throughput ratio"
                  f" {figures[f'ratio_{kind}']:.3f}")
    finally:
        market.close()
    figures = {k: round(v, 4) for k, v in figures.items()}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
