"""Operating a broker: admin commands with the operator's key, online backup, job logs."""

from __future__ import annotations

import json
import sqlite3
import subprocess

import pytest

from tests.helpers import BIN, LEASE_ARGS, Marketplace, Process, training_job, wait_until

pytestmark = pytest.mark.e2e


def admin(market: Marketplace, *args: str, key=None) -> subprocess.CompletedProcess:
    key = key or market.root / "broker" / "broker.key"
    return subprocess.run([str(BIN / "gpumarket-broker"), *args, "--broker", market.address,
                           "--key", str(key)], env=market.env, capture_output=True, text=True,
                          timeout=120)


def test_admin_ban_backup_vacuum_and_logs(tmp_path):
    market = Marketplace(tmp_path)
    try:
        market.start_broker(*LEASE_ARGS)
        assert market.cli("keys", "init").returncode == 0
        market.start_provider("p1", 0.5)
        market.wait_for_offers(1)
        p1 = market.provider_id("p1")

        # A client key is not an operator key: one line, exit 1, nothing done.
        r = admin(market, "providers", key=market.home / "client.key")
        assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
        assert "is not an operator of this broker" in r.stderr
        r = admin(market, "ban", p1, key=market.home / "client.key")
        assert r.returncode == 1
        r = admin(market, "providers", "--json")
        assert r.returncode == 0, r.stderr
        (row,) = json.loads(r.stdout)
        assert row["provider_id"] == p1 and row["online"] and not row.get("banned")

        # A second, dearer provider offers before the job starts (p1, the cheaper, takes it):
        # started while the job ran, it was still starting when the job ended (load 25).
        market.start_provider("p2", 1.0)
        market.wait_for_offers(2)
        # Long enough to be still running on p1 when the ban comes: between RUNNING and the
        # ban only the `logs --follow` and `ban` processes start (the backups come after).
        job_file = training_job(tmp_path / "job.toml", steps=600, checkpoint_every=50)
        r = market.cli("submit", str(job_file))
        assert r.returncode == 0, r.stderr
        job_id = r.stdout.split()[0]
        market.wait_state(job_id, "RUNNING")

        # logs --follow gets the job's own stdout while it runs.
        follow = subprocess.Popen([str(BIN / "gpumarket"), "logs", job_id, "--follow"],
                                  env=market.env, stdout=subprocess.PIPE, text=True)
        sandbox = follow.stdout.readline()   # the job says how it is isolated, first
        assert sandbox.startswith("sandbox: "), sandbox
        first = follow.stdout.readline()
        assert first.startswith("training "), first
        second = follow.stdout.readline()
        assert second.startswith(("step ", "checkpoint ")), second
        job = market.job(job_id)
        assert job["state"] == "RUNNING" and job["provider_id"] == p1

        # Banning the first provider moves the job to the second.
        r = admin(market, "ban", p1, "--reason", "test")
        assert r.returncode == 0, r.stderr
        assert "1 running job(s) queued again" in r.stdout

        # Backup while the job moves and p2 writes its progress and checkpoints: a
        # consistent database.
        r = admin(market, "backup", str(tmp_path / "copy.db"))
        assert r.returncode == 0, r.stderr
        copy = sqlite3.connect(tmp_path / "copy.db")
        assert copy.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert copy.execute("SELECT count(*) FROM jobs WHERE id = ?", [job_id]).fetchone() == (1,)
        copy.close()
        r = admin(market, "backup", str(tmp_path / "copy.db"))
        assert r.returncode == 1 and "exists" in r.stderr

        done = market.wait_state(job_id, "SUCCEEDED", timeout=240)
        assert done["attempt"] == 2 and done["provider_id"] == market.provider_id("p2")
        follow.wait(timeout=60)
        rest = follow.stdout.read()
        assert follow.returncode == 0
        assert "--- attempt 2 ---" in rest and "done: final loss" in rest
        providers = {p["provider_id"]: p for p in json.loads(admin(
            market, "providers", "--json").stdout)}
        assert providers[p1]["banned"] and not providers[p1].get("online")
        assert providers[market.provider_id("p2")]["earned"] > 0
        jobs = json.loads(admin(market, "jobs", "--json").stdout)
        assert [j["job_id"] for j in jobs] == [job_id]
        r = market.cli("logs", job_id, "--json")
        lines = [json.loads(line) for line in r.stdout.splitlines()]
        assert {line["attempt"] for line in lines} == {1, 2}
        assert [line["seq"] for line in lines] == sorted(line["seq"] for line in lines)

        r = admin(market, "unban", p1)
        assert r.returncode == 0, r.stderr
        wait_until(lambda: any(p["provider_id"] == p1 and p.get("online") for p in json.loads(
            admin(market, "providers", "--json").stdout)), "p1 to reconnect", timeout=90,
            interval=1)
        r = admin(market, "vacuum")
        assert r.returncode == 0 and "vacuumed" in r.stdout, r.stderr
        r = admin(market, "ban", "no-such-provider")
        assert r.returncode == 1 and "no provider" in r.stderr
    finally:
        market.close()


def provider_cmd(market: Marketplace, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "gpumarket-provider"), *args], env=market.env,
                          capture_output=True, text=True, timeout=300)


def test_provider_init_then_run_from_its_config_and_status(tmp_path):
    from gpumarket.provider import config as provider_config

    market = Marketplace(tmp_path)
    try:
        market.start_broker(*LEASE_ARGS)
        data = tmp_path / "newbox"
        r = provider_cmd(market, "init", "--data-dir", str(data), "--broker", market.address,
                         "--price", "0.4", "--cpu-only")
        assert r.returncode == 0, r.stderr
        assert "self-test ok" in r.stdout and "matmul error" in r.stdout
        fingerprint = r.stdout.split("provider fingerprint: ")[1].split()[0]
        settings = provider_config.load(data / "provider.toml")
        assert settings["broker"] == market.address and settings["price_per_gpu_hour"] == 0.4
        assert "# device 0:" in (data / "provider.toml").read_text()
        r = provider_cmd(market, "init", "--data-dir", str(data))
        assert r.returncode == 1 and "exists" in r.stderr

        r = provider_cmd(market, "status", "--data-dir", str(data))
        assert r.returncode == 0, r.stderr
        assert "has not seen this provider yet" in r.stdout

        market.providers["newbox"] = provider = Process(
            [str(BIN / "gpumarket-provider"), "run", "--config", str(data / "provider.toml"),
             "--cpu-only"], tmp_path / "newbox.log", market.env)
        market.wait_for_offers(1)
        r = provider_cmd(market, "status", "--data-dir", str(data), "--json")
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout)
        assert report["provider_id"] == fingerprint and report["daemon"] == "running"
        assert report["standing"]["online"] and abs(report["clock_skew_ms"]) < 60_000
        provider.stop()

        r = provider_cmd(market, "status", "--data-dir", str(data), "--broker", "127.0.0.1:1")
        assert r.returncode == 1 and "unreachable" in r.stdout
        assert r.stderr.strip().splitlines()[-1].startswith("error: cannot reach the broker")
    finally:
        market.close()
