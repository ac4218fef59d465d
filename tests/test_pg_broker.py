"""A broker on PostgreSQL, with real processes: `serve --store postgresql://…`, a real
provider and a real training job with checkpoints → SUCCEEDED, every checkpoint settled once,
the operator's audit clean; and a store it cannot reach or a form it does not know refused in
one line."""

from __future__ import annotations

import json
import subprocess
import urllib.request

import pytest

from tests.helpers import BIN, LEASE_ARGS, Marketplace, training_job

pytestmark = pytest.mark.e2e


def test_a_training_job_succeeds_on_a_broker_on_postgresql(tmp_path, pg_cluster):
    url = pg_cluster.database()     # empty: the broker applies its migrations itself
    market = Marketplace(tmp_path)
    try:
        market.start_broker(*LEASE_ARGS, "--store", url, "--http", "127.0.0.1:0")
        http = "http://" + json.loads((tmp_path / "broker" / "broker.json").read_text())["http"]
        assert not (tmp_path / "broker" / "broker.db").exists()     # nothing on SQLite
        assert urllib.request.urlopen(http + "/readyz", timeout=10).status == 200
        market.identity()
        market.start_provider("p1", 1.0)
        market.wait_for_offers(1)
        r = market.cli("submit", str(training_job(tmp_path / "job.toml", steps=20,
                                                  checkpoint_every=10)))
        assert r.returncode == 0, r.stderr
        job_id = r.stdout.split()[0]
        done = market.wait_state(job_id, "SUCCEEDED", "FAILED", timeout=300)
        assert done["state"] == "SUCCEEDED", done

        # Each checkpoint's segment settled once, chained from step 0 to the last.
        lines = [json.loads(x) for x in
                 market.cli("statement", "--job", job_id, "--json").stdout.splitlines()]
        settles = sorted((int(x.get("step_from", 0)), int(x.get("step_to", 0)))
                         for x in lines if x["type"] == "settle")
        assert settles and settles[0][0] == 0 and settles[-1][1] == 20, settles
        assert all(a[1] == b[0] for a, b in zip(settles, settles[1:])), settles
        r = subprocess.run([str(BIN / "gpumarket-broker"), "admin", "audit", "--json", "--key",
                            str(tmp_path / "broker" / "broker.key")], env=market.env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        audit = json.loads(r.stdout)
        assert audit["ok"] and int(audit["postings"]) > len(settles), audit

        # What a PostgreSQL store leaves to PostgreSQL's own tools is refused in one line.
        r = subprocess.run([str(BIN / "gpumarket-broker"), "backup", str(tmp_path / "b.db"),
                            "--key", str(tmp_path / "broker" / "broker.key")], env=market.env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "pg_dump" in r.stderr and "Traceback" not in r.stderr, \
            r.stdout + r.stderr
    finally:
        market.close()
    log = market.broker.text()
    assert "Traceback" not in log and " ERROR " not in log, log


@pytest.mark.parametrize("store, says", [
    ("mysql://x/y", "store must be postgresql://… or sqlite:///PATH, not 'mysql'"),
    ("postgresql://gpumarket:secret@/nodb?host=/nonexistent-dir",
     "error: cannot connect to the store postgresql://gpumarket:***@/nodb"),
])
def test_a_store_the_broker_cannot_use_is_one_clear_line(tmp_path, store, says):
    r = subprocess.run([str(BIN / "gpumarket-broker"), "serve", "--listen", "127.0.0.1:0",
                        "--plaintext", "--data-dir", str(tmp_path / "b"), "--store", store],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "secret" not in r.stderr, r.stderr
