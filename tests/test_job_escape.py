"""A stranger's job that runs code of its own (a model with remote code, on a provider that
allows it) attacks the provider through what the daemon does after the job: it swaps its
outputs directory for a link to the provider's data directory as it exits, hoping the daemon
(root) uploads the provider's key as the job's result. Real broker, provider and client."""

from __future__ import annotations

import hashlib
import json

import pytest

from tests.models import tiny_causal_lm
from tests.test_inference import generate_job, write_prompts

pytestmark = pytest.mark.e2e

EVIL = '''
import atexit
import os

from transformers import LlamaConfig, LlamaForCausalLM


def _swap():
    # Run as the job exits: outputs/ becomes a link to the provider's data directory.
    os.rename("outputs", "outputs.real")
    os.symlink(os.path.abspath(os.path.join("..", "..")), "outputs")
    print("evil: outputs now points at", os.readlink("outputs"), flush=True)


atexit.register(_swap)


class EvilConfig(LlamaConfig):
    pass


class EvilModel(LlamaForCausalLM):
    config_class = EvilConfig
'''


def evil_model(target):
    tiny_causal_lm(target)
    (target / "evil.py").write_text(EVIL)
    config = json.loads((target / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig",
                          "AutoModelForCausalLM": "evil.EvilModel"}
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_a_job_cannot_hand_the_providers_key_to_its_owner(market, tmp_path):
    provider_conf = tmp_path / "provider.toml"
    provider_conf.write_text("allow_remote_code = true\n")
    market.start_provider("p1", 1.0, "--config", str(provider_conf))
    offers = market.wait_for_offers(1)
    assert offers[0]["offer"]["policy"].get("allow_remote_code"), offers[0]  # isolated here
    job = generate_job(tmp_path / "job.toml", evil_model(tmp_path / "model"),
                       write_prompts(tmp_path / "prompts.jsonl", 2), max_tokens=4,
                       trust_remote_code=True)
    r = market.cli("submit", str(job), "--watch")
    job_id = r.stdout.split()[0]
    state = market.wait_state(job_id, "FAILED", "SUCCEEDED")
    logs = market.cli("logs", job_id).stdout
    assert "evil: outputs now points at" in logs, logs            # the attack ran
    assert state["state"] == "FAILED", state
    assert "outputs is a link" in state["error"], state["error"]

    key = (market.root / "p1" / "provider.key").read_bytes()
    digest = hashlib.sha256(key).hexdigest()
    blobs = list((market.root / "broker" / "artifacts" / "blobs").rglob("*"))
    assert blobs and not any(b.name == digest for b in blobs), "the key reached the broker"
    out = tmp_path / "out"
    market.cli("results", job_id, "-o", str(out))
    assert not (out / "provider.key").exists()
