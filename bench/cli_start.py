"""The client's start: how long a ``gpumarket`` process takes before it does what it was
asked, against a real local broker (TLS, signed calls) and one real provider.

    .venv/bin/python bench/cli_start.py [--runs 10] [--tasks 200] [--no-profile]

Each of ``--runs`` rounds runs, one after the other: ``gpumarket submit ARRAY --watch
--json`` of a script array of ``--tasks`` no-op tasks (bench/throughput.array_file), timed
from just before its process starts to the broker's ``submitted`` event (the event's time on
the broker's clock, which this machine shares: what bench/throughput.ends calls
``submit_ms``: the interpreter's start, imports, key, TLS channel, funds check, input
uploads, signing, the SubmitJob call); then the wall time of ``gpumarket --help``,
``gpumarket status JOB --json`` and ``gpumarket tasks JOB --json`` of that job. Each figure
is given as its median and minimum over the rounds (the minimum is the least disturbed on a
shared machine). One submission first, not counted, writes the bytecode caches and the
known-brokers file that a user's second run finds.

Then (unless ``--no-profile``) one ``gpumarket submit ARRAY --json`` is profiled in a fresh
interpreter (cProfile around the CLI's ``main``, its imports included; ``os._exit`` made a
SystemExit so the profile survives the CLI's quick exit): the most expensive calls, and the
calls that talk to the broker, counted. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from tests.helpers import BIN, Marketplace, wait_until  # noqa: E402
# (throughput, loaded here, has every process it starts write its bytecode)
from throughput import array_file, submit_and_watch  # noqa: E402

PROFILE = r"""
import cProfile, io, os, pstats, sys
sys.argv = ["gpumarket", *sys.argv[1:]]
def _exit(code):
    raise SystemExit(code)
os._exit = _exit        # the CLI ends a process that talked to a broker with os._exit
profile = cProfile.Profile()
profile.enable()
try:
    from gpumarket.client.cli import main
    main()
except SystemExit:
    pass
profile.disable()
sys.stdout.flush()
text = io.StringIO()
stats = pstats.Stats(profile, stream=text)
print("\n-- profile: the most expensive calls, by cumulative time", file=sys.stderr)
stats.sort_stats("cumulative").print_stats(45)
print(text.getvalue(), file=sys.stderr)
WATCHED = ("open_channel", "fetch_certificate", "connect", "check_funds", "upload_inputs",
           "upload", "upload_blobs", "_send", "stat", "account", "submit", "seal", "load",
           "load_identity", "load_plugins", "build_spec", "run")
print("-- profile: the client's steps (ncalls, cumulative s)", file=sys.stderr)
for (file, line, name), (cc, nc, tt, ct, callers) in sorted(stats.stats.items()):
    if name in WATCHED and file.startswith(os.environ["PROJECT_ROOT"]):
        short = os.path.relpath(file, os.environ["PROJECT_ROOT"])
        print(f"  {short}:{line} {name}: {nc} calls, {ct * 1000:.1f} ms", file=sys.stderr)
"""

# The same submission's steps on the wall clock, without the profiler's overhead: the
# interpreter's start (its process's start time, from /proc), the CLI's imports, then each
# step as it begins and ends, in ms from the process's start. A step's function is wrapped
# as its module is imported (an import hook), so that each step's own imports (a module
# imported where a command first uses it) count in that step, as in a plain run.
TIMELINE = r"""
import importlib.abc, os, sys, time
def since_start():
    ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
    uptime = float(open("/proc/uptime").read().split()[0])
    return (uptime - ticks / os.sysconf("SC_CLK_TCK")) * 1000
began = since_start()
t0 = time.perf_counter()
at = lambda: (time.perf_counter() - t0) * 1000 + began
sys.argv = ["gpumarket", *sys.argv[1:]]
def _exit(code):
    raise SystemExit(code)
os._exit = _exit
lines = []
def wrap(module, path, label):
    # Time module.path ("f" or "Class.method"); a function is replaced in its module
    # before anyone imports it by name.
    owner = module
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    fn = getattr(owner, name)
    if fn.__code__.co_flags & 0x80:     # a coroutine function
        async def timed(*a, **k):
            start = at()
            try:
                return await fn(*a, **k)
            finally:
                what = a[1] if name == "_call" else ""
                lines.append((start, at(), f"{label} {what}".strip()))
    else:
        def timed(*a, **k):
            start = at()
            try:
                return fn(*a, **k)
            finally:
                lines.append((start, at(), label))
    setattr(owner, name, timed)
STEPS = {
    "gpumarket.client.cli": [("main", "main()")],
    "gpumarket.client.jobfile": [("load", "job file read")],
    "gpumarket.client.console": [("load_identity", "key loaded"),
                                 ("load_plugin_kinds", "plugin kinds looked for")],
    "gpumarket.client.submit": [("check_funds", "funds checked"),
                                ("upload_inputs", "inputs uploaded")],
    "gpumarket.link.client": [("BrokerClient.connect", "channel opened"),
                              ("BrokerClient._call", "call")],
    "gpumarket.link.channel": [("fetch_certificate", "broker certificate read")],
    "gpumarket.link.artifacts": [("ArtifactsClient._send", "Upload call"),
                                 ("ArtifactsClient.stat", "StatArtifact call"),
                                 ("ArtifactsClient.upload_blobs", "UploadBlobs call")],
}
# Imports timed where they happen (each with what it imports itself).
IMPORTS = ("importlib.metadata", "asyncio", "tempfile", "rich.console", "rich.table",
           "google.protobuf.json_format", "gpumarket.proto.v1.types_pb2",
           "gpumarket.proto.identity", "gpumarket.kinds", "gpumarket.client.jobfile", "grpc",
           "gpumarket.link.client")
class Steps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in STEPS and name not in IMPORTS:
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        else:
            return None
        run = spec.loader.exec_module
        def exec_module(module):
            start = at()
            run(module)
            if name in IMPORTS:
                lines.append((start, at(), f"import {name}"))
            for path_, label in STEPS.get(name, ()):
                if hasattr(module, path_.split(".")[0]):
                    wrap(module, path_, label)
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, Steps())
from gpumarket.client import cli
imported = at()
try:
    cli.main()
except SystemExit:
    pass
ended = at()
print(f"-- timeline of one submit (ms from the process's start; /proc's start time is"
      f" coarse, 10 ms; a step's time includes the imports it makes)", file=sys.stderr)
print(f"  {began:7.1f}  interpreter started (site, .pth files)", file=sys.stderr)
print(f"  {imported:7.1f}  gpumarket.client.cli imported", file=sys.stderr)
for start, end, label in sorted(lines):
    print(f"  {start:7.1f}  {label}: {end - start:.1f} ms", file=sys.stderr)
print(f"  {ended:7.1f}  main() returned", file=sys.stderr)
"""


def timed(market: Marketplace, *args: str) -> float:
    """Wall seconds of one ``gpumarket ARGS`` process (SystemExit if it fails)."""
    began = time.perf_counter()
    r = market.cli(*args)
    wall = time.perf_counter() - began
    if r.returncode != 0:
        raise SystemExit(f"gpumarket {' '.join(args)} failed: {r.stderr.strip()[-500:]}")
    return wall


def submitted_after(market: Marketplace, path: Path) -> tuple[str, float]:
    """``submit --watch --json`` of ``path``: its job and the ms from just before its
    process started to the broker's submitted event (as bench/throughput.ends has it)."""
    began_ms = time.time() * 1000
    watched = submit_and_watch(market, path)
    if watched["state"] != "SUCCEEDED":
        raise SystemExit(f"the array ended {watched['state']}: {watched['error']}")
    at = next(int(e["at_ms"]) for e in watched["events"] if e["type"] == "submitted")
    return watched["job_id"], at - began_ms


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 1), "min": round(min(values), 1)}


def profile(market: Marketplace, path: Path) -> None:
    """One submission profiled, and one timed step by step (each in a fresh interpreter)."""
    for script in (PROFILE, TIMELINE):
        r = subprocess.run([str(BIN / "python"), "-c", script, "submit", str(path), "--json"],
                           env={**market.env, "PROJECT_ROOT": str(ROOT)}, capture_output=True,
                           text=True, timeout=300)
        print(r.stderr, end="")
        if '"job_id"' not in r.stdout:
            raise SystemExit(f"the profiled submit failed: {r.stdout[-500:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10, help="rounds of the four commands")
    ap.add_argument("--tasks", type=int, default=200, help="no-op tasks in each array")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled submit")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gpumarket-cli-start-"))
    market = Marketplace(root)
    figures: dict[str, list[float]] = {"submit_ms": [], "help_ms": [], "status_ms": [],
                                       "tasks_ms": []}
    try:
        market.start_broker()
        market.cli("keys", "init")
        market.start_provider("p1", 1.0, "--kinds", "script")
        market.wait_for_offers(1)
        wait_until(lambda: "forkserver for gpumarket.provider.runners.script ready"
                   in market.providers["p1"].text(), "the provider's forkserver", timeout=300)
        path = array_file(root, "noop", args.tasks, None)
        submitted_after(market, path)       # caches written, the broker's key remembered
        for n in range(args.runs):
            job_id, ms = submitted_after(market, path)
            figures["submit_ms"].append(ms)
            figures["help_ms"].append(timed(market, "--help") * 1000)
            figures["status_ms"].append(timed(market, "status", job_id, "--json") * 1000)
            figures["tasks_ms"].append(timed(market, "tasks", job_id, "--json") * 1000)
            print(f"round {n + 1}: start to submitted {ms:.0f} ms; --help"
                  f" {figures['help_ms'][-1]:.0f}, status {figures['status_ms'][-1]:.0f},"
                  f" tasks {figures['tasks_ms'][-1]:.0f} ms (wall)", flush=True)
        if not args.no_profile:
            profile(market, path)
    finally:
        market.close()
    result = {"runs": args.runs, "tasks": args.tasks,
              "load": round(os.getloadavg()[0], 1),
              **{name: summary(values) for name, values in figures.items()}}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
