"""Offers, quotes and placement against a local marketplace with several providers of
different prices, hours and policies (real processes)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from gpumarket.proto.identity import Identity
from tests.helpers import training_job, wait_until

pytestmark = pytest.mark.e2e


def config(market, name: str, text: str):
    path = market.root / f"{name}.toml"
    path.write_text(text)
    return path


def test_offers_quote_and_placement_respect_price_hours_and_policy(market, tmp_path):
    me = Identity.load(market.home / "client.key").id
    # A day neither today nor tomorrow (UTC, as providers read their hours): a run that
    # crosses midnight still finds "night" outside its hours.
    later = (datetime.now(timezone.utc) + timedelta(days=2)).strftime("%a").lower()
    market.start_provider("cheap", 0.5)
    # The other three never run a job: no warm runner (its imports cost ~3 s of CPU each).
    market.start_provider("mid", 1.0, "--no-warm")
    market.start_provider("night", 0.1, "--no-warm", "--config", str(config(market, "night", f"""
[[availability]]
days = ["{later}"]
hours = "00:00-24:00"
""")))
    market.start_provider("picky", 0.2, "--no-warm", "--config", str(config(market, "picky", f"""
deny_clients = ["{me}"]
""")))
    market.wait_for_offers(4)

    r = market.cli("offers", "price<=0.6 kind=training accelerator=cpu", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["price"] for row in rows] == [0.1, 0.2, 0.5]
    assert all(0 <= row["reliability"] <= 1 and row["mtbf_h"] > 0 for row in rows)
    r = market.cli("offers", "--sort", "-price")
    assert r.returncode == 0 and r.stdout.index("1 ") < r.stdout.index("0.5")
    r = market.cli("offers", "gpu_rom>=24")
    assert r.returncode == 1
    assert r.stderr.strip() == ("error: query: unknown field 'gpu_rom' (see gpumarket offers"
                                " --fields)")
    r = market.cli("offers", "price<=cheap")
    assert r.returncode == 1 and "price takes a number" in r.stderr

    job = training_job(tmp_path / "job.toml", steps=20)
    r = market.cli("quote", str(job), "--json")
    assert r.returncode == 0, r.stderr
    q = json.loads(r.stdout)
    ids = {name: market.provider_id(name) for name in ("cheap", "mid", "night", "picky")}
    assert [c["provider_id"] for c in q["candidates"]] == [ids["cheap"], ids["mid"]]
    assert q["excluded"] == {"hours": 1, "policy": 1}
    assert int(q["estimated_memory_bytes"]) > 0 and q["work_flops"] > 0
    first = q["candidates"][0]
    assert 0 < first["p_uninterrupted"] <= 1 and first["expected_s"] >= first["runtime_s"]
    r = market.cli("quote", str(job))
    assert r.returncode == 0 and "excluded: 1 by hours, 1 by policy" in r.stdout

    r = market.cli("submit", str(job), "--watch")
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = r.stdout.split()[0]
    assert market.job(job_id)["provider_id"] == ids["cheap"]

    # The provider outside its hours and the one that refuses this client never get a lease.
    for name in ("night", "picky"):
        assert "leased" not in market.providers[name].text()


def test_queue_reason_names_the_constraints(market, tmp_path):
    market.start_provider("p1", 3.0, "--no-warm")      # the job waits: it runs nothing
    market.wait_for_offers(1)
    job = training_job(tmp_path / "job.toml", extra='min_reliability = 0.99', max_price=5.0)
    r = market.cli("submit", str(job))
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.split()[0]
    reason = wait_until(lambda: market.job(job_id).get("queue_reason"), "a queue reason")
    assert reason == "waiting: of 1 offers, 1 are less reliable than asked"
