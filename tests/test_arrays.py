"""Job arrays end to end with real broker and provider processes: a sweep of the client's
own Python (the ``script`` kind) whose failing tasks run again without failing their
siblings, per-task results fetched as they complete, cancel, and a training sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import wait_until

pytestmark = pytest.mark.e2e

SCRIPT = '''
import json, sys
from gpumarket.provider.runners import task
p = task.params()
n = int(sys.argv[1])
if n % 7 == 3:
    raise ValueError(f"task {p['task']} refuses {n}")
(task.output_dir() / "square.json").write_text(json.dumps({"n": n, "square": n * n}))
task.metrics(n=n)
'''


def array_job(path: Path, tasks: int, per_lease: int = 4, **top) -> Path:
    (path.parent / "main.py").write_text(SCRIPT)
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in top.items())
    grid = json.dumps([[str(i)] for i in range(tasks)])
    path.write_text(f"""
name = "sweep"
kind = "script"
max_price = 2.0
max_attempts = 2
{lines}

[script]
code = "main.py"

[array]
grid = {{ args = {grid} }}
per_lease = {per_lease}
""")
    return path


def submit(market, path: Path) -> str:
    r = market.cli("submit", str(path))
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[0]


def test_a_script_array_runs_every_task_and_retries_only_the_failed(market, tmp_path):
    market.start_provider("p1", 1.0, "--kinds", "script")
    market.start_provider("p2", 1.0, "--kinds", "script,training")
    market.wait_for_offers(2)
    job_id = submit(market, array_job(tmp_path / "sweep.toml", 20))
    job = market.wait_state(job_id, "FAILED", timeout=180)
    assert job["array"] == {"tasks": 20, "succeeded": 17, "failed": 3}, job["array"]
    assert "3 of 20 tasks failed" in job["error"]
    r = market.cli("tasks", job_id, "--state", "failed", "--json")
    assert r.returncode == 0, r.stderr
    failed = json.loads(r.stdout)["tasks"]
    assert [t["task"] for t in failed] == [3, 10, 17]
    assert all(t["attempts"] == 2 and "refuses" in t["error"] for t in failed), failed
    out = tmp_path / "out"
    r = market.cli("results", job_id, "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    for n in range(20):
        f = out / f"task-{n:06d}" / "square.json"
        assert f.exists() == (n % 7 != 3), n
        if f.exists():
            assert json.loads(f.read_text()) == {"n": n, "square": n * n}
    r = market.cli("status", job_id)
    assert "20 tasks: 17 succeeded, 3 failed" in r.stdout, r.stdout
    # Left to the broker, an array is spread over the devices that can run it: one lease on
    # each provider's one device here, not eight leases in waves.
    job_id = submit(market, array_job(tmp_path / "spread.toml", 12, per_lease=0))
    market.wait_state(job_id, "FAILED", timeout=180)
    r = market.cli("tasks", job_id, "--json")
    assert r.returncode == 0, r.stderr
    first = {t["batch"] for t in json.loads(r.stdout)["tasks"] if t["task"] % 7 != 3}
    assert len(first) == 2, first


def test_cancel_stops_the_rest_and_keeps_what_finished(market, tmp_path):
    market.start_provider("p1", 1.0, "--kinds", "script")
    market.wait_for_offers(1)
    # The first tasks end quickly, the rest outlast anything the test does before its
    # cancel: with 0.3 s each, a busy machine's CLI calls took longer than all 60 tasks.
    (tmp_path / "slow.py").write_text(
        "import time\nfrom gpumarket.provider.runners import task\n"
        "time.sleep(0.3 if task.params()['task'] < 5 else 120)\n"
        "(task.output_dir() / 'n.txt').write_text(str(task.params()['task']))\n")
    (tmp_path / "tasks.jsonl").write_text('{"steps": 1}\n' * 60)
    path = tmp_path / "slow.toml"
    path.write_text(f"""
kind = "script"
max_price = 2.0

[script]
code = "{tmp_path / 'slow.py'}"

[array]
tasks = "{tmp_path / 'tasks.jsonl'}"
per_lease = 60
""")
    job_id = submit(market, path)
    wait_until(lambda: market.job(job_id).get("array", {}).get("succeeded", 0) >= 3,
               "some tasks done", timeout=120)
    # The tasks that ended can be fetched while their lease still runs: each task's outputs
    # went up as it ended, under a receipt of its own.
    r = market.cli("results", job_id, "-o", str(tmp_path / "early"), "--json")
    assert r.returncode == 0, r.stderr
    early = json.loads(r.stdout)
    assert early["files"] >= 3, early
    for t in early["tasks"]:
        assert (tmp_path / "early" / f"task-{t['task']:06d}" / "n.txt").read_text() \
            == str(t["task"])
    assert market.job(job_id)["state"] == "RUNNING"     # one lease of 60 tasks
    r = market.cli("cancel", job_id)
    assert r.returncode == 0, r.stderr
    job = market.wait_state(job_id, "CANCELLED", timeout=60)
    counts = job["array"]
    assert counts.get("succeeded", 0) >= 3 and counts.get("cancelled", 0) > 0, counts
    assert counts.get("succeeded", 0) + counts.get("cancelled", 0) == 60, counts
    assert not counts.get("running") and not counts.get("queued"), counts
