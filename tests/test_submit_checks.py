"""What the client and the broker refuse before a job is queued (issue 30, "Also seen"): an
endpoint whose limits its model cannot take (checked against the model's config.json by the
client where it holds it, by the broker where it reads it), and a job the client's balance
cannot hold, refused before any input is uploaded."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from gpumarket import kinds
from gpumarket.broker.market import admission
from gpumarket.broker.money import credit_holds
from gpumarket.client import jobfile
from gpumarket.proto.errors import InvalidArgument, JobFileError
from gpumarket.proto.money import units
from gpumarket.proto.v1 import types_pb2 as pb
from tests.helpers import BIN, LEASE_ARGS, training_job

CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 320, "max_position_embeddings": 256}


def endpoint_file(tmp_path: Path, **params) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(CONFIG))
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in params.items())
    path = tmp_path / "ep.toml"
    path.write_text(f'kind = "endpoint"\nname = "tiny"\nmax_price = 1.0\n\n[endpoint]\n'
                    f'model = "{model}"\n{lines}\n')
    return path


@pytest.mark.parametrize("field", ["max_seq_len", "max_tokens"])
def test_endpoint_limits_over_the_models_positions_are_refused_by_the_client(tmp_path, field):
    with pytest.raises(JobFileError) as caught:
        jobfile.load(endpoint_file(tmp_path, **{field: 512}))
    assert str(caught.value).endswith(f"field 'endpoint.{field}' 512 is over the model's"
                                      " max_position_embeddings 256 (its config.json)")
    assert jobfile.load(endpoint_file(tmp_path, **{field: 256}))     # the model's own: fine
    # The CLI says so in one line, before it connects to any broker.
    r = subprocess.run([str(BIN / "gpumarket"), "--broker", "127.0.0.1:9", "endpoint",
                        "create", str(endpoint_file(tmp_path, **{field: 512}))],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "max_position_embeddings 256" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_the_broker_checks_the_limits_against_the_config_in_the_archive(tmp_path):
    """A client that skips its own check (or sends an archive) is refused at create."""
    kind = kinds.get("endpoint")
    spec = pb.JobSpec(kind=kind.number, inputs=[pb.ArtifactRef(name="model.tar",
                                                               sha256="ab" * 32)])
    kind.write(spec, {"model": "model.tar", "max_seq_len": 512})
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = json.dumps({**CONFIG, "max_position_embeddings": 256}).encode()
        info = tarfile.TarInfo("config.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    blob = tmp_path / "blob"
    blob.write_bytes(buf.getvalue())
    with pytest.raises(InvalidArgument, match="endpoint.max_seq_len: 512 is over the model's"
                                              " max_position_embeddings 256"):
        admission.estimate(kind, kind.values_of(spec), spec, lambda sha: blob)
    kind.write(spec, {"model": "model.tar", "max_seq_len": 128})
    assert admission.estimate(kind, kind.values_of(spec), spec, lambda sha: blob).params > 0


def test_the_least_hold_is_never_more_than_the_brokers(tmp_path):
    assert (jobfile.MIN_HOLD_S, jobfile.DEFAULT_HOLD_S) == (credit_holds.MIN_HOLD_S,
                                                          credit_holds.DEFAULT_HOLD_S)
    # Only the training rule estimates work; with it unknown the hold is max_runtime or 1 h.
    assert set(admission.SIZING) == {"training", "inference"}
    ep = jobfile.load(endpoint_file(tmp_path, max_replicas=3))
    # An endpoint's work is not known ahead: its hold is an hour of every replica.
    assert jobfile.least_hold(ep)[0] == units(1.0) * 3
    path = training_job(tmp_path / "train.toml", extra="max_runtime = 60")
    path.write_text(path.read_text().replace("gpus = 1", "gpus = 2"))
    # Training's work is estimated: at least 300 s, at most its max_runtime.
    assert jobfile.least_hold(jobfile.load(path))[0] == units(2.0) * 2 * 60 // 3600
    path.write_text(path.read_text().replace("max_runtime = 60", "max_runtime = 60\nbudget = 7"))
    assert jobfile.least_hold(jobfile.load(path)) == (units(7), "its budget")


@pytest.mark.e2e
def test_an_unfunded_job_is_refused_before_its_inputs_are_uploaded(market, tmp_path):
    """Was: `gpumarket submit` uploaded every input (gigabytes, for a model) and only then
    did the broker refuse the job's hold."""
    market.home = market.root / "penniless"         # a client the operator never credited
    assert market.cli("keys", "init").returncode == 0
    job = training_job(tmp_path / "train.toml")
    r = market.cli("submit", str(job))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "insufficient funds" in r.stderr and "nothing was uploaded" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "uploading" not in r.stderr
    blobs = market.root / "broker" / "artifacts"
    assert not [p for p in blobs.rglob("*") if p.is_file()], list(blobs.rglob("*"))
    # A broker that only records usage (billing off) takes it.
    market.close()
    market.start_broker(*LEASE_ARGS, "--no-billing", credit=0)
    r = market.cli("submit", str(job))
    assert r.returncode == 0, r.stderr
