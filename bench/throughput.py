"""Many small jobs: a job array of no-op ``script`` tasks through a real local broker and two
real providers (TLS, signed calls and leases, every task transition committed to SQLite),
beside Ray running as many no-op tasks on the same machine in the same run; and a training
sweep as one array against the same trainings submitted as separate jobs.

    .venv/bin/python bench/throughput.py [--tasks 10000] [--sweep 100] [--separate 6]

Ray runs in the interpreter that $RAY_PYTHON names (Ray pins its own dependencies: keep it
in a virtual environment of its own), or in this one if it can import ray; without either
its figures are null. The last line is one JSON object: tasks_per_s, ray_tasks_per_s,
ratio_vs_ray, array_speedup and the latencies.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.helpers import Marketplace, training_job, wait_until  # noqa: E402

NOOP = "pass\n"
RAY_SCRIPT = r"""
import json, sys, time
import ray
n = int(sys.argv[1])
ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
@ray.remote
def noop(i):
    return i
ray.get([noop.remote(i) for i in range(100)])        # workers started
began = time.perf_counter()
pending = {noop.remote(i): time.perf_counter() for i in range(n)}
done = []
while pending:
    ready, _ = ray.wait(list(pending), num_returns=min(len(pending), 256), timeout=10)
    now = time.perf_counter()
    done += [now - pending.pop(r) for r in ready]
wall = time.perf_counter() - began
done.sort()
print(json.dumps({"wall_s": wall, "p50_ms": done[len(done) // 2] * 1000,
                  "p99_ms": done[int(len(done) * 0.99) - 1] * 1000}))
"""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def submit(market: Marketplace, path: Path) -> str:
    r = market.cli("submit", str(path))
    if r.returncode != 0:
        raise SystemExit(f"submit failed: {r.stderr.strip()}")
    return r.stdout.split()[0]


def submit_and_watch(market: Marketplace, path: Path) -> dict:
    """``gpumarket submit --watch --json``: one client process that submits and follows the
    job's events to its end (what a user runs; no polling processes beside the work)."""
    r = market.cli("submit", str(path), "--watch", "--json", timeout=3600)
    found = re.search(r'"job_id": "(\w+)"', r.stdout)
    if found is None:
        raise SystemExit(f"submit failed: {r.stderr.strip()}")
    last = json.loads(r.stdout.strip().splitlines()[-1])      # its events: one a line
    return {"job_id": found[1], "state": last["state"], "error": r.stderr.strip()[-300:]}


def all_tasks(market: Marketplace, job_id: str, count: int) -> list[dict]:
    r = market.cli("tasks", job_id, "--limit", str(count), "--json")
    if r.returncode != 0:
        raise SystemExit(f"tasks failed: {r.stderr.strip()}")
    return json.loads(r.stdout)["tasks"]


def noop_array(market: Marketplace, root: Path, tasks: int) -> dict:
    (root / "noop.py").write_text(NOOP)
    (root / "noop.jsonl").write_text("{}\n" * tasks)
    path = root / "noop.toml"
    path.write_text(f"""
name = "noop-array"
kind = "script"
max_price = 2.0
budget = 100

[script]
code = "{root / 'noop.py'}"

[array]
tasks = "{root / 'noop.jsonl'}"
""")
    began_ms = time.time() * 1000
    began = time.perf_counter()
    job = submit_and_watch(market, path)
    wall = time.perf_counter() - began
    job_id = job["job_id"]
    job = market.job(job_id)
    if job["state"] != "SUCCEEDED":
        raise SystemExit(f"the no-op array ended {job['state']}: {job.get('error')}")
    lat = [(t["updated_at_ms"] - began_ms) / 1000 for t in all_tasks(market, job_id, tasks)]
    return {"wall_s": wall, "tasks_per_s": tasks / wall, "p50_ms": pct(lat, 0.5) * 1000,
            "p99_ms": pct(lat, 0.99) * 1000, "batches": len(job.get("parts", []))}


def ray_noop(tasks: int) -> dict | None:
    python = os.environ.get("RAY_PYTHON")
    if not python:
        try:
            import ray  # noqa: F401
            python = sys.executable
        except ImportError:
            return None
    r = subprocess.run([python, "-c", RAY_SCRIPT, str(tasks)], capture_output=True, text=True,
                       timeout=3600)
    if r.returncode != 0:
        print(f"ray failed: {r.stderr.strip().splitlines()[-1:]}")
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def training_sweep(market: Marketplace, root: Path, tasks: int, separate: int) -> dict:
    """One-step trainings: ``tasks`` of them as one array, ``separate`` as separate jobs."""
    base = training_job(root / "one-step.toml", steps=1, checkpoint_every=0)
    text = base.read_text()
    array = root / "sweep.toml"
    array.write_text(text.replace('name = "test-one-step"', 'name = "sweep"\nbudget = 100')
                     + f"\n[array]\ngrid = {{ seed = {list(range(tasks))} }}\n")
    began = time.perf_counter()
    job = submit_and_watch(market, array)
    array_s = time.perf_counter() - began
    if job["state"] != "SUCCEEDED":
        raise SystemExit(f"the training sweep ended {job['state']}: {job['error']}")
    began = time.perf_counter()
    ids = [submit(market, base) for _ in range(separate)]
    for job_id in ids:
        r = market.cli("watch", job_id, "--json", timeout=3600)
        if r.returncode != 0:
            raise SystemExit(f"a separate training did not succeed: {r.stdout[-300:]}")
    separate_s = time.perf_counter() - began
    return {"array_jobs_per_s": tasks / array_s, "separate_jobs_per_s": separate / separate_s,
            "array_s": array_s, "separate_s": separate_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=10_000, help="no-op tasks in the array")
    ap.add_argument("--sweep", type=int, default=100, help="one-step trainings in the array")
    ap.add_argument("--separate", type=int, default=6,
                    help="one-step trainings submitted as separate jobs (the baseline)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gpumarket-throughput-"))
    market = Marketplace(root)
    try:
        market.start_broker("--heartbeat-interval", "1")
        market.cli("keys", "init")
        for name in ("p1", "p2"):
            # Each offers this machine's CPU as two one-core devices: the two providers share
            # its cores, and a job's threads are its lease's cores (two providers that each
            # took every core would oversubscribe it: see docs/provider.md).
            market.start_provider(name, 1.0, "--kinds", "script,training",
                                  "--cpu-devices", "2")
        market.wait_for_offers(2)
        # Measured once every forkserver has its imports (the training one takes seconds of
        # CPU: measuring beside it measured this machine's two cores shared with it).
        wait_until(lambda: all(f"forkserver for gpumarket.provider.runners.{kind} ready"
                               in p.text() for p in market.providers.values()
                               for kind in ("script", "training")),
                   "the providers' forkservers", timeout=300)
        noop_array(market, root, 100)     # warm-up, as Ray's run has (workers started)
        ours = noop_array(market, root, args.tasks)
        print(f"array of {args.tasks:,} no-op script tasks on 2 providers: {ours['wall_s']:.1f}s,"
              f" {ours['tasks_per_s']:,.0f} tasks/s, submit->done p50 {ours['p50_ms']:,.0f} ms"
              f" p99 {ours['p99_ms']:,.0f} ms, {ours['batches']} leases")
        ray = ray_noop(args.tasks)
        if ray is None:
            print("ray: skipped (set RAY_PYTHON to a Python that imports ray)")
        else:
            print(f"ray, {args.tasks:,} no-op tasks: {ray['wall_s']:.1f}s,"
                  f" {args.tasks / ray['wall_s']:,.0f} tasks/s, p50 {ray['p50_ms']:,.0f} ms"
                  f" p99 {ray['p99_ms']:,.0f} ms")
        sweep = training_sweep(market, root, args.sweep, args.separate)
        speedup = sweep["array_jobs_per_s"] / sweep["separate_jobs_per_s"]
        print(f"one-step trainings: {args.sweep} as one array {sweep['array_jobs_per_s']:.2f}"
              f" jobs/s; {args.separate} separate jobs {sweep['separate_jobs_per_s']:.3f} jobs/s;"
              f" {speedup:.1f}x")
    finally:
        market.close()
    ray_rate = args.tasks / ray["wall_s"] if ray else None
    print(json.dumps({
        "tasks": args.tasks, "tasks_per_s": round(ours["tasks_per_s"], 1),
        "submit_to_done_p50_ms": round(ours["p50_ms"], 1),
        "submit_to_done_p99_ms": round(ours["p99_ms"], 1),
        "ray_tasks_per_s": round(ray_rate, 1) if ray_rate else None,
        "ray_p50_ms": round(ray["p50_ms"], 1) if ray else None,
        "ray_p99_ms": round(ray["p99_ms"], 1) if ray else None,
        "ratio_vs_ray": round(ours["tasks_per_s"] / ray_rate, 3) if ray_rate else None,
        "array_jobs_per_s": round(sweep["array_jobs_per_s"], 3),
        "separate_jobs_per_s": round(sweep["separate_jobs_per_s"], 4),
        "array_speedup": round(speedup, 1),
    }))


if __name__ == "__main__":
    main()
