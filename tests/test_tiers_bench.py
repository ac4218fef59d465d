"""bench/tiers.py runs (its smoke size) and ends with its JSON line: every figure named, the
ledger clean, every job paid from its first step to its last once. The targets themselves
are the benchmark's business, not this test's (docs/broker.md, Preemption)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"interruptible_cost_ratio", "deadlines_met", "lost_intervals_per_preemption",
        "serving_wait_p99_s", "cold_start_s", "jobs", "preemptions", "promotions",
        "ledger_audit_ok"}


@pytest.mark.slow
def test_the_tiers_bench_runs_and_its_ledger_is_clean():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "tiers.py"), "--quick"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert KEYS <= out.keys()
    assert out["ledger_audit_ok"] is True, out["ledger_problems"]
    assert out["jobs"] > 0 and out["jobs_succeeded"] == out["jobs"]
    assert out["interruptible_paid_to_end"] == out["interruptible_jobs"]
    assert out["steps_paid_twice"] == 0
    assert out["preemptions"] > 0          # the smoke run's spike does preempt
