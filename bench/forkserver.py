"""Job start with a forkserver against a cold start, for the training kind's runner.

    .venv/bin/python bench/forkserver.py [--runs 10]

A job of a tiny runner that imports what the training runner imports
(gpumarket.provider.runners.training: torch, numpy; its warm_up: transformers and the llama
model) and, in ``main()``, notes the time and its process's CPU seconds so far. Each start is
timed from the daemon's request (JobProcess.start: ``python -m RUNNER WORKDIR`` started cold,
or an order to the forkserver) until the job's ``main()`` runs with those imports done; the
CPU figure is the job process's own up to then (a forked child's excludes the imports its
forkserver did once). Starts are one after another, on an otherwise idle daemon, no sandbox
(which costs both the same). The last line is one JSON object: cold_start_ms_p50,
fork_start_ms_p50, speedup (their ratio), and the CPU figures beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpumarket.provider.executor import ForkedChild, JobProcess, job_env
from gpumarket.provider.forkservers import ForkServers

MODULE = "bench_start_runner"
RUNNER = '''
import json, os, resource, sys, time

from gpumarket.provider.runners import training


def warm_up():
    training.warm_up()


def main():
    training.warm_up()              # what a job does first: its imports (done if forked)
    now = time.monotonic()
    use = resource.getrusage(resource.RUSAGE_SELF)
    with open(os.path.join(sys.argv[1], "started.json"), "w") as f:
        json.dump({"at": now, "cpu_s": use.ru_utime + use.ru_stime}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


async def one(jobs: Path, name: str, forks: ForkServers | None) -> tuple[float, float]:
    """Start a job, cold or forked; (ms from request to main(), the job's CPU ms by then)."""
    workdir = jobs / name
    workdir.mkdir()
    env = {**job_env(workdir, "", None), "PYTHONPATH": f"{jobs.parent}:{ROOT}"}

    async def ignore(report):
        pass

    proc = JobProcess(MODULE, workdir, env, ignore, 600, 2.0, forks)
    asked = time.monotonic()
    await proc.start()
    outcome = await proc.run()
    if outcome.exit_code not in (0, None) or not (workdir / "started.json").exists():
        raise SystemExit(f"job {name} failed: {outcome.error}\n"
                         + (workdir / "job.log").read_text())
    if forks is not None and not isinstance(proc.proc, ForkedChild):
        raise SystemExit(f"job {name} was not forked")
    started = json.loads((workdir / "started.json").read_text())
    return (started["at"] - asked) * 1000, started["cpu_s"] * 1000


def summary(label: str, values: list[float]) -> str:
    return (f"{label}: p50 {statistics.median(values):8.1f}  mean {statistics.fmean(values):8.1f}"
            f"  min {min(values):8.1f}  max {max(values):8.1f}")


async def bench(runs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="gpumarket-fork-bench-") as tmp:
        (Path(tmp) / f"{MODULE}.py").write_text(RUNNER)
        jobs = Path(tmp) / "jobs"
        jobs.mkdir()
        cold = [await one(jobs, f"cold.{i}", None) for i in range(runs)]
        forks = ForkServers(jobs, True)
        began = time.monotonic()
        await forks.start(MODULE, (tmp, str(ROOT)))
        await forks._servers[MODULE].ready.wait()
        ready_s = time.monotonic() - began
        forked = [await one(jobs, f"fork.{i}", forks) for i in range(runs)]
        await forks.close()
    print(f"{runs} starts each of a job of the training runner (ms; CPU of the job's process)")
    print(summary("cold start ms  ", [c[0] for c in cold]))
    print(summary("cold CPU ms    ", [c[1] for c in cold]))
    print(summary("fork start ms  ", [f[0] for f in forked]))
    print(summary("fork CPU ms    ", [f[1] for f in forked]))
    print(f"forkserver ready (its imports, once) after {ready_s * 1000:.0f} ms")
    cold_ms = statistics.median(c[0] for c in cold)
    fork_ms = statistics.median(f[0] for f in forked)
    return {"cold_start_ms_p50": round(cold_ms, 1), "fork_start_ms_p50": round(fork_ms, 1),
            "speedup": round(cold_ms / fork_ms, 1),
            "cold_cpu_ms_p50": round(statistics.median(c[1] for c in cold), 1),
            "fork_cpu_ms_p50": round(statistics.median(f[1] for f in forked), 1),
            "forkserver_ready_ms": round(ready_s * 1000), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="starts of each kind")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(bench(args.runs))))


if __name__ == "__main__":
    main()
