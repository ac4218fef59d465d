"""Training on several devices of one provider: N processes with torch.distributed (gloo on
the CPU here), data-parallel, checkpointed by rank 0, resumed with the same world size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import training_job

pytestmark = pytest.mark.slow     # two gloo processes train a model: the full lane's

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def runner_job(work: Path, world: int, steps: int = 12, checkpoint_every: int = 0,
               resume: Path | None = None) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.json").write_text(json.dumps({
        "job_id": "direct", "attempt": 1, "kind": "training", "device": "cpu",
        "world_size": world, "checkpoint_every": checkpoint_every,
        "params": {"model_config": "c.json", "dataset": "d.jsonl", "steps": steps,
                   "batch_size": 4, "seq_len": 32, "learning_rate": 3e-3, "seed": 7},
        "inputs": {"c.json": str(EXAMPLES / "data" / "tiny-llama.json"),
                   "d.jsonl": str(EXAMPLES / "data" / "tiny-corpus.jsonl")},
        "resume_from": str(resume) if resume else None}))
    return work


def run(work: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpumarket.provider.runners.training",
                           str(work)], capture_output=True, text=True, timeout=600)


def refusal(work: Path) -> str:
    """What the runner refuses ``work``'s job with: its train() called in this process, the
    refusal a JobError (run_main, every runner's, makes a JobError one line on stderr and
    exit 1: tests/test_runner_job.py). A process per refusal cost a torch import each, about a minute of
    this test's time at load 20 here. What train() sets for the whole process (its seeds,
    torch's deterministic mode) is put back."""
    import random

    import numpy as np
    import torch

    from gpumarket.provider.runners import training
    from gpumarket.provider.runners.report import Reporter

    kept = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        with pytest.raises(training.JobError) as refused:
            training.train(work, Reporter())
    finally:
        random.setstate(kept[0])
        np.random.set_state(kept[1])
        torch.set_rng_state(kept[2])
        torch.use_deterministic_algorithms(kept[3], warn_only=kept[4])
    return str(refused.value)


def losses(work: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in
            (work / "outputs" / "loss.jsonl").read_text().splitlines()]


def test_two_gloo_processes_train_what_one_would_and_resume(tmp_path):
    one = runner_job(tmp_path / "one", 1)
    assert run(one).returncode == 0
    two = runner_job(tmp_path / "two", 2, checkpoint_every=6)
    r = run(two)
    assert r.returncode == 0, r.stderr
    assert "torch.distributed: 2 processes (gloo)" in r.stdout
    metrics = json.loads((two / "outputs" / "metrics.json").read_text())
    assert metrics["processes"] == 2
    # Each process trains on half of the same global batch and the gradients are averaged:
    # the loss curve is the single process's, up to float summation order.
    assert losses(two) == pytest.approx(losses(one), abs=2e-4)
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step-00000006"]

    resumed = runner_job(tmp_path / "resumed", 2, checkpoint_every=6,
                         resume=two / "checkpoints" / "step-00000006")
    r = run(resumed)
    assert r.returncode == 0, r.stderr
    assert losses(resumed) == pytest.approx(losses(two), abs=2e-4)

    other = runner_job(tmp_path / "other", 1, resume=two / "checkpoints" / "step-00000006")
    assert refusal(other) == "the checkpoint was written by 2 processes; this attempt has 1"

    odd = runner_job(tmp_path / "odd", 3)
    assert "batch_size 4 does not split evenly over 3 devices" in refusal(odd)


@pytest.mark.e2e
def test_a_two_device_job_on_a_provider_with_two_cpu_devices(market, tmp_path):
    market.start_provider("p1", 1.0, "--cpu-devices", "2")
    offers = market.wait_for_offers(1)
    assert offers[0]["gpus"] == 2
    path = training_job(tmp_path / "job.toml", steps=12, checkpoint_every=6,
                        accelerator="cpu")
    path.write_text(path.read_text().replace("gpus = 1", "gpus = 2"))
    r = market.cli("submit", str(path))
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.split()[0]
    market.wait_state(job_id, "SUCCEEDED", timeout=300)
    r = market.cli("results", job_id, "-o", str(tmp_path / "out"), "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["metrics"]["processes"] == 2
    assert summary["device_seconds"] == pytest.approx(2 * summary["wall_seconds"])
    log = market.cli("logs", job_id).stdout
    assert "torch.distributed: 2 processes (gloo)" in log
