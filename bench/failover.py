"""Failover benchmark: a training job on a local marketplace with two providers; the running
provider's machine is killed (daemon and job, SIGKILL) N times at random points and restarted.
The same job also runs once without failures, in the same run, as the baseline.

    .venv/bin/python bench/failover.py [--kills 3] [--steps 3000] [--lease-timeout 15]

Prints per-failure figures, then one JSON line with resume_s_p50, resume_s_max,
steps_lost_max, checkpoint_interval_steps, checkpoint_overhead (and the baseline's figures).
Targets: resume within lease timeout + 3 s; at most one checkpoint interval of work lost per
failure; checkpoint overhead at most 3 % at the broker-chosen interval.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers import (Marketplace, events, first_event, job_processes,  # noqa: E402
                           training_job, wait_until)

CONFIG = Path(__file__).resolve().parent / "data" / "small-llama.json"


def job_file(path: Path, steps: int) -> Path:
    # No checkpoint_every: the broker chooses the interval from the provider's MTBF.
    return training_job(path, steps=steps, checkpoint_every=0, config=CONFIG)


def run_job(market: Marketplace, path: Path) -> str:
    r = market.cli("submit", str(path))
    if r.returncode != 0:
        raise SystemExit(f"submit failed: {r.stderr}")
    return r.stdout.split()[0]


def receipt_metrics(market: Marketplace, job_id: str, out: Path) -> dict:
    r = market.cli("results", job_id, "-o", str(out), "--json")
    if r.returncode != 0:
        raise SystemExit(f"results failed: {r.stderr}")
    return json.loads(r.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--lease-timeout", type=float, default=15.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="gpumarket-failover-"))
    market = Marketplace(root)
    try:
        market.start_broker("--lease-timeout", str(args.lease_timeout),
                            "--heartbeat-interval", "1")
        market.cli("keys", "init")
        market.start_provider("p1")
        market.start_provider("p2")
        market.wait_for_offers(2)

        print(f"baseline: {args.steps} steps without failures")
        t0 = time.monotonic()
        base_id = run_job(market, job_file(root / "baseline.toml", args.steps))
        market.wait_state(base_id, "SUCCEEDED", timeout=3600)
        baseline_s = time.monotonic() - t0
        base = receipt_metrics(market, base_id, root / "baseline-out")["metrics"]
        print(f"  {baseline_s:.1f}s end to end, train {base['train_seconds']:.1f}s, "
              f"checkpoint overhead {base['checkpoint_overhead']:.2%}")

        print(f"with failures: {args.kills} kills at random points")
        t0 = time.monotonic()
        job_id = run_job(market, job_file(root / "failing.toml", args.steps))
        failures = []
        for k in range(args.kills):
            job = market.wait_state(job_id, "RUNNING", timeout=600)
            # a random point once it is making progress (and has a checkpoint to lose from)
            wait_until(lambda: int(market.job(job_id)["progress"].get("step", 0)) > 0,
                       "progress", timeout=600)
            time.sleep(rng.uniform(3.0, 12.0))
            job = market.job(job_id)
            if job["state"] != "RUNNING":
                break
            victim = next(n for n in market.providers if market.provider_id(n) == job["provider_id"])
            attempt = int(job["attempt"])
            step_at_kill = int(job["progress"].get("step", 0))
            epoch = len(job.get("attempts", [])) or 1
            killed_at = time.time()
            market.providers[victim].stop(signal.SIGKILL)
            for pid in job_processes(str(root / victim / "jobs")):
                os.kill(pid, signal.SIGKILL)
            # The machine is gone: the lease must expire before the job moves on.
            started = first_event(market, job_id, lambda e: e["type"] == "started"
                                  and int(e.get("attempt", 0)) > attempt, timeout=600)
            progress = first_event(market, job_id, lambda e: e["type"] == "progress"
                                   and int(e.get("attempt", 0)) > attempt, timeout=600,
                                   after_seq=int(started["seq"]))
            # ... and comes back later, as a fresh daemon on the same data dir
            market.start_provider(victim)
            msg = started["message"]
            from_step = int(msg.rsplit(" ", 1)[1]) if "resumed from step" in msg else 0
            resume_s = int(progress["at_ms"]) / 1000 - killed_at
            lost = max(0, step_at_kill - from_step)
            failures.append({"resume_s": resume_s, "steps_lost": lost,
                             "step_at_kill": step_at_kill, "resumed_from": from_step,
                             "epoch": epoch})
            print(f"  kill {k + 1}: at step ~{step_at_kill}; resumed from step {from_step} "
                  f"({lost} steps redone); progress again after {resume_s:.1f}s")
        market.wait_state(job_id, "SUCCEEDED", timeout=3600)
        failing_s = time.monotonic() - t0
        final = receipt_metrics(market, job_id, root / "failing-out")["metrics"]

        evs = events(market, job_id, quiet_s=0.5)
        steps_by_attempt: dict[int, list[int]] = {}
        for e in evs:
            if e["type"] == "checkpoint":
                step = int(e["message"].split("step ", 1)[1].split(" ", 1)[0])
                steps_by_attempt.setdefault(int(e.get("attempt", 1)), []).append(step)
        gaps = [b - a for steps in steps_by_attempt.values() for a, b in zip(steps, steps[1:])]
        interval_steps = statistics.median(gaps) if gaps else float("nan")
        resume = [f["resume_s"] for f in failures]
        figures = {
            "kills": len(failures),
            "lease_timeout_s": args.lease_timeout,
            "resume_s_p50": round(statistics.median(resume), 2) if resume else None,
            "resume_s_max": round(max(resume), 2) if resume else None,
            "steps_lost_max": max((f["steps_lost"] for f in failures), default=0),
            "checkpoint_interval_steps": interval_steps,
            "checkpoint_overhead": round(base["checkpoint_overhead"], 4),
            "checkpoint_overhead_failing_run": round(final["checkpoint_overhead"], 4),
            "baseline_s": round(baseline_s, 1),
            "with_failures_s": round(failing_s, 1),
            "weights_equal_baseline": (root / "baseline-out" / "model.safetensors").read_bytes()
            == (root / "failing-out" / "model.safetensors").read_bytes(),
        }
        print(f"checkpoint interval: median {interval_steps} steps between checkpoints; "
              f"overhead {base['checkpoint_overhead']:.2%} of train time")
        print(json.dumps(figures))
        return 0
    finally:
        market.close()


if __name__ == "__main__":
    sys.exit(main())
