"""Job arrays with real broker and provider processes: no task succeeds without its outputs
stored, however the upload path fails (a provider whose uploads are refused for a while, a
broker throttling calls); a small array of another client starts while a big one runs (the
big one's leases yield between tasks); and a resubmission of the failed tasks alone."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.conftest import own_tracebacks
from tests.helpers import BIN, LEASE_ARGS, ROOT, Marketplace, Process, free_port, wait_until

pytestmark = pytest.mark.e2e

RESULT = '''
import json, time
from gpumarket.provider.runners import task
i = task.index()
time.sleep(float(task.params()["args"][0]))
(task.output_dir() / "result.json").write_text(json.dumps({"task": i, "square": i * i}))
'''


def array_file(root: Path, name: str, tasks: int, sleep_s: float, per_lease: int = 0,
               max_attempts: int = 3) -> Path:
    (root / "result.py").write_text(RESULT)
    (root / f"{name}.jsonl").write_text("{}\n" * tasks)
    path = root / f"{name}.toml"
    path.write_text(f"""
name = "{name}"
kind = "script"
max_price = 2.0
max_attempts = {max_attempts}

[script]
code = "{root / 'result.py'}"
args = ["{sleep_s}"]

[array]
tasks = "{root / f'{name}.jsonl'}"
per_lease = {per_lease}
""")
    return path


def submit(market: Marketplace, path: Path) -> str:
    r = market.cli("submit", str(path))
    assert r.returncode == 0, r.stderr
    return r.stdout.split()[0]


def tasks_of(market: Marketplace, job_id: str) -> list[dict]:
    r = market.cli("tasks", job_id, "--limit", "100000", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["tasks"]


def check_results(market: Marketplace, job_id: str, out: Path) -> list[int]:
    """Every succeeded task's result is downloadable and hash-checked (by `results`), and
    right; returns the succeeded tasks."""
    r = market.cli("results", job_id, "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    succeeded = [t for t in tasks_of(market, job_id) if t["state"] == "SUCCEEDED"]
    for t in succeeded:
        assert [o["name"] for o in t["outputs"]] == [f"task{t['task']:06d}.result.json"], t
        got = json.loads((out / f"task-{t['task']:06d}" / "result.json").read_text())
        assert got == {"task": t["task"], "square": t["task"] ** 2}, got
    return [t["task"] for t in succeeded]


@pytest.fixture
def throttled(tmp_path):
    """A broker that takes 5 calls a second a key (a provider: 5 a second for each of its
    devices' artifact calls), and a client key."""
    m = Marketplace(tmp_path)
    m.start_broker(*LEASE_ARGS, "--rate-limit", "5")
    assert m.cli("keys", "init").returncode == 0
    yield m
    m.close()
    for name, proc in m.providers.items():
        assert "Traceback" not in proc.text(), f"{name} logged a traceback:\n{proc.text()}"
    assert not own_tracebacks(m.broker.text()), m.broker.text()


def test_no_task_succeeds_without_its_outputs_when_uploads_fail_and_are_throttled(
        throttled, tmp_path):
    m = throttled
    (tmp_path / "flaky").mkdir()
    m.providers["flaky"] = Process(
        [str(BIN / "python"), "-m", "tests.flaky_provider", "run", "--broker", m.address,
         "--data-dir", str(tmp_path / "flaky"), "--price", "1.0", "--kinds", "script"],
        tmp_path / "flaky.log", {**m.env, "PYTHONPATH": str(ROOT), "FLAKY_FOR_S": "4"})
    m.start_provider("honest", 1.0, "--kinds", "script")
    m.wait_for_offers(2)
    job_id = submit(m, array_file(tmp_path, "sweep", 80, 0.01, per_lease=20))
    job = wait_until(lambda: (j := m.job(job_id))["state"] in ("SUCCEEDED", "FAILED") and j,
                     "the array to end", timeout=240, interval=1.0)
    succeeded = check_results(m, job_id, tmp_path / "out")
    # Refused for 4 s, its tries back off past that: nothing was lost or even retried.
    assert job["state"] == "SUCCEEDED" and len(succeeded) == 80, job
    flaky = m.providers["flaky"].text()
    assert "not stored (try 1 of 5)" in flaky, flaky[-3000:]    # its uploads were refused


def test_task_results_that_ended_while_the_broker_was_down_arrive_after_its_restart(
        tmp_path):
    """An array lease's tasks end while its broker is down (killed): their results, with
    the small outputs they carry, are kept by the provider and sent again on its new
    session; every task is SUCCEEDED with its right result, none run again."""
    m = Marketplace(tmp_path)
    port = free_port()
    try:
        m.start_broker(listen=f"127.0.0.1:{port}")
        assert m.cli("keys", "init").returncode == 0
        m.start_provider("p1", 1.0, "--kinds", "script")
        m.wait_for_offers(1)
        # One lease of 60 tasks of 0.15 s: the broker hears of them at most once a second,
        # so when it counts 3 the lease may be 10 in; the kill must then come while 8 more
        # are still to end: 40 tasks left a loaded test about 3 s for it, 60 leave about 6.
        job_id = submit(m, array_file(tmp_path, "sweep", 60, 0.15, per_lease=60))
        wait_until(lambda: m.job(job_id).get("array", {}).get("succeeded", 0) >= 3,
                   "the first tasks to succeed", timeout=120, interval=0.2)
        m.broker.stop(signal.SIGKILL)
        workdir = m.root / "p1" / "jobs" / f"{job_id}-1.1"
        # Tasks that leave outputs leave their directory: 8 more have ended, unsent.
        told = len(list((workdir / "tasks").iterdir()))
        wait_until(lambda: len(list((workdir / "tasks").iterdir())) >= told + 8,
                   "tasks to end while the broker is down", timeout=60, interval=0.1)
        m.start_broker(listen=f"127.0.0.1:{port}", credit=0)
        job = wait_until(lambda: (j := m.job(job_id))["state"] in ("SUCCEEDED", "FAILED") and j,
                         "the array to end", timeout=240, interval=0.5)
        assert job["state"] == "SUCCEEDED", job
        assert sorted(check_results(m, job_id, tmp_path / "out")) == list(range(60))
        assert all(t["attempts"] == 0 for t in tasks_of(m, job_id))
        assert "Traceback" not in m.providers["p1"].text()
    finally:
        m.close()


def test_a_small_array_of_another_client_starts_while_a_big_one_runs(market, tmp_path):
    """A's array takes every device with leases of many tasks; B's small array waits for a
    device: A's leases are asked to yield after their current task, B runs, and A's tasks
    that did not run go back to the queue (no attempt counted) and all succeed."""
    market.start_provider("p1", 1.0, "--kinds", "script")
    market.start_provider("p2", 1.0, "--kinds", "script")
    market.wait_for_offers(2)
    # 0.5 s a task, about 30 s a device: B's key, credit and submission (CLI calls, slow on
    # a loaded machine) come well before A could end without yielding (at 0.1 s it could).
    a_id = submit(market, array_file(tmp_path, "big", 120, 0.5, max_attempts=1))
    wait_until(lambda: market.job(a_id).get("array", {}).get("succeeded", 0) >= 4,
               "A's array under way", timeout=120)
    b = Marketplace(tmp_path)
    b.__dict__.update(market.__dict__)
    b.home = tmp_path / "client-b"
    assert b.cli("keys", "init").returncode == 0
    market.credit(b.identity().id, 100)
    b_id = submit(b, array_file(tmp_path, "small", 4, 0.01))
    b_job = b.wait_state(b_id, "SUCCEEDED", timeout=120)
    a_job = market.job(a_id)
    # B ran while A's array still had most of its tasks to run (two leases of 60 tasks of
    # 0.5 s each: without a yield, B would wait for one of them to end).
    assert a_job["state"] == "RUNNING", a_job
    assert a_job["array"].get("succeeded", 0) < 100, a_job["array"]
    assert b_job["array"] == {"tasks": 4, "succeeded": 4}, b_job
    market.wait_state(a_id, "SUCCEEDED", timeout=180)
    assert len(check_results(market, a_id, tmp_path / "out")) == 120
    assert "yields after its current task" in market.providers["p1"].text() + \
        market.providers["p2"].text()


def test_the_failed_tasks_alone_run_again_with_their_own_indices(market, tmp_path):
    market.start_provider("p1", 1.0, "--kinds", "script")
    market.wait_for_offers(1)
    (tmp_path / "picky.py").write_text(
        "import json, sys\nfrom gpumarket.provider.runners import task\n"
        "i = task.index()\nif i % 5 == 2:\n    raise ValueError(f'task {i} refuses')\n"
        "(task.output_dir() / 'i.json').write_text(json.dumps(i))\n")
    (tmp_path / "t.jsonl").write_text("{}\n" * 12)
    path = tmp_path / "picky.toml"
    path.write_text(f"""
kind = "script"
max_price = 2.0
max_attempts = 1

[script]
code = "{tmp_path / 'picky.py'}"

[array]
tasks = "{tmp_path / 't.jsonl'}"
""")
    job_id = submit(market, path)
    market.wait_state(job_id, "FAILED", timeout=120)
    r = market.cli("tasks", job_id, "--failed")
    assert r.returncode == 0 and r.stdout.strip() == "2,7", (r.stdout, r.stderr)
    r = market.cli("tasks", job_id, "--failed", "--json")
    assert json.loads(r.stdout)["failed"] == [2, 7]
    for bad, words in ((["--tasks", "5-2"], "a range goes up"),
                       (["--tasks", "12"], "past the array's 12 tasks"),
                       (["--tasks", "x"], "not a task index"), ([], "either --failed or")):
        r = market.cli("resubmit", job_id, *bad)
        assert r.returncode != 0 and words in r.stderr, (bad, r.stderr)
        assert "Traceback" not in r.stderr and r.stderr.lower().count("error") == 1
    r = market.cli("resubmit", job_id, "--failed", "--json")
    assert r.returncode == 0, r.stderr
    again = json.loads(r.stdout)
    assert again["tasks"] == [2, 7] and again["of"] == job_id
    job = market.wait_state(again["job_id"], "FAILED", timeout=120)
    assert job["array"] == {"tasks": 2, "failed": 2}, job
    failed = tasks_of(market, again["job_id"])
    assert [(t["task"], t["error"]) for t in failed] == [
        (2, "the script raised ValueError: task 2 refuses"),
        (7, "the script raised ValueError: task 7 refuses")]
    # Named tasks that succeed: each writes its own index, as the first time.
    r = market.cli("resubmit", job_id, "--tasks", "0,9-10", "--json")
    assert r.returncode == 0, r.stderr
    named = json.loads(r.stdout)["job_id"]
    market.wait_state(named, "SUCCEEDED", timeout=120)
    out = tmp_path / "out"
    assert market.cli("results", named, "-o", str(out)).returncode == 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == \
        ["task-000000", "task-000009", "task-000010"]
    assert json.loads((out / "task-000009" / "i.json").read_text()) == 9
