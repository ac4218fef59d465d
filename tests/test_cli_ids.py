"""Tables at 80 columns show short ids that the commands take back as unique prefixes, as
git and docker do; --json carries the whole ids."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import BIN, training_job

pytestmark = pytest.mark.e2e


def cli80(market, *args):
    env = {**market.env, "COLUMNS": "80"}
    return subprocess.run([str(BIN / "gpumarket"), *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_short_ids_fit_80_columns_and_work_as_prefixes(market, tmp_path):
    ids = []
    for n in (1, 2, 3):
        r = market.cli("submit", str(training_job(tmp_path / f"j{n}.toml", steps=10 + n)))
        assert r.returncode == 0, r.stderr
        ids.append(r.stdout.split()[0])
    r = cli80(market, "list")
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout and all(len(x) <= 80 for x in r.stdout.splitlines()), r.stdout
    for job_id in ids:
        assert job_id[:8] in r.stdout and job_id not in r.stdout
    listed = json.loads(market.cli("list", "--json").stdout)
    assert sorted(j["job_id"] for j in listed) == sorted(ids)     # whole ids in JSON
    r = market.cli("status", ids[0][:8], "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["job_id"] == ids[0], r.stderr
    # a prefix that more than one job id starts with is refused, naming them
    common = ""
    for a in ids:
        for b in ids:
            if a != b:
                n = next(i for i in range(16) if a[i] != b[i])
                common = a[:n] if len(a[:n]) > len(common) else common
    r = market.cli("status", common)       # the longest shared prefix, maybe empty
    assert r.returncode != 0 and "is ambiguous" in r.stderr, r.stderr
    r = market.cli("cancel", ids[1][:10])
    assert r.returncode == 0 and r.stdout.split()[0] == ids[1], r.stdout + r.stderr
