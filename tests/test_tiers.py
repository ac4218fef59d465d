"""Tiers end to end (real processes, loopback, CPU): an interruptible training job on the one
device is preempted at a checkpoint by a standard job, which runs; the training resumes from
that checkpoint and ends bitwise equal to an uninterrupted run, charged nothing for work it
lost (docs/broker.md, Preemption)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import BIN, events, training_job
from tests.test_recovery import results, settled, submit, wait_checkpoint

pytestmark = pytest.mark.e2e

# Long enough that the interruptible job is still running when the standard job, submitted
# after its first checkpoint, is placed: at 400 steps (~1 s after that checkpoint here) CI's
# loaded machine saw it end first, a CLI's start alone taking seconds there.
STEPS, EVERY = 3200, 200
INTERRUPTIBLE = 'tier = "interruptible"'


def test_an_interruptible_job_yields_to_a_standard_one_and_resumes_exactly(market, tmp_path):
    market.start_provider("p1", 1.0)            # interruptible at 40 %: 0.4
    market.wait_for_offers(1)
    r = market.cli("offers", "interruptible_price<=0.4", "--json")
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)
    assert (row["price"], row["interruptible_price"]) == (1.0, 0.4)
    # max_price 0.5: it can only run at the interruptible price (as its quote says).
    path = training_job(tmp_path / "low.toml", steps=STEPS, checkpoint_every=EVERY,
                        max_price=0.5, extra=INTERRUPTIBLE)
    r = market.cli("quote", str(path), "--json")
    assert r.returncode == 0, r.stderr
    (best, *_) = json.loads(r.stdout)["candidates"]
    assert (best["price_per_gpu_hour"], best["standard_price_per_gpu_hour"]) == (0.4, 1.0)
    low = submit(market, path, steps=STEPS, checkpoint_every=EVERY, max_price=0.5,
                 extra=INTERRUPTIBLE)
    market.wait_state(low, "RUNNING")
    wait_checkpoint(market, low, EVERY)
    high = submit(market, tmp_path / "high.toml", steps=20, checkpoint_every=10)
    done = market.wait_state(high, "SUCCEEDED", timeout=300)
    assert done["provider_id"] == market.provider_id("p1")
    job = market.wait_state(low, "SUCCEEDED", timeout=300)

    # The interruptible lease ended PREEMPTED, not lost, and no attempt was used.
    assert [a["outcome"] for a in job["attempts"]] == ["preempted", "succeeded"]
    assert int(job.get("attempt", 1)) == 1
    evs = events(market, low)
    assert any(e["type"] == "preempting" for e in evs)
    leased = [e["message"] for e in evs if e["type"] == "leased"]
    assert all("at 0.4/GPU-hour" in m for m in leased), leased
    # It checkpointed when asked (not only at its cadence) and resumed from there.
    started = [e for e in evs if e["type"] == "started"]
    resumed_at = int(started[-1]["message"].rsplit(" ", 1)[1])
    segments = settled(market.root / "broker" / "broker.db", low)     # audits the ledger
    assert [s[1] for s in segments] == [0] + [s[2] for s in segments[:-1]]
    first_lease = [s for s in segments if s[2] <= resumed_at]
    assert first_lease[-1][2] == resumed_at
    # Charged for the segments it kept and nothing else: no charge for lost work.
    assert int(job["billing"]["charged"]) == sum(s[3] for s in segments)
    r = market.cli("statement", "--job", low, "--json")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    charged = -sum(int(x["amount"]) for x in lines if x["type"] == "settle"
                   and x["account"] == "held")
    assert charged == int(job["billing"]["charged"])
    r = subprocess.run([str(BIN / "gpumarket-broker"), "admin", "audit", "--json", "--key",
                        str(market.root / "broker" / "broker.key")], env=market.env,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stdout + r.stderr

    weights, losses = results(market, low, tmp_path / "preempted")
    clean = submit(market, tmp_path / "clean.toml", steps=STEPS, checkpoint_every=EVERY,
                   max_price=0.5, extra=INTERRUPTIBLE)
    market.wait_state(clean, "SUCCEEDED", timeout=300)
    clean_weights, clean_losses = results(market, clean, tmp_path / "clean")
    assert losses == clean_losses
    assert weights == clean_weights     # bitwise: same seed, same torch, same CPU

