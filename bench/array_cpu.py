"""What a job array's tasks cost the broker and each provider daemon in CPU, read from /proc
(robust where the machine is shared: a rate is not), beside their rate: bench/throughput.py's
outputs case (about 1 ms of hashing and one result.json a task) and heavy case (about 35 ms),
on a real broker and two real providers, every result then fetched and checked.

    .venv/bin/python bench/array_cpu.py [--outputs 1000] [--heavy 200] [--idle 30]
                                        [--profile DIR]

Per case: tasks_per_s, lost outputs, the load average before and after, and the broker's and
each provider daemon's CPU (user + system, its own threads; not its jobs' processes) divided
by the tasks; and each provider's job processes' (``p1_jobs``, those its forkservers forked:
the runner and the tasks' own work, a lease's process counted once it has ended). ``--idle
S``: one script job (not an array) that sleeps S seconds, and each daemon's CPU seconds over
its run (one provider follows it, the other is the baseline beside it). ``--profile DIR``:
the broker and the providers run under cProfile (each of their threads), each writing
DIR/<name>-<pid>.prof when it stops (``python -m pstats``).
The last line is one JSON object of them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.helpers import Marketplace, wait_until

_spec = importlib.util.spec_from_file_location("throughput", ROOT / "bench" / "throughput.py")
throughput = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(throughput)
TICK = os.sysconf("SC_CLK_TCK")
# Imported by each daemon at its start (PYTHONPATH) where --profile is given: the daemon
# runs under cProfile, its profile written when it exits (a stop by SIGTERM exits).
PROFILE_HOOK = """
import atexit, cProfile, os, sys, threading
_dir = os.environ.get("ARRAY_CPU_PROFILE")
if _dir and os.path.basename(sys.argv[0]) in ("gpumarket-broker", "gpumarket-provider"):
    _profiles = [cProfile.Profile()]
    _name = os.path.basename(sys.argv[0]) + "-" + str(os.getpid())

    def _in_thread(frame, event, arg):      # a new thread's first event: profile it too
        _profiles.append(cProfile.Profile())
        _profiles[-1].enable()

    def _dump():
        import pstats
        for p in _profiles:
            p.disable()
        stats = pstats.Stats(_profiles[0])
        for p in _profiles[1:]:
            try:
                stats.add(p)
            except (TypeError, ValueError):     # a thread's profile that holds nothing
                pass
        stats.dump_stats(os.path.join(_dir, _name + ".prof"))

    atexit.register(_dump)
    threading.setprofile(_in_thread)
    _profiles[0].enable()
"""
IDLE_JOB = ("import sys, time\nfrom gpumarket.provider.runners import task\n"
            "task.output_dir()\ntime.sleep(float(sys.argv[1]))\n")


def cpu_s(pid: int, reaped: bool = False) -> float:
    """The process's own user + system CPU seconds so far (``reaped``: with those of its
    children it has waited for)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = int(fields[11]) + int(fields[12])
    return (own + (int(fields[13]) + int(fields[14]) if reaped else 0)) / TICK


def forkservers(pid: int) -> list[int]:
    """The daemon's forkservers now: its children (every thread's) that run one (not its
    keyrings helper, which also is one)."""
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split():
            if b"runners.forkserver" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(int(child))
    return out


def jobs_cpu_s(forkservers: list[int]) -> float:
    """CPU seconds of the job processes forked by ``forkservers`` and ended (each forkserver
    waits for its children: their time is in its own reaped time), with the forkservers'
    own (a few ms)."""
    return sum(cpu_s(pid, reaped=True) for pid in forkservers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outputs", type=int, default=1000, help="tasks of the outputs case")
    ap.add_argument("--heavy", type=int, default=200, help="tasks of the heavy case")
    ap.add_argument("--idle", type=float, default=0,
                    help="seconds of a job that sleeps: its provider daemon's CPU over them")
    ap.add_argument("--profile", type=Path, default=None,
                    help="write each daemon's cProfile here when it stops")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gpumarket-array-cpu-"))
    market = Marketplace(root)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        hook = root / "profile-hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(PROFILE_HOOK)
        path = os.pathsep.join(filter(None, (str(hook), os.environ.get("PYTHONPATH"))))
        market.extra_env.update({"PYTHONPATH": path,
                                 "ARRAY_CPU_PROFILE": str(args.profile.resolve())})
    out: dict[str, dict] = {}
    try:
        market.start_broker("--heartbeat-interval", "1")
        market.cli("keys", "init")
        for name in ("p1", "p2"):
            market.start_provider(name, 1.0, "--kinds", "script", "--cpu-devices", "1")
        market.wait_for_offers(2)
        wait_until(lambda: all("forkserver for gpumarket.provider.runners.script ready"
                               in p.text() for p in market.providers.values()),
                   "the providers' forkservers", timeout=300)
        throughput.run_array(market, root, "warm-up", 100, None)
        pids = {"broker": market.broker.proc.pid,
                **{name: p.proc.pid for name, p in market.providers.items()}}
        # Each provider's forkservers: its job processes are their children (a lease's
        # tasks run in one, forked when the lease starts and waited for when it ends).
        forks = {f"{name}_jobs": forkservers(p.proc.pid) for name, p in market.providers.items()}
        for case, tasks, rounds in (("outputs", args.outputs, throughput.LIGHT_ROUNDS),
                                    ("heavy", args.heavy, throughput.HEAVY_ROUNDS)):
            if not tasks:
                continue
            def now() -> dict[str, float]:
                return {**{k: cpu_s(p) for k, p in pids.items()},
                        **{k: jobs_cpu_s(f) for k, f in forks.items()}}

            before, load = now(), os.getloadavg()[0]
            run = throughput.run_array(market, root, case, tasks, rounds)
            after = now()
            lost = throughput.lost_outputs(market, root, run["job_id"], tasks, rounds,
                                           case == "outputs")
            out[case] = {"tasks_per_s": round(run["tasks_per_s"], 1), "lost_outputs": lost,
                         "load_before": round(load, 1),
                         "load_after": round(os.getloadavg()[0], 1),
                         **{f"{k}_cpu_ms_per_task": round((after[k] - before[k]) / tasks * 1e3, 3)
                            for k in after}}
            print(case, ", ".join(f"{k} {v}" for k, v in out[case].items()), flush=True)
        if args.idle:
            out["idle"] = idle_job(market, root, args.idle, pids)
            print("idle", ", ".join(f"{k} {v}" for k, v in out["idle"].items()), flush=True)
        out["stale_lease_cancels"] = market.broker.text().count("that are no longer its")
    finally:
        market.close()
    print(json.dumps(out))


def idle_job(market: Marketplace, root: Path, seconds: float, pids: dict[str, int]) -> dict:
    """One script job that sleeps ``seconds``: each daemon's CPU seconds from its start to
    its end (one provider runs it; the other, with no job, is the baseline beside it)."""
    code = root / "idle.py"
    code.write_text(IDLE_JOB)
    path = root / "idle.toml"
    path.write_text(f'''
name = "idle"
kind = "script"
max_price = 2.0
budget = 100
max_attempts = 1

[script]
code = "{code}"
args = ["{seconds}"]
''')
    r = market.cli("submit", str(path))
    if r.returncode != 0:
        raise SystemExit(f"submit failed: {r.stderr.strip()}")
    job_id = r.stdout.split()[0]
    wait_until(lambda: market.job(job_id)["state"] == "RUNNING", "the idle job running",
               timeout=120)
    before, began = {k: cpu_s(p) for k, p in pids.items()}, time.monotonic()
    wait_until(lambda: market.job(job_id)["state"] in ("SUCCEEDED", "FAILED"),
               "the idle job's end", timeout=seconds + 120)
    after, wall = {k: cpu_s(p) for k, p in pids.items()}, time.monotonic() - began
    return {"wall_s": round(wall, 1), "state": market.job(job_id)["state"],
            **{f"{k}_cpu_s": round(after[k] - before[k], 3) for k in pids}}


if __name__ == "__main__":
    main()
