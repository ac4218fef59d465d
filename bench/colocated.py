"""Colocated TTFT on slices of one CPU (issue 35, ``colocated_ttft_p99_ratio``): real
processes on this machine — a broker, one provider offering its CPU whole and as two slices
(``--slices 2``, a core each), an endpoint of one replica (the tiny 2-layer Llama of
tests/models.py) that the broker places on one slice — measured through the broker's
OpenAI-compatible API: TTFT of streamed completions arriving as a Poisson process, alone, and
while a training job (the same tiny model, placed on the other slice) runs. One training job
serves every round: on an alone side its processes are stopped (SIGSTOP: it keeps its lease
and memory, takes no CPU, and the broker's and daemon's work for it stops with it), on a
colocated side they run (the side fails unless the job's reported step moved). A side costs
only its seconds, so rounds are many and short, and they alternate (alone first in odd
rounds, colocated first in even ones, the same arrivals for both sides of a round) so that
drift of the host's load falls on both sides alike. Each side's p50 and p99 are over all of
its rounds' requests (the defaults, 12 rounds of 8 s a side at 8 requests/s of 8 tokens:
about 770 requests a side, the same decode work per second as 4/s of 16 tokens).

    .venv/bin/python bench/colocated.py [--rounds 12] [--duration 8] [--rate 8] [--tokens 8]
        [--no-direct] [--stand-in] [--lag-probe] [--checkpoint-every N] [--trace-out FILE]

``--stand-in`` keeps the job stopped and runs, on colocated sides, a busy loop on the
training's cores at its nice value in a session of its own: the training's use of its core
and nothing else of it (no memory traffic, no reports, no broker or daemon work), to tell
what of the colocated cost is the core taken and what the training's other effects.

Then the same without the marketplace (``direct_*``): the endpoint's engine in a process of
its own on one slice's cores, its requests made in that process, alone and while a process
trains the same model on the other slice's cores — what one slice's work does to the other,
apart from the broker's and the provider's own processes, which on this host share the
replica's core while the training holds the other (``--no-direct`` leaves it out).

Once the training runs it prints every process of the marketplace (the broker, the
provider and all below it: forkservers, the replica's engine, the training job) with its
nice value, its session's scheduling group (/proc/PID/autogroup) and its threads counted by
the cores each may run on (Cpus_allowed_list): a thread of a slice's job allowed outside its
slice's cores would show there. It also prints each side of each round (p50, p99, requests,
training steps) and the share of a core the broker and the provider daemon used, and at the
end how long, over each side's rounds, the replica's engine and the processes on its path
(this client, the broker, the daemon) were runnable but waiting for a CPU (cpu_wait_ms, from
/proc/PID/task/*/schedstat).

After the rounds it sets every request (its arrival and TTFT) beside the training's events
as the broker stored them (progress, checkpoints: bench/colocated_trace.py) and prints, for
the slowest 1 %, the next 4 % and the rest of each side, the share that had such an event
in their first 20 ms; with ``--lag-probe`` also every stall over 2 ms of the event loops of
the broker, the provider daemon and the bench's own client (a callback that long, or a
timer that late), and the share of each slow request's wait one stall covered.
``--checkpoint-every N`` has the training checkpoint every N steps (each one uploaded,
reported and settled, as a real job's are; by default it never does in a run's time), and
``--trace-out FILE`` keeps the requests, events and stalls as JSON.

Prints its figures and the host's load average (uptime) before and after; the last line is
one JSON object: colocated_ttft_p99_ratio (colocated p99 / alone p99) with its 90 % bootstrap
interval (colocated_ttft_p99_ratio_ci90: both sides' requests resampled), the spread of the
rounds' own ratios (round_ttft_p99_ratios, round_ttft_p50_ratios: min, median, max; with
about 64 requests a round-side a round's p99 is its slowest request, so the median is what to
read), the p50 ratio, both p99s and p50s in ms, requests_per_side, the replica's and the
training's devices, the loads, the coincidence table's rows (coincidence), and the direct
figures (``--direct-rounds``, default 3: a fresh engine process a side).
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

import colocated_trace as trace
from percentiles import alone_vs_colocated, pct
from serving import create, key_for, models_dir, open_loop, ready_count, timing

from tests.helpers import LEASE_ARGS, Marketplace, training_job, wait_until

PROMPT = "a marketplace for idle gpus"


def load_average() -> float:
    return os.getloadavg()[0]


POLICIES = {0: "normal", 3: "batch", 5: "idle"}   # /proc/PID/stat's policy (sched(7))


def threads(pid: int) -> dict:
    """One process as the kernel schedules it: its command (shortened), nice value, and its
    threads counted by the cores each may run on (/proc/PID/task/*/status Cpus_allowed_list):
    a thread of a slice's job allowed outside the slice's cores would spill onto its
    neighbour's."""
    proc = Path(f"/proc/{pid}")
    try:
        cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        nice, policy = int(stat[16]), POLICIES.get(int(stat[38]), stat[38])
        tasks = list((proc / "task").iterdir())
    except OSError:
        return {}
    allowed: dict[str, int] = {}
    for task in tasks:
        try:
            status = (task / "status").read_text()
        except OSError:
            continue
        cores = next(line.split(":", 1)[1].strip() for line in status.splitlines()
                     if line.startswith("Cpus_allowed_list"))
        allowed[cores] = allowed.get(cores, 0) + 1
    try:    # its session's scheduling group, where the kernel has autogroups
        group = (proc / "autogroup").read_text().split()
    except OSError:
        group = []
    return {"pid": pid, "cmd": cmd.split(" -m ")[-1][:60].strip() or cmd[:60], "nice": nice,
            "policy": policy, "autogroup": " ".join(group), "threads_by_cores": allowed}


def process_tree(market: Marketplace) -> list[dict]:
    """The marketplace's processes on this host (the broker, the provider and every process
    below it: forkservers, the replica's engine, the training job) as ``threads`` sees them."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    roots = [market.broker.proc.pid, *(p.proc.pid for p in market.providers.values())]
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop(0)
        if seen := threads(pid):
            out.append(seen)
        todo += children.get(pid, [])
    return out


def cpu_seconds(market: Marketplace) -> dict[str, float]:
    """CPU time (user + system, s) the broker and the provider daemon have used so far, each
    process alone (not its children): read before and after a side, what they spent on it —
    their own work for the training job (its reports, logs, heartbeats) shows as the
    colocated side's excess over the alone side's."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, proc in [("broker", market.broker.proc),
                       *((f"provider {n}", p.proc) for n, p in market.providers.items())]:
        try:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):
            out[name] = 0.0
    return out


def spent(before: dict[str, float], after: dict[str, float], seconds: float) -> str:
    """Each process's share of a core over a side, from two ``cpu_seconds``."""
    return ", ".join(f"{name} {(after[name] - before[name]) / seconds * 100:.0f} %"
                     for name in after)


def step(market: Marketplace, job_id: str) -> int:
    """The last step the training job ``job_id`` reported."""
    return int(market.job(job_id).get("progress", {}).get("step", 0))


def pause(pids: list[int], stopped: bool) -> None:
    """Stop (SIGSTOP) or continue (SIGCONT) the training job's processes ``pids``: stopped it
    holds its lease, memory and files but takes no CPU, so the alone side is the replica with
    no training beside it — and none of the broker's or provider's work for it (reports,
    logs), which stops with it."""
    import signal

    for pid in pids:
        try:
            os.kill(pid, signal.SIGSTOP if stopped else signal.SIGCONT)
        except ProcessLookupError:
            continue


STAND_IN = """
import os, sys
os.sched_setaffinity(0, {cores})
open(f"/proc/{{os.getpid()}}/autogroup", "w").write("{nice}")
print("spinning", flush=True)
while True:
    pass
"""


def stand_in(pids: list[int]):
    """A busy loop in place of the training (``--stand-in``): its own session, on the
    training's cores, at its nice value (thread and session group) — the training's use of
    its core and nothing else of it, no reports, no logs, no work of the broker or daemon."""
    import subprocess

    seen = threads(pids[-1])
    cores = {int(c) for c in next(iter(seen["threads_by_cores"])).replace("-", ",").split(",")}
    proc = subprocess.Popen(["nice", "-n", str(seen["nice"]), sys.executable, "-c",
                             STAND_IN.format(cores=cores, nice=seen["nice"])],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "spinning"
    return proc


def leases(market: Marketplace) -> dict[str, list[int]]:
    """The broker's active leases: job id -> device indices (read from its database)."""
    db = sqlite3.connect(f"file:{market.root / 'broker' / 'broker.db'}?mode=ro", uri=True)
    try:
        return {job: json.loads(devices) for job, devices in db.execute(
            "SELECT job_id, device_indices FROM leases WHERE state = 'active'")}
    finally:
        db.close()


async def measure(base: str, key: str, name: str, rate: float, duration: float, tokens: int,
                  seed: int) -> list[dict]:
    """Streamed completions arriving at ``rate``/s for ``duration`` s: each one's arrival
    (``at``, s, wall clock: to set beside the other processes' events) and TTFT (s)."""
    import openai

    api = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=300)

    async def send(i: int) -> dict:
        arrived, start, pieces = time.time(), time.perf_counter(), []
        try:
            stream = await api.chat.completions.create(
                model=name, max_tokens=tokens, temperature=0, stream=True,
                messages=[{"role": "user", "content": PROMPT}])
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(time.perf_counter())
        except openai.APIError as exc:
            return {"error": str(exc), "ttft": 0, "tpot": 0, "tokens": 0}
        return {**timing(start, pieces, len(pieces)), "at": arrived}

    samples, _ = await open_loop(send, rate, duration, seed)
    await api.close()
    failed = [s for s in samples if s.get("error")]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed: {failed[0]['error']}")
    return [{"at": s["at"], "ttft": s["ttft"]} for s in samples]


ENGINE_CHILD = """
import asyncio, json, os, sys, time
from pathlib import Path
from gpumarket.provider.runners.base import apply_share
apply_share()
sys.path.insert(0, {bench!r})
from serving import open_loop, timing
from gpumarket.kinds.engine_protocol import Complete, Final
from gpumarket.kinds.runner_job import RunnerJob
from gpumarket.provider.runners.engine import load_engine

model = Path({model!r})
async def run():
    engine = load_engine(RunnerJob(params={{"model_name": model.name, "max_concurrency": 4,
                                            "max_seq_len": 128}}, model_dir=str(model)), model)
    async def send(i):
        start, pieces, final = time.perf_counter(), [], Final()
        async for event in engine.complete(f"c{{i}}", Complete(prompt={prompt!r},
                                                               max_tokens={tokens},
                                                               temperature=0)):
            if isinstance(event, Final):
                final = event
            else:
                pieces.append(time.perf_counter())
        return {{**timing(start, pieces, final.output_tokens), "engine_ttft": final.ttft_s}}
    await open_loop(send, {rate}, 2, 0)       # warm-up
    samples, _ = await open_loop(send, {rate}, {duration}, {seed})
    await engine.close()
    print(json.dumps([s["ttft"] for s in samples]))
asyncio.run(run())
"""

TRAIN_CHILD = """
import sys, time
from gpumarket.provider.runners.base import apply_share
apply_share()
import torch
from transformers import AutoModelForCausalLM
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained({model!r})
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
print("training", flush=True)
while True:
    ids = torch.randint(0, model.config.vocab_size, (4, 32))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def child_env(cores: tuple[int, ...]) -> dict[str, str]:
    """A slice's environment as a lease on it gets it (its cores, as many threads)."""
    return {**os.environ, "GPUMARKET_CPU_CORES": ",".join(map(str, cores)),
            "OMP_NUM_THREADS": str(len(cores))}


def direct(model: Path, rounds: int, duration: float, rate: float, tokens: int) -> dict:
    """The same measurement without the marketplace: the endpoint's engine in a process of
    its own on slice 1's cores (its requests made in that process), alone and while a
    process trains the same model on slice 2's cores; both held to their slices by the
    runners' start (runners/base.apply_share). What is left is what one slice's work does to
    the other's (caches, memory bandwidth), not the broker's and provider's own processes
    squeezed onto one core."""
    import subprocess

    from gpumarket.provider.inventory import cpu_device, sliced

    _, first, second = sliced([cpu_device()], {0: (0.5, 0.5)})
    alone: list[float] = []
    colocated: list[float] = []

    def engine(seed: int) -> list[float]:
        code = ENGINE_CHILD.format(bench=str(ROOT / "bench"), model=str(model), prompt=PROMPT,
                                   tokens=tokens, rate=rate, duration=duration, seed=seed)
        done = subprocess.run([sys.executable, "-c", code], env=child_env(first.cores),
                              capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise SystemExit(f"engine process failed: {done.stderr.strip()[-400:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    for r in range(rounds):
        alone += engine(10 + r)
        trainer = subprocess.Popen([sys.executable, "-c", TRAIN_CHILD.format(model=str(model))],
                                   env=child_env(second.cores), stdout=subprocess.PIPE,
                                   text=True)
        try:
            assert trainer.stdout.readline().strip() == "training"
            colocated += engine(10 + r)
        finally:
            trainer.kill()
            trainer.wait()
        print(f"direct round {r + 1}: alone p99 {pct(alone, 0.99) * 1000:.0f} ms, colocated"
              f" p99 {pct(colocated, 0.99) * 1000:.0f} ms", flush=True)
    return {**alone_vs_colocated(alone, colocated, "direct_", "direct_ttft_p99_ratio"),
            "direct_engine_cores": list(first.cores), "direct_training_cores": list(second.cores)}


def meetings(market: Marketplace, job_id: str, tree: list[dict], requests: list[dict],
             probe: Path | None, out: Path | None) -> list[dict]:
    """Whether the slow requests meet the training's events (as the broker stored them)
    and, with the lag probe, the event loops' stalls of each process: prints the stalls
    each process had and the table of ``trace.coincidence``; returns its rows. ``out``:
    where to write the requests, events and stalls (JSON) for a closer look."""
    events = trace.training_events(market.root / "broker" / "broker.db", job_id)
    kinds = {f"training {kind}": [e for e in events if e["type"] == kind]
             for kind in sorted({e["type"] for e in events})}
    stalls: dict[str, list[dict]] = {}
    seen: list[dict] = []
    if probe is not None:
        roles = {s["pid"]: s["cmd"][:40] for s in tree}
        roles[market.broker.proc.pid] = "broker"
        roles[os.getpid()] = "client"
        for p in market.providers.values():
            roles[p.proc.pid] = "daemon"
        seen = trace.stalls(probe, roles)
        for role in sorted({s["role"] for s in seen}):
            mine = [s for s in seen if s["role"] == role]
            longest = max(mine, key=lambda s: s["ms"])
            print(f"stalls of {role}: {len(mine)}, {sum(s['ms'] for s in mine):.0f} ms in all"
                  f" ({sum(s['ms'] for s in mine if s['kind'] == 'callback'):.0f} ms in"
                  f" callbacks), the longest {longest['ms']:.1f} ms ({longest['what']})",
                  flush=True)
        for role in ("client", "broker", "daemon"):
            stalls[f"{role} stall"] = [s for s in seen if s["role"] == role]
        stalls["other stall"] = [s for s in seen
                                 if s["role"] not in ("client", "broker", "daemon")]
    rows = trace.coincidence(requests, kinds, stalls)
    print(f"requests by TTFT: the share with a training event in their first"
          f" {trace.WINDOW_MS:g} ms (near), the median share of their wait one stall of a"
          f" process covered (covered):\n" + trace.table(rows), flush=True)
    if out is not None:
        out.write_text(json.dumps({"requests": requests, "events": events, "stalls": seen}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="alone/colocated pairs")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per side a round")
    parser.add_argument("--rate", type=float, default=8.0, help="requests/s")
    parser.add_argument("--tokens", type=int, default=8, help="max_tokens per request")
    parser.add_argument("--direct-rounds", type=int, default=3,
                        help="alone/colocated pairs without the marketplace (a fresh engine"
                        " process a side)")
    parser.add_argument("--stand-in", action="store_true",
                        help="colocated sides beside a busy loop on the training's cores at"
                        " its nice value, the training job paused: its CPU use alone")
    parser.add_argument("--no-direct", action="store_true",
                        help="leave out the same measurement without the marketplace")
    parser.add_argument("--lag-probe", action="store_true",
                        help="record every event-loop stall over %g ms of the broker, the"
                        " daemon and this bench's client (bench/colocated_trace.py)"
                        % trace.SLOW_MS)
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="the training checkpoints every this many steps (uploaded to"
                        " the broker and settled, as a real job's are; default: never)")
    parser.add_argument("--trace-out", type=Path,
                        help="write every request, training event and stall here (JSON)")
    args = parser.parse_args()
    load_before = load_average()
    print(f"load average before: {load_before:.2f} ({os.cpu_count()} CPUs)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = models_dir(root)
        (root / "market").mkdir()
        # The provider on every core (its slices are a core each), not one (tests' taskset).
        probe = root / "probe"
        market = Marketplace(root / "market", {"TESTS_PROVIDER_CPUS": "all",
                                               **(trace.install_probe(probe)
                                                  if args.lag_probe else {})})
        if args.lag_probe:
            trace.probe_here(probe)
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
            # One training job for every round, paused (SIGSTOP) on the alone sides: a side
            # costs its seconds only, no submission, so rounds can be many and short.
            before = {seen["pid"] for seen in process_tree(market)}
            job_file = training_job(root / "train.toml", steps=1_000_000,
                                    checkpoint_every=args.checkpoint_every or 1_000_000,
                                    max_price=5.0)
            done = market.cli("submit", str(job_file))
            if done.returncode != 0:
                raise SystemExit(done.stderr)
            job_id = done.stdout.split()[0]
            market.wait_state(job_id, "RUNNING", timeout=300)
            wait_until(lambda: step(market, job_id) > 0, "training steps", 120, 0.2)
            training_devices = leases(market)[job_id]
            tree = process_tree(market)
            for seen in tree:        # every thread's cores, once: does anything spill?
                print(f"  pid {seen['pid']:>7} nice {seen['nice']:>3} {seen['policy']:<6}"
                      f" ({seen['autogroup'] or 'no autogroup'}) {seen['cmd']:<60} threads"
                      f" by allowed cores: {seen['threads_by_cores']}", flush=True)
            training = [seen["pid"] for seen in tree if seen["pid"] not in before]
            # Whose wait for a CPU each side measures (trace.run_delay): the replica's engine
            # and the processes on its path.
            path = {"client": [os.getpid()], "broker": [market.broker.proc.pid],
                    "daemon": [p.proc.pid for p in market.providers.values()],
                    "replica": [seen["pid"] for seen in tree
                                if "runners.serve" in seen["cmd"]]}
            cpu_wait = {"alone": dict.fromkeys(path, 0.0),
                        "colocated": dict.fromkeys(path, 0.0)}
            alone: list[list[float]] = []
            colocated: list[list[float]] = []
            requests: list[dict] = []       # every request: side, round, arrival, TTFT
            for r in range(args.rounds):
                for side in (("alone", "colocated") if r % 2 == 0 else
                             ("colocated", "alone")):
                    pause(training, side == "alone" or args.stand_in)
                    spinner = (stand_in(training) if args.stand_in and side == "colocated"
                               else None)
                    if side == "alone":     # reports already on their way land first
                        time.sleep(1.0)
                    first = step(market, job_id)
                    cpu, began = cpu_seconds(market), time.monotonic()
                    delay = {role: trace.run_delay(pids) for role, pids in path.items()}
                    answered = asyncio.run(measure(base, key, "colo", args.rate,
                                                   args.duration, args.tokens, 10 + r))
                    requests += [{**a, "side": side, "round": r + 1} for a in answered]
                    ttfts = [a["ttft"] for a in answered]
                    used = spent(cpu, cpu_seconds(market), time.monotonic() - began)
                    for role, pids in path.items():
                        cpu_wait[side][role] += trace.run_delay(pids) - delay[role]
                    if spinner is not None:
                        spinner.kill()
                        spinner.wait()
                    steps = step(market, job_id) - first
                    if side == "colocated" and steps <= 0 and not args.stand_in:
                        raise SystemExit(f"round {r + 1}: the training made no steps")
                    (alone if side == "alone" else colocated).append(ttfts)
                    print(f"round {r + 1} {side}: TTFT p50 {pct(ttfts, 0.5) * 1000:.1f} ms,"
                          f" p99 {pct(ttfts, 0.99) * 1000:.1f} ms ({len(ttfts)} requests,"
                          f" {steps} training steps); CPU: {used}", flush=True)
            pause(training, False)
            if market.job(job_id)["state"] != "RUNNING":
                raise SystemExit(f"the training ended {market.job(job_id)['state']}")
            met = meetings(market, job_id, tree, requests, probe if args.lag_probe else None,
                           args.trace_out)
        finally:
            market.close()
        split = {} if args.no_direct else direct(model, args.direct_rounds, args.duration,
                                                 args.rate, args.tokens)
    load_after = load_average()
    rounds = [round(pct(c, 0.99) / pct(a, 0.99), 3) for a, c in zip(alone, colocated)]
    rounds_p50 = [round(pct(c, 0.5) / pct(a, 0.5), 3) for a, c in zip(alone, colocated)]
    alone, colocated = sum(alone, []), sum(colocated, [])
    out = {
        **alone_vs_colocated(alone, colocated),
        "round_ttft_p99_ratios": {"min": min(rounds), "median": pct(rounds, 0.5),
                                  "max": max(rounds)},
        "round_ttft_p50_ratios": {"min": min(rounds_p50), "median": pct(rounds_p50, 0.5),
                                  "max": max(rounds_p50)},
        "requests_per_side": len(alone),
        "replica_devices": replica_devices,
        "training_devices": training_devices,
        "load_before": round(load_before, 2),
        "load_after": round(load_after, 2),
        "coincidence": met,
        "cpu_wait_ms": {side: {role: round(s * 1000) for role, s in waits.items()}
                        for side, waits in cpu_wait.items()},
        **split,
    }
    print(f"TTFT p99: alone {out['alone_ttft_p99_ms']} ms, with a training job on the other"
          f" slice {out['colocated_ttft_p99_ms']} ms: ratio {out['colocated_ttft_p99_ratio']}"
          f" (90 % bootstrap interval {out['colocated_ttft_p99_ratio_ci90']}; target <= 1.2;"
          f" rounds' own p99 ratios {out['round_ttft_p99_ratios']}),"
          f" p50 ratio {out['ttft_p50_ratio']}; replica on device {replica_devices}, training on"
          f" {training_devices}; load average {load_before:.2f} before, {load_after:.2f}"
          " after", flush=True)
    print("waited for a CPU over all rounds (runnable, not running; ms): " + "; ".join(
        f"{side} " + ", ".join(f"{role} {ms}" for role, ms in waits.items())
        for side, waits in out["cpu_wait_ms"].items()), flush=True)
    if split:
        print(f"without the marketplace (the engine and a training process, each on its"
              f" slice's cores): TTFT p99 alone {split['direct_alone_ttft_p99_ms']} ms,"
              f" colocated {split['direct_colocated_ttft_p99_ms']} ms: ratio"
              f" {split['direct_ttft_p99_ratio']} (90 % interval"
              f" {split['direct_ttft_p99_ratio_ci90']})", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
