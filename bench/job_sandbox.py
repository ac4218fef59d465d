"""What a job's PID namespace and fresh keyrings cost at its start and end (as root).

    sudo .venv/bin/python bench/job_sandbox.py [--runs 10]

Jobs of a tiny runner that imports torch (as the script kind's forkserver does) are forked by
a forkserver into the sandbox a job gets on this host (its own uid, network and mount
namespaces, limits), one after another, with and without each of the two protections:

- start: from the daemon's request (JobProcess.start) until the job's ``main()`` runs, inside
  the sandbox (with a PID namespace, its process forks twice more: the namespace's init, and
  the job);
- end: from the job's last instruction until ``JobProcess.run()`` returns, every process of it
  ended (its process group, its uid's by ``kill(-1)``, and with keyrings, its uid's keyrings
  emptied by a child of the daemon that takes the uid).

The last line is one JSON object: per variant, start_ms_p50 and end_ms_p50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpumarket.provider import job_uids, sandbox  # noqa: E402
from gpumarket.provider.executor import ForkedChild, JobProcess, job_env  # noqa: E402
from gpumarket.provider.forkservers import ForkServers  # noqa: E402

MODULE = "bench_sandbox_runner"
RUNNER = '''
import json, os, sys, time


def warm_up():
    import torch  # noqa: F401


def main():
    began = time.monotonic()
    with open(os.path.join(sys.argv[1], "times.json"), "w") as f:
        json.dump({"began": began, "ended": time.monotonic()}, f)
    return 0
'''
VARIANTS = {"neither": (False, False), "pid_namespace": (True, False),
            "keyrings": (False, True), "both": (True, True)}


async def one(jobs: Path, name: str, forks: ForkServers, box: sandbox.Sandbox
              ) -> tuple[float, float]:
    workdir = jobs / name
    workdir.mkdir()
    env = job_env(workdir, "", None)

    async def ignore(report):
        pass

    proc = JobProcess(MODULE, workdir, env, ignore, 600, 2.0, forks, box)
    asked = time.monotonic()
    await proc.start()
    outcome = await proc.run()
    returned = time.monotonic()
    if outcome.exit_code != 0 or not (workdir / "times.json").exists():
        raise SystemExit(f"job {name} failed: {outcome.error}\n"
                         + (workdir / "job.log").read_text())
    if not isinstance(proc.proc, ForkedChild):
        raise SystemExit(f"job {name} was not forked")
    times = json.loads((workdir / "times.json").read_text())
    shutil.rmtree(workdir, ignore_errors=True)
    return (times["began"] - asked) * 1000, (returned - times["ended"]) * 1000


async def bench(runs: int) -> dict:
    if os.geteuid() != 0:
        raise SystemExit("error: run as root (a job's uid and namespaces need it)")
    uids = job_uids.claim(f"bench-{os.getpid()}")
    base = Path(tempfile.mkdtemp(prefix="gpumarket-sandbox-bench-", dir="/tmp"))
    try:
        base.chmod(0o755)
        (base / f"{MODULE}.py").write_text(RUNNER)
        (base / f"{MODULE}.py").chmod(0o644)
        jobs = base / "jobs"
        jobs.mkdir(mode=0o711)
        features = sandbox.probe(str(jobs), uids)
        missing = [f for f in ("unprivileged_user", "private_tmp", "pid_namespace", "keyrings")
                   if not features[f]["available"]]
        if missing:
            raise SystemExit(f"error: this host gives no {', '.join(missing)}")
        forks = ForkServers(jobs, True)
        await forks.start(MODULE, (str(base), str(ROOT)))
        await forks._servers[MODULE].ready.wait()
        figures = {}
        print(f"{runs} jobs each, forked into their sandbox (ms)")
        for variant, (pid_ns, keyring) in VARIANTS.items():
            box = sandbox.Sandbox(uid=uids.first, gid=uids.first, network=False,
                                  limits={"NOFILE": 65536, "NPROC": 4096, "CORE": 0},
                                  scratch_bytes=64 << 20, expose=(str(base),),
                                  pid_namespace=pid_ns, keyring=keyring)
            await one(jobs, f"{variant}.warm", forks, box)
            got = [await one(jobs, f"{variant}.{i}", forks, box) for i in range(runs)]
            start = statistics.median(g[0] for g in got)
            end = statistics.median(g[1] for g in got)
            print(f"{variant:14s} start p50 {start:7.1f}  end p50 {end:7.1f}"
                  f"  (start min {min(g[0] for g in got):.1f} max {max(g[0] for g in got):.1f};"
                  f" end min {min(g[1] for g in got):.1f} max {max(g[1] for g in got):.1f})")
            figures[variant] = {"start_ms_p50": round(start, 1), "end_ms_p50": round(end, 1)}
        await forks.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
        uids.release()
    return {**figures, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="jobs of each variant")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(bench(args.runs))))


if __name__ == "__main__":
    main()
