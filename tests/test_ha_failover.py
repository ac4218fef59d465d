"""Two brokers on one PostgreSQL store, with real processes: one provider and a client given
both addresses, a training job running; the leader is SIGKILLed mid-job. The other broker
takes over within seconds, the provider moves to it and keeps its lease (same epoch), the job
SUCCEEDS with each checkpoint settled once, a job submitted after the kill is placed by the
new leader, no job is leased twice, and the operator's audit is clean."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time

import pytest

from tests.helpers import BIN, Marketplace, Process, training_job, wait_until

pytestmark = pytest.mark.e2e

STEPS, EVERY = 1500, 100        # a few seconds of CPU: still running when the leader dies
TTL = "1.5"                     # the leader's hold on the scheduler role, seconds
# The provider's move to the survivor must not also race a 4 s lease (tests.helpers'
# LEASE_ARGS) on a loaded machine: a lease lost there would be a second lease of the job.
LEASE_ARGS = ("--lease-timeout", "10", "--heartbeat-interval", "0.5")


def leadership(url: str) -> tuple[str, int] | None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT holder, epoch FROM leadership WHERE role = 'scheduler'"
                           ).fetchone()
    return None if row is None else (row[0], row[1])


def leases(url: str) -> list[tuple[str, int, str, str]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute("SELECT job_id, epoch, provider_id, state FROM leases"
                            " ORDER BY job_id, epoch").fetchall()


def start_second_broker(market: Marketplace, url: str, *extra: str) -> tuple[Process, dict]:
    """Broker b on the same store: the market's identity (broker.key copied, as an operator
    does) and its blobs (data_dir/artifacts on a shared filesystem: here a link); ``extra``,
    its own further arguments."""
    data = market.root / "broker-b"
    data.mkdir(mode=0o700)
    shutil.copy2(market.root / "broker" / "broker.key", data / "broker.key")
    (data / "artifacts").symlink_to(market.root / "broker" / "artifacts")
    proc = Process([str(BIN / "gpumarket-broker"), "serve", "--listen", "127.0.0.1:0",
                    "--data-dir", str(data), "--no-verify", *LEASE_ARGS, "--store", url,
                    *extra], market.root / "broker-b.log", market.env)
    wait_until(lambda: (data / "broker.json").exists() or not proc.alive(), "broker b")
    assert proc.alive(), proc.text()
    return proc, json.loads((data / "broker.json").read_text())


def test_the_leader_dies_mid_job_and_the_other_broker_takes_over(tmp_path, pg_cluster):
    url = pg_cluster.database()
    market = Marketplace(tmp_path)
    b = None
    try:
        market.start_broker(*LEASE_ARGS, "--store", url, "--leader-ttl", TTL)
        a = json.loads((tmp_path / "broker" / "broker.json").read_text())
        wait_until(lambda: (leadership(url) or ("",))[0] == a["holder"], "broker a to lead")
        b, b_info = start_second_broker(market, url, "--leader-ttl", TTL)
        assert b_info["broker_id"] == a["broker_id"]            # one market, one key
        market.address = f"{a['address']},{b_info['address']}"  # client and provider: both
        market.start_provider("p1", 1.0)
        market.wait_for_offers(1)
        r = market.cli("submit", str(training_job(tmp_path / "job.toml", steps=STEPS,
                                                  checkpoint_every=EVERY)))
        assert r.returncode == 0, r.stderr
        job_id = r.stdout.split()[0]
        wait_until(lambda: int(market.job(job_id).get("checkpoint_step", 0)) >= EVERY,
                   "a first checkpoint", 180, 0.2)

        market.broker.stop(signal.SIGKILL)                      # the leader dies
        killed = time.monotonic()
        wait_until(lambda: (leadership(url) or ("",))[0] == b_info["holder"],
                   "broker b to take over", 60, 0.1)
        took = time.monotonic() - killed
        assert leadership(url)[1] == 2

        r = market.cli("submit", str(training_job(tmp_path / "after.toml", steps=20,
                                                  checkpoint_every=10)))
        assert r.returncode == 0, r.stderr
        after_id = r.stdout.split()[0]
        for job in (job_id, after_id):
            done = market.wait_state(job, "SUCCEEDED", "FAILED", timeout=300)
            assert done["state"] == "SUCCEEDED", done

        # Each job leased once: the running one kept its lease (epoch 1) through the
        # failover, the later one was placed by the new leader.
        provider = market.provider_id("p1")
        assert leases(url) == sorted([(job_id, 1, provider, "succeeded"),
                                      (after_id, 1, provider, "succeeded")]), leases(url)
        lines = [json.loads(x) for x in
                 market.cli("statement", "--job", job_id, "--json").stdout.splitlines()]
        settles = sorted((int(x.get("step_from", 0)), int(x.get("step_to", 0)))
                         for x in lines if x["type"] == "settle")
        assert settles[0][0] == 0 and settles[-1][1] == STEPS, settles
        assert all(x[1] == y[0] for x, y in zip(settles, settles[1:])), settles
        r = subprocess.run([str(BIN / "gpumarket-broker"), "admin", "audit", "--json", "--key",
                            str(tmp_path / "broker" / "broker.key")], env=market.env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(r.stdout)["ok"], r.stdout
        print(f"broker b took over {took:.1f}s after the leader was killed")
    finally:
        market.close()
        if b is not None:
            b.stop(timeout=60)
    log = b.text()
    assert "this broker leads (scheduler epoch 2)" in log, log
    assert "Traceback" not in log and " ERROR " not in log, log
