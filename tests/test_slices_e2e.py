"""Slices end to end (real processes, loopback, CPU): a provider offers its CPU whole and as
two slices of a core each; `gpumarket offers` shows them; two small training jobs run at once,
one on each slice, and succeed (docs/provider.md, Slices)."""

from __future__ import annotations

import json
import os
import sqlite3

import pytest

from tests.helpers import wait_until
from tests.test_recovery import submit

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")]


def active_leases(market) -> dict[str, tuple[list[int], float]]:
    """The broker's active leases: job id -> (devices, price per device-hour)."""
    db = sqlite3.connect(f"file:{market.root / 'broker' / 'broker.db'}?mode=ro", uri=True)
    try:
        return {job: (json.loads(devices), price) for job, devices, price in db.execute(
            "SELECT job_id, device_indices, price_per_gpu_hour FROM leases"
            " WHERE state = 'active'")}
    finally:
        db.close()


def test_two_jobs_run_at_once_on_two_slices_of_the_cpu(market, tmp_path, monkeypatch):
    monkeypatch.setenv("TESTS_PROVIDER_CPUS", "all")    # a core for each slice, not one
    market.start_provider("p1", 2.0, "--cpu-only", "--slices", "2")
    market.wait_for_offers(1)
    r = market.cli("offers", "slices>=2", "--json")
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)
    assert (row["gpus"], row["slices"], row["slice_shares"], row["free_gpus"]) == (
        1, 2, [0.5, 0.5], 3)
    jobs = [submit(market, tmp_path / f"j{i}.toml", steps=400, checkpoint_every=400)
            for i in range(2)]
    both = wait_until(lambda: (leased := active_leases(market)).keys() >= set(jobs) and leased,
                      "both jobs leased at once", 240, 0.1)
    # a slice each, not the card, at half the card's price
    assert sorted(both[j] for j in jobs) == [([1], 1.0), ([2], 1.0)]
    for job in jobs:
        done = market.wait_state(job, "SUCCEEDED", timeout=300)
        assert done["provider_id"] == market.provider_id("p1")
