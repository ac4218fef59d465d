"""One endpoint's answers checked end to end (docs/verification.md, Endpoint answers): a real
broker with a 2-second replica window and every answer sampled, a replica on one provider,
and the check of its window leased to another provider, whose serve runner prefills the
sampled answers in check mode; the verdict pays the window on. Real processes on 127.0.0.1."""

from __future__ import annotations

import pytest

from tests.helpers import LEASE_ARGS, Marketplace, wait_until
from tests.models import tiny_causal_lm
from tests.test_serving import client, endpoint_file, new_key, ready_replicas

pytestmark = pytest.mark.e2e


def test_an_endpoints_answers_are_sampled_checked_on_another_provider_and_paid(
        market: Marketplace, tmp_path):
    config = tmp_path / "broker.toml"
    config.write_text("answer_check_rate = 1.0\nreplica_window_s = 2\n")
    market.close()
    market.start_broker(*LEASE_ARGS, "--http", "127.0.0.1:0", "--config", str(config),
                        verify=True)
    import json

    info = json.loads((market.root / "broker" / "broker.json").read_text())
    base = f"http://{info['http']}/v1"
    model = tiny_causal_lm(tmp_path / "tiny")
    market.start_provider("p1", 1.0)
    market.wait_for_offers(1)
    r = market.cli("endpoint", "create", endpoint_file(
        tmp_path / "ep.toml", "tiny", model=str(model), max_seq_len=96, max_tokens=32,
        max_concurrency=4, engine="batch"))
    assert r.returncode == 0, r.stderr
    endpoint = ready_replicas(market, "tiny", 1)["job_id"]
    market.start_provider("p2", 1.5)          # the checker (not the replica's provider)
    market.wait_for_offers(2)
    key, _ = new_key(market, "tiny")
    api = client(base, key)
    for prompt in ("the quick brown fox", "a marketplace for idle gpus"):
        done = api.completions.create(model="tiny", prompt=prompt, max_tokens=20,
                                      temperature=0)
        assert done.usage.completion_tokens > 0

    def passed():
        # the endpoint's status lists the checks of its replicas' answers
        checks = market.job(endpoint).get("verification", {}).get("checks", [])
        assert not any(c["state"] in ("failed", "tie-break") for c in checks), checks
        return [c for c in checks if c["state"] == "passed"]

    (check, *_) = wait_until(passed, "a check of the replica's answers to pass", 180,
                             interval=0.5)
    assert "sampled answer" in check["what"], check
    assert check["checker_id"] == market.provider_id("p2"), check
    assert check["provider_id"] == market.provider_id("p1"), check
