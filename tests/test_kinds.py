"""A job kind is one module: a kind that only the tests define (tests/kind_checksum.py),
named in $GPUMARKET_KINDS, runs end to end — submit, match, run on a real provider in its
sandbox, results — with no line of gpumarket changed for it. And the built-in kinds' typed
parameters: defaults reach the runner, ranges are refused in the job file before anything is
uploaded, naming the file and the field."""

from __future__ import annotations

import json
import os

import pytest

from gpumarket import kinds
from gpumarket.proto.v1 import types_pb2 as pb
from tests.helpers import ROOT, LEASE_ARGS, Marketplace, training_job
from tests.kind_checksum import digest

pytestmark = pytest.mark.e2e


@pytest.fixture
def plugin_market(tmp_path):
    """Broker, providers and the client all load the test-only kind."""
    m = Marketplace(tmp_path, {"GPUMARKET_KINDS": "tests.kind_checksum",
                               "PYTHONPATH": str(ROOT)})
    m.start_broker(*LEASE_ARGS)
    assert m.cli("keys", "init").returncode == 0
    yield m
    m.close()


def test_a_kind_defined_in_one_module_runs_end_to_end(plugin_market, tmp_path):
    market = plugin_market
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(50_000))
    job = tmp_path / "sum.toml"
    job.write_text(f'kind = "checksum"\nmax_price = 2.0\n[checksum]\ndata = "{data}"\n'
                   'rounds = 3\nalgorithm = "blake2b"\n')
    market.start_provider("p1", 1.0, "--no-warm")      # checksum keeps no warm runner
    offers = market.wait_for_offers(1)
    assert "checksum" in offers[0]["kind"], offers[0]["kind"]
    r = market.cli("submit", str(job), "--watch")
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = r.stdout.split()[0]
    out = tmp_path / "out"
    r = market.cli("results", job_id, "-o", str(out))
    assert r.returncode == 0, r.stderr
    got = json.loads((out / "checksum.json").read_text())
    assert got == {"algorithm": "blake2b", "rounds": 3,
                   "digest": digest(data.read_bytes(), "blake2b", 3)}
    status = market.job(job_id)
    assert status["kind"] == "checksum" and status["state"] == "SUCCEEDED"

    # Its parameters are checked in the job file, before any upload, naming file and field.
    job.write_text(f'kind = "checksum"\nmax_price = 2.0\n[checksum]\ndata = "{data}"\n'
                   'rounds = 0\n')
    r = market.cli("submit", str(job))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (f"error: {job}: field 'checksum.rounds' must be between 1"
                                " and 1,000"), r.stderr
    assert "uploading" not in r.stderr


def test_a_training_job_without_a_seed_runs_with_the_default(market, tmp_path):
    """seed is optional (default 0): the runner gets every parameter, defaults included
    (it failed with KeyError: 'seed' when the lease's parameters left zero values out)."""
    text = training_job(tmp_path / "job.toml", steps=4, checkpoint_every=2).read_text()
    job = tmp_path / "noseed.toml"
    job.write_text(text.replace("seed = 7\n", ""))
    market.start_provider("p1")
    market.wait_for_offers(1)
    r = market.cli("submit", str(job), "--watch")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("line, message", [
    ("steps = 99999999999999999999999999", "field 'training.steps'"),      # past any integer
    ("steps = 20000000", "field 'training.steps' must be between 1 and 10,000,000"),
    ("seed = -1", "field 'training.seed' must be at least 0"),
    ("learning_rate = 0", "field 'training.learning_rate' must be in (0, 10)"),
])
def test_a_number_out_of_range_names_file_and_field_before_any_upload(market, tmp_path, line,
                                                                      message):
    text = training_job(tmp_path / "job.toml").read_text()
    key = line.split(" = ")[0]
    lines = [x for x in text.splitlines() if not x.startswith(f"{key} = ")]
    at = lines.index("[training]") + 1
    job = tmp_path / "bad.toml"
    job.write_text("\n".join(lines[:at] + [line] + lines[at:]) + "\n")
    r = market.cli("submit", str(job))
    assert r.returncode == 1, r.stdout
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert str(job) in r.stderr and message in r.stderr, r.stderr
    assert "uploading" not in r.stderr


def test_a_bad_size_names_file_and_field(market, tmp_path):
    job = training_job(tmp_path / "job.toml", extra='')
    job.write_text(job.read_text().replace("[resources]\n", '[resources]\nmemory = "lots"\n'))
    r = market.cli("submit", str(job))
    assert r.returncode == 1
    assert r.stderr.strip() == (f"error: {job}: field 'resources.memory' must be a size like"
                                ' "16GiB" or a number of bytes, got \'lots\''), r.stderr


def test_the_registry_answers_for_every_kind():
    names = {k.name for k in kinds.all_kinds()}
    assert {"training", "generate", "embed", "render"} <= names
    training = kinds.get(pb.JOB_KIND_TRAINING)
    assert training is kinds.get("training") and training.warm
    assert kinds.get("render").provider_engine == "cycles"
    with pytest.raises(Exception, match="not set to a known job kind"):
        kinds.get(9999)
    spec = pb.JobSpec(kind=pb.JOB_KIND_TRAINING)
    training.write(spec, {"model_config": "model_config.json", "dataset": "dataset.jsonl",
                          "steps": 5, "batch_size": 2, "seq_len": 8, "learning_rate": 0.1})
    values = kinds.values_of(spec)
    assert values["seed"] == 0 and values["warmup_steps"] == 0 and values["steps"] == 5
