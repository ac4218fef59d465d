"""The broker's HTTP side: health, readiness, Prometheus metrics, JSON reads (real processes)."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import LEASE_ARGS, Marketplace, training_job

pytestmark = pytest.mark.e2e


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_health_metrics_and_api_after_a_job(tmp_path):
    market = Marketplace(tmp_path)
    try:
        market.start_broker(*LEASE_ARGS, "--http", "127.0.0.1:0")
        http = "http://" + json.loads((tmp_path / "broker" / "broker.json").read_text())["http"]
        assert market.cli("keys", "init").returncode == 0
        assert get(http + "/healthz") == (200, b'{"status": "ok"}')
        status, body = get(http + "/readyz")
        assert status == 200 and json.loads(body)["status"] == "ready"

        market.start_provider("p1")
        market.wait_for_offers(1)
        r = market.cli("submit", str(training_job(tmp_path / "job.toml", steps=20)), "--watch")
        assert r.returncode == 0, r.stdout + r.stderr
        job_id = r.stdout.split()[0]
        assert market.cli("status", "no-such-job").returncode == 1  # refused: NOT_FOUND
        status, body = get(http + "/metrics")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(body.decode())}
        for name in ("gpumarket_providers_online", "gpumarket_gpus", "gpumarket_jobs",
                     "gpumarket_queue_wait_seconds", "gpumarket_time_to_first_lease_seconds",
                     "gpumarket_placements", "gpumarket_lease_expiries", "gpumarket_resumes",
                     "gpumarket_rejected_requests", "gpumarket_artifact_bytes"):
            assert name in families, name
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in families.values() for s in f.samples}
        assert samples[("gpumarket_providers_online", ())] == 1
        assert samples[("gpumarket_jobs", (("state", "SUCCEEDED"),))] == 1
        assert samples[("gpumarket_placements_total", ())] == 1
        assert samples[("gpumarket_artifact_bytes", ())] > 0
        assert any(k[0] == "gpumarket_gpus" and v == 1 for k, v in samples.items())
        assert samples[("gpumarket_rejected_requests_total", (("reason", "not_found"),))] == 1
        if shutil.which("promtool"):
            check = subprocess.run(["promtool", "check", "metrics"], input=body,
                                   capture_output=True)
            assert check.returncode == 0, check.stderr

        jobs = json.loads(get(http + "/api/jobs")[1])["jobs"]
        assert [(j["job_id"], j["state"]) for j in jobs] == [(job_id, "SUCCEEDED")]
        providers = json.loads(get(http + "/api/providers")[1])["providers"]
        assert providers[0]["provider_id"] == market.provider_id("p1")
        assert providers[0]["leases_completed"] == 1
        # Both tiers' prices (the provider's default interruptible share: 40 %).
        assert (providers[0]["price_per_gpu_hour"],
                providers[0]["interruptible_price_per_gpu_hour"]) == pytest.approx((1.0, 0.4))
        assert get(http + "/api/jobs?limit=x")[0] == 400
    finally:
        market.close()
