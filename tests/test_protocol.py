"""Identities, envelopes and job-spec rules (domain units)."""

from __future__ import annotations

import os
import stat

import pytest

from gpumarket.proto.envelope import open_envelope, seal
from gpumarket.proto.errors import BadSignature, Expired, InvalidArgument
from gpumarket.proto.identity import Identity, fingerprint
from gpumarket.kinds import check_spec
from gpumarket.proto.jobspec import check_fresh, now_ms
from gpumarket.proto.v1 import types_pb2 as pb


def spec(**kw) -> pb.JobSpec:
    now = now_ms()
    s = pb.JobSpec(
        name="t", kind=pb.JOB_KIND_TRAINING, resources=pb.Resources(gpus=1),
        max_price_per_gpu_hour=1.0, nonce=os.urandom(16), created_at_ms=now,
        expires_at_ms=now + 60_000,
        inputs=[pb.ArtifactRef(name="c.json", sha256="a" * 64, size_bytes=1),
                pb.ArtifactRef(name="d.jsonl", sha256="b" * 64, size_bytes=1)],
        training=pb.TrainingParams(model_config="c.json", dataset="d.jsonl", steps=10,
                                   batch_size=2, seq_len=8, learning_rate=1e-3),
    )
    for k, v in kw.items():
        if isinstance(v, pb.Resources):
            s.resources.CopyFrom(v)
        else:
            setattr(s, k, v)
    return s


def test_seal_and_open_round_trip():
    me = Identity.generate()
    env = seal(me, spec())
    got, signer = open_envelope(env, pb.JobSpec)
    assert signer == me.id == fingerprint(me.public_key)
    assert got.training.steps == 10


@pytest.mark.parametrize("field", ["payload", "signature", "signer_public_key"])
def test_any_flipped_byte_is_refused(field):
    env = seal(Identity.generate(), spec())
    data = bytearray(getattr(env, field))
    data[len(data) // 2] ^= 0x80
    setattr(env, field, bytes(data))
    with pytest.raises(BadSignature):
        open_envelope(env, pb.JobSpec)


def test_payload_type_is_inside_the_signature():
    env = seal(Identity.generate(), pb.Offer(provider_id="x"))
    with pytest.raises(BadSignature, match="expected a signed gpumarket.v1.JobSpec"):
        open_envelope(env, pb.JobSpec)
    env.payload_type = "gpumarket.v1.JobSpec"  # relabelled: the signature no longer matches
    with pytest.raises(BadSignature, match="does not verify"):
        open_envelope(env, pb.JobSpec)


def test_key_file_mode_and_reload(tmp_path):
    path = tmp_path / "home" / "client.key"
    me = Identity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load(path).id == me.id
    assert Identity.load_or_create(path).id == me.id
    path.chmod(0o644)
    with pytest.raises(InvalidArgument, match="readable by others"):
        Identity.load(path)
    with pytest.raises(FileExistsError):
        me.save(path)


def test_spec_rules_name_the_field():
    check_spec(spec())
    cases = [
        (spec(nonce=b"short"), "nonce"),
        (spec(max_price_per_gpu_hour=0), "max_price_per_gpu_hour"),
        (spec(resources=pb.Resources(gpus=0)), "resources.gpus"),
        (spec(kind=pb.JOB_KIND_UNSPECIFIED), "kind"),
    ]
    bad_name = spec()
    bad_name.inputs[0].name = "../etc/passwd"
    cases.append((bad_name, "inputs[0].name"))
    bad_ref = spec()
    bad_ref.training.dataset = "missing.jsonl"
    cases.append((bad_ref, "training.dataset"))
    zero_steps = spec()
    zero_steps.training.steps = 0
    cases.append((zero_steps, "training.steps"))
    for s, field in cases:
        with pytest.raises(InvalidArgument, match=field.replace("[", r"\[").replace("]", r"\]")):
            check_spec(s)


def test_freshness():
    s = spec()
    check_fresh(s)
    with pytest.raises(Expired, match="expired"):
        check_fresh(s, at_ms=s.expires_at_ms + 1)
    with pytest.raises(Expired, match="future"):
        check_fresh(s, at_ms=s.created_at_ms - 10 * 60 * 1000)
