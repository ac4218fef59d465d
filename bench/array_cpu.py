"""What a job array's tasks cost the broker and each provider daemon in CPU, read from /proc
(robust where the machine is shared: a rate is not), beside their rate: bench/throughput.py's
outputs case (about 1 ms of hashing and one result.json a task) and heavy case (about 35 ms),
on a real broker and two real providers, every result then fetched and checked.

    .venv/bin/python bench/array_cpu.py [--outputs 1000] [--heavy 200]

Per case: tasks_per_s, lost outputs, the load average before and after, and the broker's and
each provider daemon's CPU (user + system, its own threads; not its jobs' processes) divided
by the tasks. The last line is one JSON object of them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.helpers import Marketplace, wait_until

_spec = importlib.util.spec_from_file_location("throughput", ROOT / "bench" / "throughput.py")
throughput = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(throughput)
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """The process's own user + system CPU seconds so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outputs", type=int, default=1000, help="tasks of the outputs case")
    ap.add_argument("--heavy", type=int, default=200, help="tasks of the heavy case")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gpumarket-array-cpu-"))
    market = Marketplace(root)
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
        for case, tasks, rounds in (("outputs", args.outputs, throughput.LIGHT_ROUNDS),
                                    ("heavy", args.heavy, throughput.HEAVY_ROUNDS)):
            if not tasks:
                continue
            before, load = {k: cpu_s(p) for k, p in pids.items()}, os.getloadavg()[0]
            run = throughput.run_array(market, root, case, tasks, rounds)
            after = {k: cpu_s(p) for k, p in pids.items()}
            lost = throughput.lost_outputs(market, root, run["job_id"], tasks, rounds,
                                           case == "outputs")
            out[case] = {"tasks_per_s": round(run["tasks_per_s"], 1), "lost_outputs": lost,
                         "load_before": round(load, 1),
                         "load_after": round(os.getloadavg()[0], 1),
                         **{f"{k}_cpu_ms_per_task": round((after[k] - before[k]) / tasks * 1e3, 3)
                            for k in pids}}
            print(case, ", ".join(f"{k} {v}" for k, v in out[case].items()), flush=True)
        out["stale_lease_cancels"] = market.broker.text().count("that are no longer its")
    finally:
        market.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
