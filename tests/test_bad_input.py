"""Bad input gets a clear error, the right status, and changes nothing."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from gpumarket.client import jobfile
from gpumarket.link.client import BrokerClient
from gpumarket.client.submit import build_spec
from gpumarket.proto.envelope import seal
from gpumarket.proto.errors import BadSignature, FailedPrecondition, Replay, Unavailable
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import gateway_pb2_grpc
from gpumarket.proto.v1 import types_pb2 as pb
from tests.helpers import training_job

pytestmark = pytest.mark.e2e


async def _signed_spec(broker: BrokerClient, tmp_path, identity, created_ms=None, **kw):
    job = jobfile.load(training_job(tmp_path / "job.toml", **kw))
    refs = [await broker.upload(i.path, i.name) for i in job.inputs]
    created = now_ms() if created_ms is None else created_ms
    return job, build_spec(job, refs, created)


def run(coro):
    return asyncio.run(coro)


def test_tampered_expired_and_replayed_specs(market, tmp_path):
    identity = Identity.generate()
    market.credit(identity.id, 100)

    async def scenario():
        async with BrokerClient(market.address, identity, trust=market.trust()) as broker:
            _, spec = await _signed_spec(broker, tmp_path, identity)
            env = seal(identity, spec)
            # one byte flipped in the signed payload
            tampered = pb.Envelope()
            tampered.CopyFrom(env)
            payload = bytearray(tampered.payload)
            payload[len(payload) // 2] ^= 0x01
            tampered.payload = bytes(payload)
            with pytest.raises(BadSignature, match="does not verify"):
                await broker.submit(tampered)
            # a signature for another payload type
            wrong_type = pb.Envelope()
            wrong_type.CopyFrom(env)
            wrong_type.payload_type = "gpumarket.v1.Offer"
            with pytest.raises(BadSignature, match="expected a signed gpumarket.v1.JobSpec"):
                await broker.submit(wrong_type)
            assert await broker.list_jobs() == []

            # expired
            job, old = await _signed_spec(broker, tmp_path, identity,
                                          created_ms=now_ms() - 3_600_000)
            old.expires_at_ms = now_ms() - 60_000
            with pytest.raises(FailedPrecondition, match="expired"):
                await broker.submit(seal(identity, old))
            assert await broker.list_jobs() == []

            # replayed: the same signed envelope twice
            first = await broker.submit(env)
            with pytest.raises(Replay, match="already submitted"):
                await broker.submit(env)
            jobs = await broker.list_jobs()
            assert [j.job_id for j in jobs] == [first.job_id]

            # inputs that were never uploaded
            _, spec2 = await _signed_spec(broker, tmp_path, identity)
            spec2.inputs[0].sha256 = "0" * 64
            with pytest.raises(FailedPrecondition, match="not uploaded"):
                await broker.submit(seal(identity, spec2))

    run(scenario())


def test_job_file_errors_are_one_line(market, tmp_path):
    base = training_job(tmp_path / "job.toml").read_text()
    cases = {
        "unknown.toml": (base.replace("steps = 30", "steps = 30\nstepz = 3"),
                         "unknown field 'training.stepz'"),
        "type.toml": (base.replace("steps = 30", 'steps = "thirty"'),
                      "field 'training.steps' must be an integer, got str 'thirty'"),
        "missing.toml": (base.replace("batch_size = 4\n", ""),
                         "missing required field 'training.batch_size'"),
        "kind.toml": (base.replace('kind = "training"', 'kind = "mining"'), "field 'kind'"),
        "toml.toml": ("kind = ", "not valid TOML"),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        r = market.cli("submit", str(path))
        assert r.returncode == 1, (name, r.stdout, r.stderr)
        assert message in r.stderr, (name, r.stderr)
        assert str(path) in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "Traceback" not in r.stderr
    assert json.loads(market.cli("list", "--json").stdout) == []


def test_unreachable_broker_is_one_line(market):
    r = market.cli("--broker", "127.0.0.1:1", "list")
    assert r.returncode == 1
    assert r.stderr.startswith("error: cannot reach the broker at 127.0.0.1:1")
    assert len(r.stderr.strip().splitlines()) == 1
    r = market.cli("--broker", "127.0.0.1:1", "offers")
    assert r.returncode == 1 and "127.0.0.1:1" in r.stderr


def test_unknown_job_and_missing_key(market, tmp_path):
    r = market.cli("status", "nope")
    assert r.returncode == 1 and r.stderr.strip() == "error: no job 'nope'"
    env = dict(market.env, GPUMARKET_HOME=str(tmp_path / "nobody"))
    import subprocess

    from tests.helpers import BIN

    r = subprocess.run([str(BIN / "gpumarket"), "list"], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "run `gpumarket keys init` first" in r.stderr


async def _handshake(market, hello_key: Identity, proof_key: Identity, *,
                     wrong_nonce: bool = False) -> grpc.StatusCode | None:
    async with await market.channel(hello_key) as channel:
        call = gateway_pb2_grpc.ProviderGatewayStub(channel).Session()
        await call.write(gw.ProviderMessage(hello=gw.ProviderHello(
            public_key=hello_key.public_key)))
        challenge = await call.read()
        nonce = b"x" * 32 if wrong_nonce else challenge.challenge.nonce
        proof = gw.SessionProof(nonce=nonce, broker_public_key=challenge.challenge.broker_public_key,
                                at_ms=now_ms())
        await call.write(gw.ProviderMessage(proof=seal(proof_key, proof)))
        try:
            reply = await call.read()
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        assert reply.WhichOneof("msg") == "welcome"
        call.cancel()
        return None


def test_provider_must_prove_its_key(market):
    a, b = Identity.generate(), Identity.generate()
    assert run(_handshake(market, a, b)) == grpc.StatusCode.UNAUTHENTICATED
    assert run(_handshake(market, a, a, wrong_nonce=True)) == \
        grpc.StatusCode.UNAUTHENTICATED
    assert run(_handshake(market, a, a)) is None
    assert "session proof is signed by another key" in market.broker.text()


def test_typed_client_maps_unavailable():
    async def scenario():
        with pytest.raises(Unavailable, match="cannot reach the broker at 127.0.0.1:1"):
            async with BrokerClient("127.0.0.1:1", timeout_s=5) as broker:
                await broker.get_job("x")

    run(scenario())


def test_a_corrupted_blob_is_refused_on_download(market, tmp_path):
    from gpumarket.proto.errors import InvalidArgument
    from gpumarket.link.artifacts import ArtifactsClient

    blob = tmp_path / "blob"
    blob.write_bytes(b"a checkpoint" * 1000)

    async def scenario():
        async with BrokerClient(market.address, market.identity(),
                                trust=market.trust()) as broker:
            ref = await broker.upload(blob, "checkpoint.tar")
        stored = tmp_path / "broker" / "artifacts" / "blobs" / ref.sha256[:2] / ref.sha256
        data = bytearray(stored.read_bytes())
        data[100] ^= 0xFF
        stored.write_bytes(bytes(data))
        async with await market.channel() as channel:
            link = ArtifactsClient(channel, market.address, 10)
            target = tmp_path / "got"
            with pytest.raises(InvalidArgument, match="do not match its sha256"):
                await link.download(ref, target)
            assert not target.exists()

    run(scenario())


def test_provider_status_with_a_broken_config_says_so_in_one_line(tmp_path):
    import subprocess

    from tests.helpers import BIN

    Identity.generate().save(tmp_path / "provider.key")
    (tmp_path / "provider.toml").write_text("price_per_gpu_hour = 'cheap'\n")
    r = subprocess.run([str(BIN / "gpumarket-provider"), "status", "--data-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == (f"error: {tmp_path / 'provider.toml'}: price_per_gpu_hour"
                                " must be a number >= 0")
