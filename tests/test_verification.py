"""Spot checks end to end, with real processes: a provider that doctors its results
(tests/cheating_provider.py) among honest ones is caught by replay, its work re-run elsewhere,
its pay returned to the client, and banned; honest providers' work is checked and paid."""

from __future__ import annotations

import json
import sqlite3
import subprocess

import pytest

from tests.helpers import BIN, LEASE_ARGS, Marketplace, training_job, wait_until

pytestmark = pytest.mark.e2e


def ledger_balance(root, account: str) -> int:
    with sqlite3.connect(f"file:{root / 'broker' / 'broker.db'}?mode=ro", uri=True) as db:
        row = db.execute("SELECT balance FROM ledger_entries WHERE account = ?"
                         " ORDER BY posting_seq DESC LIMIT 1", [account]).fetchone()
    return row[0] if row else 0


def audit(market: Marketplace, root) -> dict:
    r = subprocess.run([str(BIN / "gpumarket-broker"), "admin", "audit", "--json", "--key",
                        str(root / "broker" / "broker.key")], env=market.env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def cheat_among_honest(market: Marketplace, mode: str) -> tuple[str, str, str]:
    """A broker with checks on, a cheat ("cheat", by far the cheapest: jobs go to it first)
    and two honest providers ("h1", "h2"); their ids. The matcher ranks by price x expected
    time: at 0.5 against 1.0 an honest provider whose benchmark ran on a less loaded moment
    could win the job, and the cheat was then caught only as its checker; at 0.1 it would
    need to measure ten times faster."""
    market.start_broker(*LEASE_ARGS, verify=True)
    market.warm = mode == "weights"     # text and frames: no kind with a warm runner runs
    market.start_provider("cheat", 0.1, cheat=mode)
    market.start_provider("h1", 1.0)
    market.start_provider("h2", 1.5)
    market.wait_for_offers(3)
    return tuple(market.provider_id(n) for n in ("cheat", "h1", "h2"))


def run_to_end(market: Marketplace, job) -> tuple[str, dict]:
    """Submit the job file; wait for it to succeed; (its id, its status)."""
    r = market.cli("submit", str(job), "--json")
    assert r.returncode == 0, r.stderr
    job_id = json.loads(r.stdout)["job_id"]
    final = market.wait_state(job_id, "SUCCEEDED", "FAILED", timeout=400)
    assert final["state"] == "SUCCEEDED", (final, market.cli("logs", job_id).stdout)
    return job_id, final


def test_a_provider_that_corrupts_weights_is_caught_re_run_unpaid_and_banned(tmp_path):
    market = Marketplace(tmp_path)
    try:
        cheat, h1, h2 = cheat_among_honest(market, "weights")
        job_id, final = run_to_end(market, training_job(tmp_path / "job.toml", steps=60,
                                                        checkpoint_every=20))

        v = final["verification"]
        checks = v["checks"]
        assert v["status"] == "disputed -> re-run", v
        # The cheat's replayed segment disagreed, a third provider sided with the replay.
        caught = [c for c in checks if c["provider_id"] == cheat and c["state"] == "failed"]
        assert caught, checks
        # No honest provider's work was ever found wrong.
        assert not [c for c in checks if c["provider_id"] in (h1, h2)
                    and c["state"] == "failed"], checks
        assert final["provider_id"] in (h1, h2)

        # The cheat keeps nothing: its pay went back to the hold, and from there to the client.
        assert ledger_balance(tmp_path, f"provider:{cheat}") == 0
        assert ledger_balance(tmp_path, f"disputed:{job_id}:{cheat}") == 0
        # Honest work is paid, and none of it was taken back. (A new provider pays its own
        # warm-up checks out of what it earned, never more: the one that re-ran the job can
        # end at 0 where its checkers were dearer than its work, as in one CI run.)
        assert ledger_balance(tmp_path, f"provider:{h1}") + ledger_balance(
            tmp_path, f"provider:{h2}") > 0
        with sqlite3.connect(f"file:{tmp_path / 'broker' / 'broker.db'}?mode=ro", uri=True) as db:
            reversed_ = {r[0] for r in db.execute(
                "SELECT provider_id FROM ledger_postings WHERE type = 'reverse'")}
        assert reversed_ == {cheat}, reversed_
        books = audit(market, tmp_path)
        assert books["ok"], books

        # Its record: failed checks, then banned after BAN_AFTER = 2 failures. Found wrong on
        # a job, it gets none of that job's work again, to run or to check: its second
        # failure comes from its next job (unless a second segment of this one was checked
        # before its first conviction), whose one segment is checked (its streak is 0).
        run_to_end(market, training_job(tmp_path / "job2.toml", steps=20,
                                        checkpoint_every=20))

        def banned():
            r = subprocess.run([str(BIN / "gpumarket-broker"), "providers", "--json",
                                "--key", str(tmp_path / "broker" / "broker.key")],
                               env=market.env, capture_output=True, text=True, timeout=60)
            rows = {p["provider_id"]: p for p in json.loads(r.stdout)}
            return rows[cheat].get("banned") and rows
        rows = wait_until(banned, "the cheat to be banned", 120, interval=0.5)
        assert not rows[h1].get("banned") and not rows[h2].get("banned")
        assert rows[cheat]["checks_failed"] >= 2, rows[cheat]
        # The client sees how its job was checked.
        status = market.cli("status", job_id)
        assert "disputed -> re-run" in status.stdout and cheat[:12] in status.stdout, \
            status.stdout
    finally:
        market.close()


def test_honest_providers_work_is_checked_verified_and_paid(tmp_path):
    market = Marketplace(tmp_path)
    try:
        market.start_broker(*LEASE_ARGS, verify=True)
        for name, price in (("h1", 0.5), ("h2", 1.0)):
            market.start_provider(name, price)
        market.wait_for_offers(2)
        h1, h2 = market.provider_id("h1"), market.provider_id("h2")
        job_id, final = run_to_end(market, training_job(
            tmp_path / "job.toml", steps=40, checkpoint_every=20, extra='verify = "always"'))
        v = final["verification"]
        # verify = "always": both segments (0-20 and 20-40) replayed on the other provider.
        # Which provider ran a segment is the matcher's choice (price x measured speed: on a
        # loaded machine h2's benchmark can beat h1's by more than its price), so the test
        # reads it from each check instead of assuming h1.
        assert v["status"] == "verified", v
        assert sorted(c["what"] for c in v["checks"]) == ["steps 0-20", "steps 20-40"], v
        for c in v["checks"]:
            assert c["state"] == "passed", v
            assert {c["provider_id"], c["checker_id"]} == {h1, h2}, v
        ran = {c["provider_id"] for c in v["checks"]}
        assert ledger_balance(tmp_path, f"provider:{h1}") > 0
        assert ledger_balance(tmp_path, f"provider:{h2}") > 0       # paid for work or replays
        for p in ran:
            assert ledger_balance(tmp_path, f"disputed:{job_id}:{p}") == 0
        assert audit(market, tmp_path)["ok"]
        r = market.cli("offers", "--json")
        rates = {o["provider"]: o for o in json.loads(r.stdout)}
        for p in ran:
            mine = sum(c["provider_id"] == p for c in v["checks"])
            assert rates[p]["checks_passed"] == mine and rates[p]["check_rate"] == 1, rates[p]
    finally:
        market.close()


def test_a_provider_that_returns_another_models_text_is_caught_and_the_job_re_run(tmp_path):
    from tests.models import tiny_causal_lm
    from tests.test_inference import generate_job, write_prompts

    market = Marketplace(tmp_path)
    try:
        cheat, _, _ = cheat_among_honest(market, "text")
        model = tiny_causal_lm(tmp_path / "tiny")
        prompts = write_prompts(tmp_path / "prompts.jsonl", 8)
        job_id, final = run_to_end(market, generate_job(tmp_path / "job.toml", model, prompts,
                                                        max_tokens=6, batch_size=4))
        v = final["verification"]
        assert v["status"] == "disputed -> re-run", v
        assert any(c["provider_id"] == cheat and c["state"] == "failed"
                   and c["what"].startswith("a batch of 4 rows")
                   and c["what"].endswith("prefilled: fingerprints") for c in v["checks"]), v
        assert final["provider_id"] != cheat
        assert ledger_balance(tmp_path, f"provider:{cheat}") == 0
        # What the client downloads is the honest provider's text, and says how it was checked.
        r = market.cli("results", job_id, "-o", str(tmp_path / "out"), "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["content"] == "disputed -> re-run"
        got = (tmp_path / "out" / "completions.jsonl").read_text()
        assert "the quick brown fox" not in got and got.count("\n") == 8
        assert audit(market, tmp_path)["ok"]
    finally:
        market.close()


def test_a_provider_that_renders_blank_frames_is_caught_on_its_part(tmp_path):
    pytest.importorskip("bpy", reason="render jobs need Blender's bpy package")
    from tests.test_render import make_scene, render_job

    market = Marketplace(tmp_path)
    try:
        cheat, _, _ = cheat_among_honest(market, "blank")
        scene = make_scene(tmp_path / "scene.blend", 4, tmp_path / "marker")
        job_id, final = run_to_end(market, render_job(
            tmp_path / "job.toml", scene, frame_start=1, frame_end=4, resolution_x=48,
            resolution_y=32, samples=4, split=2))
        v = final["verification"]
        assert v["status"] == "disputed -> re-run", v
        caught = [c for c in v["checks"] if c["provider_id"] == cheat and c["state"] == "failed"]
        assert caught and caught[0]["what"].startswith("frame "), v
        assert "pixels differ" in caught[0]["detail"], caught
        assert all(p["provider_id"] != cheat for p in final["parts"]), final["parts"]
        assert ledger_balance(tmp_path, f"provider:{cheat}") == 0
        r = market.cli("results", job_id, "-o", str(tmp_path / "out"), "--json")
        assert r.returncode == 0, r.stderr
        assert audit(market, tmp_path)["ok"]
    finally:
        market.close()


DETERMINISTIC = """
import hashlib, json
from gpumarket.provider.runners import task
digest = hashlib.sha256()
for i in range(20000):
    digest.update(str(i * i).encode())
task.progress(1, 1)
(task.output_dir() / "result.json").write_text(json.dumps({"digest": digest.hexdigest()}))
(task.output_dir() / "notes.txt").write_text("squares hashed\\n")
"""


def start_script_market(market: Marketplace, cheat_mode: str) -> str:
    """A verifying broker, a cheating script provider (tests/cheating_provider.py's
    ``cheat_mode``, the cheapest) and two honest ones; the cheat's provider id."""
    market.start_broker(*LEASE_ARGS, verify=True)
    market.start_provider("cheat", 0.1, "--kinds", "script", cheat=cheat_mode)
    market.start_provider("h1", 1.0, "--kinds", "script")
    market.start_provider("h2", 1.5, "--kinds", "script")
    market.wait_for_offers(3)
    return market.provider_id("cheat")


def script_job(tmp_path, code: str, more: str = ""):
    """A script job running ``code``, its outputs compared exact, ``more`` TOML after it."""
    (tmp_path / "main.py").write_text(code)
    job = tmp_path / "job.toml"
    job.write_text('name = "squares"\nkind = "script"\nmax_price = 2.0\n\n[script]\n'
                   'code = "main.py"\noutputs_compare = "exact"\n' + more)
    return job


def test_a_script_provider_that_makes_up_its_output_is_caught_and_unpaid(tmp_path):
    """A script that declares its outputs exact (outputs_compare): the cheat's made-up
    result.json disagrees with an honest replay, a tie-break agrees with the replay, and the
    job is re-run by an honest provider, whose result the client gets."""
    market = Marketplace(tmp_path)
    try:
        cheat = start_script_market(market, "output")
        job = script_job(tmp_path, DETERMINISTIC)
        job_id, final = run_to_end(market, job)
        v = final["verification"]
        assert v["status"] == "disputed -> re-run", v
        caught = [c for c in v["checks"] if c["provider_id"] == cheat and c["state"] == "failed"]
        assert caught and "every output file, compared exact" in caught[0]["what"], v
        assert "result.json differs" in caught[0]["detail"], caught
        assert final["provider_id"] != cheat
        assert ledger_balance(tmp_path, f"provider:{cheat}") == 0
        r = market.cli("results", job_id, "-o", str(tmp_path / "out"), "--json")
        assert r.returncode == 0, r.stderr
        got = json.loads((tmp_path / "out" / "result.json").read_text())
        assert set(got) == {"digest"}, got
        assert audit(market, tmp_path)["ok"]
    finally:
        market.close()


INDEXED = """
import hashlib, json
from gpumarket.provider.runners import task
digest = hashlib.sha256()
for i in range(5000 * (task.index() + 1)):
    digest.update(str(i * i).encode())
(task.output_dir() / "result.json").write_text(json.dumps({"digest": digest.hexdigest()}))
"""


def test_an_array_provider_that_doctors_a_task_is_caught_its_tasks_re_run_unpaid(tmp_path):
    """A script array that declares its outputs exact, one task a lease: the cheat makes up
    the result.json of the task each of its leases runs; the check of that lease replays the
    task on another provider, disagrees, a tie-break agrees with the replay, and the task
    runs again on an honest provider, whose result the client gets; the cheat is not paid."""
    market = Marketplace(tmp_path)
    try:
        cheat = start_script_market(market, "task")
        job = script_job(tmp_path, INDEXED, '\n[array]\ngrid = { args = [["0"], ["1"], ["2"]] }\n'
                         'per_lease = 1\n')
        job_id, final = run_to_end(market, job)
        v = final["verification"]
        assert v["status"] == "disputed -> re-run", v
        caught = [c for c in v["checks"] if c["provider_id"] == cheat and c["state"] == "failed"]
        assert caught and "every output file, compared exact" in caught[0]["what"], v
        assert caught[0]["what"].startswith("task "), caught
        assert "result.json differs" in caught[0]["detail"], caught
        assert ledger_balance(tmp_path, f"provider:{cheat}") == 0
        r = market.cli("results", job_id, "-o", str(tmp_path / "out"), "--json")
        assert r.returncode == 0, r.stderr
        got = sorted((tmp_path / "out").rglob("result.json"))
        assert len(got) == 3, got
        assert all(set(json.loads(p.read_text())) == {"digest"} for p in got), got
        assert audit(market, tmp_path)["ok"]
    finally:
        market.close()
