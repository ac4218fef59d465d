"""Many small jobs: job arrays of ``script`` tasks through a real local broker and two real
providers (TLS, signed calls and leases, every task transition committed to SQLite), each
beside Ray running the same tasks on the same machine in the same run; a small array of
another client submitted while a big one runs; and a training sweep as one array against the
same trainings submitted as separate jobs.

    .venv/bin/python bench/throughput.py [--tasks 10000] [--outputs 2000] [--heavy 1000]
                                         [--sweep 100] [--separate 6] [--cpu-devices 1]
                                         [--repeats 2] [--unpinned]
                                         [--only noop|outputs|heavy]

The cases: no-op tasks (``--tasks``); tasks that each do a little hashing (about 1 ms) and
write one small ``result.json`` through ``task.output_dir()`` (``--outputs``), every one then
fetched with ``gpumarket results`` and checked (a succeeded task without its right result is
a lost output); tasks of about 35 ms of hashing each that write the same (``--heavy``). Ray's
tasks do the same work and return the same result as a small dict (what a client fetches).
While a big array of client A runs on every device, client B submits an array of 20 tasks:
``small_array_wait_s`` is the broker's time from B's submission to B's first lease (the
larger of a light and a heavy run).

Each case runs ``--repeats`` times a side, ours and Ray's alternating (ours, Ray, Ray, ours
for 2), each side after the machine's dirty pages are written back (os.sync): a drift of the
machine's speed, or what one side left to write, falls on both alike. A ratio is the two
sides' rates over all their runs; each pair's own is printed.

Ray runs in the interpreter that $RAY_PYTHON names (Ray pins its own dependencies: keep it
in a virtual environment of its own), or in this one if it can import ray; without either
its figures are null. The last line is one JSON object: tasks_per_s, ray_tasks_per_s,
ratio_vs_ray, the same for the outputs and heavy cases, lost_outputs, small_array_wait_s,
array_speedup and the latencies. ``--only CASE`` runs that case's pairs alone (no fairness,
no sweep), its last line the case's figures.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpumarket.broker.jobs.arrays import STEAL_MIN_S  # noqa: E402

from bench.array_records import declines, ends, events, first_steal, lanes, steals  # noqa: E402
from tests.helpers import Marketplace, training_job, wait_until  # noqa: E402

# Every process a bench starts writes the bytecode it compiles, as an installed package has
# it (pip compiles; an editable install writes it on its first run): with
# PYTHONDONTWRITEBYTECODE set (this machine sets it) a module changed since its cached
# bytecode is compiled again at every client command's start (~100 ms), which no user sees.
# Here, where bench/cli_start.py and bench/array_cpu.py load it too.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

LIGHT_ROUNDS = 3_000        # sha256 rounds of an outputs task: about 1 ms here
HEAVY_ROUNDS = 100_000      # ... of a heavy task: 22-35 ms of a core here, by the load
SMALL_TASKS = 20            # client B's array

NOOP = "pass\n"
# The work of a task of the outputs and heavy cases, the same source on both sides: hash the
# task's index ROUNDS times. In a function on both sides: the same loop run at a module's top
# level (globals, not locals) took 17 % longer here (25.7 against 21.9 ms for 100,000
# rounds), which an earlier version of this bench measured against Ray's function.
WORK = """
def work(i, rounds):
    h = str(i).encode()
    for _ in range(rounds):
        h = hashlib.sha256(h).digest()
    return {"task": i, "digest": h.hex()}
"""
# A task of ours: that work on its index, its result written through the task's output dir.
HASHING = """
import hashlib, json, sys
from gpumarket.provider.runners import task
""" + WORK + """
(task.output_dir() / "result.json").write_text(json.dumps(work(task.index(), int(sys.argv[1]))))
"""
RAY_SCRIPT = r"""
import hashlib, json, sys, time
import ray
""" + WORK + r"""
n, rounds = int(sys.argv[1]), int(sys.argv[2])
ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
@ray.remote
def noop(i):
    return i
work = ray.remote(work)
run = (lambda i: noop.remote(i)) if rounds < 0 else (lambda i: work.remote(i, rounds))
ray.get([run(i) for i in range(100)])        # workers started
began = time.perf_counter()
pending = {run(i): time.perf_counter() for i in range(n)}
done, results = [], 0
while pending:
    ready, _ = ray.wait(list(pending), num_returns=min(len(pending), 256), timeout=10)
    now = time.perf_counter()
    done += [now - pending.pop(r) for r in ready]
    results += sum(1 for value in ray.get(ready) if rounds < 0 or "digest" in value)
wall = time.perf_counter() - began
done.sort()
print(json.dumps({"wall_s": wall, "p50_ms": done[len(done) // 2] * 1000,
                  "p99_ms": done[int(len(done) * 0.99) - 1] * 1000, "results": results}))
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
    exited_ms = time.time() * 1000
    found = re.search(r'"job_id": "(\w+)"', r.stdout)
    if found is None:
        raise SystemExit(f"submit failed: {r.stderr.strip()}")
    events = [json.loads(line) for line in r.stdout.splitlines()      # one a line (after
              if line.startswith('{"')]                                # the indented id)
    return {"job_id": found[1], "state": events[-1]["state"], "events": events,
            "exited_ms": exited_ms, "error": r.stderr.strip()[-300:]}


def all_tasks(market: Marketplace, job_id: str, count: int) -> list[dict]:
    r = market.cli("tasks", job_id, "--limit", str(count), "--json")
    if r.returncode != 0:
        raise SystemExit(f"tasks failed: {r.stderr.strip()}")
    return json.loads(r.stdout)["tasks"]


def array_file(root: Path, name: str, tasks: int, rounds: int | None) -> Path:
    """A script array of ``tasks`` tasks: no-ops (``rounds`` None) or hashing ones."""
    code = root / f"{name}.py"
    code.write_text(NOOP if rounds is None else HASHING)
    (root / f"{name}.jsonl").write_text("{}\n" * tasks)
    path = root / f"{name}.toml"
    args = "" if rounds is None else f'args = ["{rounds}"]'
    path.write_text(f"""
name = "{name}"
kind = "script"
max_price = 2.0
budget = 100

[script]
code = "{code}"
{args}

[array]
tasks = "{root / f'{name}.jsonl'}"
""")
    return path


def run_array(market: Marketplace, root: Path, name: str, tasks: int,
              rounds: int | None) -> dict:
    """Submit and follow an array to its end: its rate and latencies."""
    path = array_file(root, name, tasks, rounds)
    declined = declines(market)
    began_ms = time.time() * 1000
    began = time.perf_counter()
    watched = submit_and_watch(market, path)
    wall = time.perf_counter() - began
    job_id = watched["job_id"]
    job = market.job(job_id)
    if job["state"] != "SUCCEEDED":
        raise SystemExit(f"the {name} array ended {job['state']}: {job.get('error')}")
    rows = all_tasks(market, job_id, tasks)
    lat = [(t["updated_at_ms"] - began_ms) / 1000 for t in rows]
    return {"job_id": job_id, "wall_s": wall, "tasks_per_s": tasks / wall,
            "p50_ms": pct(lat, 0.5) * 1000, "p99_ms": pct(lat, 0.99) * 1000,
            "batches": len(job.get("parts", [])), "lanes": lanes(rows, began_ms),
            "ends": ends(watched, rows, began_ms), "steal": first_steal(market, rows),
            "steals": steals(market, rows, declined)}


def lost_outputs(market: Marketplace, root: Path, job_id: str, tasks: int,
                 rounds: int, check_digest: bool) -> int:
    """Fetch every succeeded task's outputs; count those without their right result."""
    out = root / f"results-{job_id}"
    r = market.cli("results", job_id, "-o", str(out), "--json", timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"results failed: {r.stderr.strip()}")
    succeeded = [t["task"] for t in json.loads(r.stdout)["tasks"] if t["state"] == "SUCCEEDED"]
    lost = tasks - len(succeeded)
    for i in succeeded:
        f = out / f"task-{i:06d}" / "result.json"
        try:
            got = json.loads(f.read_text())
        except (OSError, ValueError):
            lost += 1
            continue
        if got.get("task") != i or not check_digest:
            lost += got.get("task") != i
            continue
        h = str(i).encode()
        for _ in range(rounds):
            h = hashlib.sha256(h).digest()
        lost += got.get("digest") != h.hex()
    return lost


def ray_run(tasks: int, rounds: int) -> dict | None:
    """Ray on ``tasks`` tasks (``rounds`` < 0: no-ops); None where Ray is not there."""
    python = os.environ.get("RAY_PYTHON")
    if not python:
        try:
            import ray  # noqa: F401
            python = sys.executable
        except ImportError:
            return None
    r = subprocess.run([python, "-c", RAY_SCRIPT, str(tasks), str(rounds)],
                       capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        print(f"ray failed: {r.stderr.strip().splitlines()[-1:]}")
        return None
    got = json.loads(r.stdout.strip().splitlines()[-1])
    got["tasks_per_s"] = tasks / got["wall_s"]
    return got


def compare(label: str, tasks: int, ours: dict, ray: dict | None) -> float | None:
    print(f"{label}, {tasks:,} tasks on 2 providers: {ours['wall_s']:.1f}s,"
          f" {ours['tasks_per_s']:,.0f} tasks/s, submit->done p50 {ours['p50_ms']:,.0f} ms"
          f" p99 {ours['p99_ms']:,.0f} ms, {ours['batches']} leases")
    for lane in ours["lanes"]:
        print(f"  lane {lane['provider']}: {lane['tasks']:,} tasks, last ended at"
              f" {lane['end_s']:.2f}s, {lane['task_s']:.2f}s inside its tasks, its last"
              f" update {lane['last_update']:,} tasks")
    n = ours["steal"]
    if n is None:
        pass
    elif n["yield_ms"] is not None:
        print(f"  its first two leases ended {n['apart_s']:.2f}s apart; the first's end asked"
              f" the other to yield {n['yield_ms']} ms after its last task, {n['marked']} tasks"
              f" marked, {n['ran_anyway']} of its tasks reported after (run already)")
    else:
        pace = "no pace yet" if n["estimate_s"] is None else f"{n['estimate_s']:.2f}s at its pace"
        print(f"  its first two leases ended {n['apart_s']:.2f}s apart, no steal: at the first's"
              f" end the other had {n['left']:,} tasks not reported, {pace} (a steal needs"
              f" {STEAL_MIN_S}s)")
    n = ours["steals"]
    print(f"  yields asked {n['asked']}: {n['marked']:,} tasks marked, {n['ran_anyway']:,} of"
          f" them reported all the same (run already, or the current task), {n['moved']:,}"
          f" moved to new leases; steals declined by their provider {n['declined']}")
    e = ours["ends"]
    print(f"  ends (ms): process start -> submitted {e['submit_ms']:.0f}, -> first lease"
          f" {e['lease_ms']:.0f}, -> first task recorded {e['first_task_ms']:.0f}; last task"
          f" recorded -> succeeded {e['succeeded_ms']:.0f}, -> process exit {e['exit_ms']:.0f}")
    if ray is None:
        print(f"ray, {label}: skipped (set RAY_PYTHON to a Python that imports ray)")
        return None
    print(f"ray, {label}, {tasks:,} tasks: {ray['wall_s']:.1f}s, {ray['tasks_per_s']:,.0f}"
          f" tasks/s, p50 {ray['p50_ms']:,.0f} ms p99 {ray['p99_ms']:,.0f} ms")
    return ours["tasks_per_s"] / ray["tasks_per_s"]


def settle_disk() -> None:
    """Write back what the machine holds dirty before a timed side, so that neither side pays
    for the one before it: the other side's work and the results fetched left up to 29 MB
    dirty before our heavy run against 5 MB before Ray's, and our broker's first syncfs
    (broker/store/artifact_store.py) writes back all of it."""
    os.sync()


def paired(market: Marketplace, root: Path, label: str, name: str, tasks: int,
           rounds: int | None, repeats: int) -> tuple[list[dict], list[dict], float | None]:
    """One case, ours and Ray's, ``repeats`` times in the order ours-Ray, Ray-ours, ... (A B
    B A for 2: a drift of the machine's speed over the case falls on both sides alike), each
    side after settle_disk. Our runs with outputs are each checked for lost ones (``lost``).
    Returns our runs, Ray's (empty without Ray) and the ratio of the two sides' rates over
    all their runs (tasks over seconds), or None without Ray."""
    ours: list[dict] = []
    ray: list[dict] = []
    for k in range(repeats):
        for side in ("ours", "ray") if k % 2 == 0 else ("ray", "ours"):
            settle_disk()
            if side == "ray":
                got = ray_run(tasks, -1 if rounds is None else rounds)
                if got is not None:
                    ray.append(got)
                continue
            run = run_array(market, root, f"{name}-{k + 1}", tasks, rounds)
            run["lost"] = 0 if rounds is None else lost_outputs(
                market, root, run["job_id"], tasks, rounds, rounds == LIGHT_ROUNDS)
            ours.append(run)
    pairs = [compare(label, tasks, a, b) for a, b in zip(ours, ray + [None] * len(ours))]
    if not ray:
        return ours, ray, None
    rate = (len(ours) * tasks / sum(run["wall_s"] for run in ours)) / \
        (len(ray) * tasks / sum(run["wall_s"] for run in ray))
    print(f"{label}: ours / Ray over {len(ours)} runs each {rate:.3f} (each pair:"
          f" {', '.join(f'{r:.3f}' for r in pairs if r is not None)})")
    return ours, ray, rate


def other_client(market: Marketplace, root: Path) -> Marketplace:
    """Client B: the same broker, a key of its own, credited."""
    b = copy.copy(market)
    b.home = root / "client-b"
    r = b.cli("keys", "init")
    if r.returncode != 0:
        raise SystemExit(f"keys init failed: {r.stderr.strip()}")
    b.credit(b.identity().id, 1000)
    return b


def small_array_wait(market: Marketplace, b: Marketplace, root: Path, name: str, tasks: int,
                     rounds: int) -> float:
    """A's array of ``tasks`` runs on every device; B submits 20 tasks of the same work:
    seconds from B's submission to its first lease, as the broker recorded them."""
    a_id = submit(market, array_file(root, f"{name}-a", tasks, rounds))
    wait_until(lambda: market.job(a_id).get("array", {}).get("succeeded", 0) >= 8,
               "A's array under way", timeout=600)
    b_id = submit(b, array_file(root, f"{name}-b", SMALL_TASKS, rounds))
    b_events = events(b, b_id)      # to B's end
    if b_events[-1]["state"] != "SUCCEEDED":
        raise SystemExit(f"B's array ended {b_events[-1]['state']}")
    submitted = int(b_events[0]["at_ms"])
    first = min(int(e["at_ms"]) for e in b_events if e["state"] == "RUNNING")
    a_state = market.job(a_id)["state"]
    a_events = events(market, a_id)
    if a_events[-1]["state"] != "SUCCEEDED":
        raise SystemExit(f"A's array ended {a_events[-1]['state']}")
    if a_state not in ("RUNNING", "QUEUED"):
        print(f"  (A's array had ended, {a_state}, when B's did: the wait is not under load)")
    return (first - submitted) / 1000


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


def mean(runs: list[dict], field: str, digits: int) -> float | None:
    """``field``'s mean over ``runs`` (None where there are none: no Ray)."""
    return round(sum(run[field] for run in runs) / len(runs), digits) if runs else None


def rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


# --only's cases: (label, run name, the option that counts its tasks, hashing rounds).
CASES = {"noop": ("no-op", "noop", "tasks", None),
         "outputs": ("one result.json each", "outputs", "outputs", LIGHT_ROUNDS),
         "heavy": ("35 ms and one result.json each", "heavy", "heavy", HEAVY_ROUNDS)}


def one_case(market: Marketplace, root: Path, args: argparse.Namespace) -> dict:
    """``--only``: one case's pairs alone; its figures."""
    label, name, option, rounds = CASES[args.only]
    tasks = getattr(args, option)
    ours, ray, ratio = paired(market, root, label, name, tasks, rounds, args.repeats)
    return {"case": args.only, "tasks": tasks, "repeats": args.repeats,
            "tasks_per_s": mean(ours, "tasks_per_s", 2),
            "ray_tasks_per_s": mean(ray, "tasks_per_s", 2),
            "ratio_vs_ray": rounded(ratio, 3),
            "lost_outputs": sum(run["lost"] for run in ours),
            "lane_end_s": [[lane["end_s"] for lane in run["lanes"]] for run in ours],
            "steals": [run["steals"] for run in ours]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=10_000, help="no-op tasks in the array")
    ap.add_argument("--outputs", type=int, default=2_000,
                    help="tasks that each hash a little and write one result.json")
    ap.add_argument("--heavy", type=int, default=1_000,
                    help="tasks of about 35 ms of hashing that each write one result.json")
    ap.add_argument("--sweep", type=int, default=100, help="one-step trainings in the array")
    ap.add_argument("--separate", type=int, default=6,
                    help="one-step trainings submitted as separate jobs (the baseline)")
    ap.add_argument("--cpu-devices", type=int, default=1,
                    help="devices each of the two providers offers its cores as (lanes)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of each case a side, ours and Ray's alternating (A B B A)")
    ap.add_argument("--only", choices=sorted(CASES),
                    help="run this case's pairs alone (its count from its option)")
    ap.add_argument("--unpinned", action="store_true",
                    help="start the providers on every core, not each on one of its own")
    args = ap.parse_args()
    if args.unpinned:
        # Ray's two workers may run on either core; with this, so may the providers' job
        # processes. Pinned each to one core (the default, as tests start providers), a lane
        # whose core the broker or anything else takes cannot move to the other one: 35 ms
        # tasks at load 6 ran at 28 and 20 tasks/s pinned, 38 and 33 not (alternating). But
        # a CPU job then gets both cores' threads: two one-step trainings at once
        # oversubscribe them (docs/provider.md): the sweep at 47.5 jobs/s pinned, 3.2 not
        # (one full run each, load 8-10).
        os.environ["TESTS_PROVIDER_CPUS"] = "all"
    root = Path(tempfile.mkdtemp(prefix="gpumarket-throughput-"))
    market = Marketplace(root)
    only = None
    try:
        market.start_broker("--heartbeat-interval", "1")
        market.cli("keys", "init")
        for name in ("p1", "p2"):
            # Each provider runs on one of this machine's cores (tests/helpers.py one_cpu;
            # every core with --unpinned) and offers them as --cpu-devices devices: one lane
            # each by default, as Ray's num_cpus=2 gives it two workers.
            market.start_provider(name, 1.0, "--kinds", "script,training",
                                  "--cpu-devices", str(args.cpu_devices))
        market.wait_for_offers(2)
        # Measured once every forkserver has its imports (the training one takes seconds of
        # CPU: measuring beside it measured this machine's two cores shared with it).
        wait_until(lambda: all(f"forkserver for gpumarket.provider.runners.{kind} ready"
                               in p.text() for p in market.providers.values()
                               for kind in ("script", "training")),
                   "the providers' forkservers", timeout=300)
        run_array(market, root, "warm-up", 100, None)    # as Ray's run has (workers started)
        if args.only:
            only = one_case(market, root, args)
            return
        noop, ray_noop, ratio = paired(market, root, "no-op", "noop", args.tasks, None,
                                       args.repeats)
        light, ray_light, ratio_outputs = paired(market, root, "one result.json each",
                                                 "outputs", args.outputs, LIGHT_ROUNDS,
                                                 args.repeats)
        heavy, ray_heavy, ratio_heavy = paired(market, root, "35 ms and one result.json each",
                                               "heavy", args.heavy, HEAVY_ROUNDS, args.repeats)
        lost = sum(run["lost"] for run in light + heavy)
        print(f"outputs lost (succeeded without their right result.json): {lost}")

        b = other_client(market, root)
        waits = [small_array_wait(market, b, root, "fair-light", args.outputs, LIGHT_ROUNDS),
                 small_array_wait(market, b, root, "fair-heavy", max(200, args.heavy // 4),
                                  HEAVY_ROUNDS)]
        print(f"client B's {SMALL_TASKS}-task array, first lease after its submission while"
              f" A's array runs: {waits[0]:.2f}s (light tasks), {waits[1]:.2f}s (heavy)")

        sweep = training_sweep(market, root, args.sweep, args.separate)
        speedup = sweep["array_jobs_per_s"] / sweep["separate_jobs_per_s"]
        print(f"one-step trainings: {args.sweep} as one array {sweep['array_jobs_per_s']:.2f}"
              f" jobs/s; {args.separate} separate jobs {sweep['separate_jobs_per_s']:.3f} jobs/s;"
              f" {speedup:.1f}x")
    finally:
        market.close()
        if only is not None:
            print(json.dumps(only))
    print(json.dumps({
        "pinned": not args.unpinned,
        "repeats": args.repeats,
        "tasks": args.tasks, "tasks_per_s": mean(noop, "tasks_per_s", 1),
        "submit_to_done_p50_ms": mean(noop, "p50_ms", 1),
        "submit_to_done_p99_ms": mean(noop, "p99_ms", 1),
        "ray_tasks_per_s": mean(ray_noop, "tasks_per_s", 1),
        "ray_p50_ms": mean(ray_noop, "p50_ms", 1),
        "ray_p99_ms": mean(ray_noop, "p99_ms", 1),
        "ratio_vs_ray": rounded(ratio, 3),
        "outputs_tasks": args.outputs, "outputs_tasks_per_s": mean(light, "tasks_per_s", 1),
        "ray_outputs_tasks_per_s": mean(ray_light, "tasks_per_s", 1),
        "ratio_vs_ray_outputs": rounded(ratio_outputs, 3),
        "heavy_tasks": args.heavy, "heavy_tasks_per_s": mean(heavy, "tasks_per_s", 2),
        "ray_heavy_tasks_per_s": mean(ray_heavy, "tasks_per_s", 2),
        "ratio_vs_ray_heavy": rounded(ratio_heavy, 3),
        "lost_outputs": lost,
        # Of each case's first run of ours:
        "outputs_lane_end_s": [lane["end_s"] for lane in light[0]["lanes"]],
        "outputs_last_update_tasks": [lane["last_update"] for lane in light[0]["lanes"]],
        "outputs_first_steal": light[0]["steal"],
        "outputs_steals": light[0]["steals"],
        "heavy_steals": heavy[0]["steals"],
        "noop_steals": noop[0]["steals"],
        "outputs_ends_ms": {k: round(v) for k, v in light[0]["ends"].items()},
        "heavy_lane_end_s": [lane["end_s"] for lane in heavy[0]["lanes"]],
        "small_array_wait_s": round(max(waits), 3),
        "small_array_wait_light_s": round(waits[0], 3),
        "small_array_wait_heavy_s": round(waits[1], 3),
        "array_jobs_per_s": round(sweep["array_jobs_per_s"], 3),
        "separate_jobs_per_s": round(sweep["separate_jobs_per_s"], 4),
        "array_speedup": round(speedup, 1),
    }))


if __name__ == "__main__":
    main()
