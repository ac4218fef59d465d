"""Colocated TTFT on slices of one CPU (issue 35, ``colocated_ttft_p99_ratio``): real
processes on this machine — a broker, one provider offering its CPU whole and as two slices
(``--slices 2``, a core each), an endpoint of one replica (the tiny 2-layer Llama of
tests/models.py) that the broker places on one slice — measured through the broker's
OpenAI-compatible API: TTFT p99 of streamed completions arriving as a Poisson process, alone,
and while a training job (the same tiny model, placed on the other slice) runs. Rounds
alternate alone / colocated, so that load from outside (other work on the host) falls on both
sides alike; each side's p99 is over all of its rounds' requests.

    .venv/bin/python bench/colocated.py [--rounds 3] [--duration 15] [--rate 4] [--tokens 16]

Prints its figures and the host's load average (uptime) before and after; the last line is
one JSON object: colocated_ttft_p99_ratio (colocated p99 / alone p99), both p99s and p50s in
ms, the replica's and the training's devices, and the loads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serving import create, key_for, open_loop, pct, ready_count, timing

from tests.helpers import LEASE_ARGS, Marketplace, training_job, wait_until
from tests.models import tiny_causal_lm

PROMPT = "a marketplace for idle gpus"


def load_average() -> float:
    return os.getloadavg()[0]


def leases(market: Marketplace) -> dict[str, list[int]]:
    """The broker's active leases: job id -> device indices (read from its database)."""
    db = sqlite3.connect(f"file:{market.root / 'broker' / 'broker.db'}?mode=ro", uri=True)
    try:
        return {job: json.loads(devices) for job, devices in db.execute(
            "SELECT job_id, device_indices FROM leases WHERE state = 'active'")}
    finally:
        db.close()


async def measure(base: str, key: str, name: str, rate: float, duration: float, tokens: int,
                  seed: int) -> list[float]:
    """TTFTs (s) of streamed completions arriving at ``rate``/s for ``duration`` s."""
    import openai

    api = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=300)

    async def send(i: int) -> dict:
        start, pieces = time.perf_counter(), []
        try:
            stream = await api.chat.completions.create(
                model=name, max_tokens=tokens, temperature=0, stream=True,
                messages=[{"role": "user", "content": PROMPT}])
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(time.perf_counter())
        except openai.APIError as exc:
            return {"error": str(exc), "ttft": 0, "tpot": 0, "tokens": 0}
        return timing(start, pieces, len(pieces))

    samples, _ = await open_loop(send, rate, duration, seed)
    await api.close()
    failed = [s for s in samples if s.get("error")]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed: {failed[0]['error']}")
    return [s["ttft"] for s in samples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alone/colocated pairs")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per side a round")
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s")
    parser.add_argument("--tokens", type=int, default=16, help="max_tokens per request")
    args = parser.parse_args()
    load_before = load_average()
    print(f"load average before: {load_before:.2f} ({os.cpu_count()} CPUs)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = tiny_causal_lm(root / "models" / "tiny-llama")
        root.chmod(0o755)
        for path in (root / "models", model, *model.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)   # readable by the jobs' own uids
        (root / "market").mkdir()
        # The provider on every core (its slices are a core each), not one (tests' taskset).
        market = Marketplace(root / "market", {"TESTS_PROVIDER_CPUS": "all"})
        os.environ["TESTS_PROVIDER_CPUS"] = "all"
        try:
            market.start_broker(*LEASE_ARGS, "--http", "127.0.0.1:0")
            info = json.loads((market.root / "broker" / "broker.json").read_text())
            base = f"http://{info['http']}/v1"
            assert market.cli("keys", "init").returncode == 0
            market.start_provider("p1", 1.0, "--cpu-only", "--slices", "2",
                                  "--models-dir", str(root / "models"))
            market.wait_for_offers(1)
            create(market, root / "e.toml", "colo", model_name="tiny-llama",
                   max_concurrency=4, max_seq_len=128, min_replicas=1, max_replicas=1)
            wait_until(lambda: ready_count(market, "colo") == 1, "a replica", 300, 0.5)
            key = key_for(market, "colo")
            (replica_devices,) = leases(market).values()
            asyncio.run(measure(base, key, "colo", args.rate, 3, args.tokens, 0))  # warm-up
            alone: list[float] = []
            colocated: list[float] = []
            training_devices: list[int] = []
            for r in range(args.rounds):
                alone += asyncio.run(measure(base, key, "colo", args.rate, args.duration,
                                             args.tokens, 10 + r))
                job_file = training_job(root / f"train{r}.toml", steps=1_000_000,
                                        checkpoint_every=1_000_000, max_price=5.0)
                done = market.cli("submit", str(job_file))
                if done.returncode != 0:
                    raise SystemExit(done.stderr)
                job_id = done.stdout.split()[0]
                market.wait_state(job_id, "RUNNING", timeout=300)
                wait_until(lambda j=job_id: int(market.job(j).get("progress", {})
                                                .get("step", 0)) > 0, "training steps", 120, 0.2)
                training_devices = leases(market)[job_id]
                colocated += asyncio.run(measure(base, key, "colo", args.rate,
                                                 args.duration, args.tokens, 10 + r))
                still = market.job(job_id)["state"]
                market.cli("cancel", job_id)
                market.wait_state(job_id, "CANCELLED", timeout=120)
                wait_until(lambda j=job_id: j not in leases(market), "the training's lease", 60)
                print(f"round {r + 1}: alone p99 {pct(alone, 0.99) * 1000:.0f} ms,"
                      f" colocated p99 {pct(colocated, 0.99) * 1000:.0f} ms (training"
                      f" {still.lower()} throughout)", flush=True)
        finally:
            market.close()
    load_after = load_average()
    out = {
        "colocated_ttft_p99_ratio": round(pct(colocated, 0.99) / pct(alone, 0.99), 3),
        "alone_ttft_p99_ms": round(pct(alone, 0.99) * 1000, 1),
        "colocated_ttft_p99_ms": round(pct(colocated, 0.99) * 1000, 1),
        "alone_ttft_p50_ms": round(pct(alone, 0.5) * 1000, 1),
        "colocated_ttft_p50_ms": round(pct(colocated, 0.5) * 1000, 1),
        "requests_per_side": len(alone),
        "replica_devices": replica_devices,
        "training_devices": training_devices,
        "load_before": round(load_before, 2),
        "load_after": round(load_after, 2),
    }
    print(f"TTFT p99: alone {out['alone_ttft_p99_ms']} ms, with a training job on the other"
          f" slice {out['colocated_ttft_p99_ms']} ms: ratio {out['colocated_ttft_p99_ratio']}"
          f" (target <= 1.2); replica on device {replica_devices}, training on"
          f" {training_devices}; load average {load_before:.2f} before, {load_after:.2f}"
          " after", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
