"""Attacks on the broker's boundaries, each answered with the right status and nothing done:
transport (pinning, plaintext), call tokens, authorization, revocation, limits, audit."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import os
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from gpumarket.link.client import BrokerClient
from gpumarket.link.channel import Trust
from gpumarket.proto.tls import Untrusted, broker_key_of, make_certificate
from gpumarket.proto.wire import TOKEN_METADATA, split_address
from gpumarket.proto.envelope import seal
from gpumarket.proto.errors import (
    BadSignature, FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted,
)
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import artifacts_pb2 as ap
from gpumarket.proto.v1 import artifacts_pb2_grpc, marketplace_pb2_grpc
from gpumarket.proto.v1 import marketplace_pb2 as mp
from gpumarket.proto.v1 import types_pb2 as pb
from tests.helpers import BIN, LEASE_ARGS, Marketplace, open_session, training_job

pytestmark = pytest.mark.e2e

GET_JOB = "/gpumarket.v1.Marketplace/GetJob"


def run(coro):
    return asyncio.run(coro)


def token(market: Marketplace, identity: Identity, method: str, request=None, *,
          issued: int | None = None, lifetime: int = 60_000, audience: str | None = None,
          nonce: bytes | None = None) -> bytes:
    """A call token made by hand, so that each of its fields can be wrong."""
    at = now_ms() if issued is None else issued
    body = request.SerializeToString() if request is not None else None
    t = pb.CallToken(method=method, issued_at_ms=at, expires_at_ms=at + lifetime,
                     nonce=nonce or os.urandom(16),
                     audience=market.broker_id if audience is None else audience,
                     request_sha256=hashlib.sha256(body).digest() if body is not None else b"")
    return seal(identity, t).SerializeToString()


async def call(method, request, raw_token: bytes | None):
    """(status code, details) of one raw call with ``raw_token`` as its token."""
    metadata = ((TOKEN_METADATA, raw_token),) if raw_token is not None else ()
    try:
        result = method(request, metadata=metadata, timeout=15)
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def metrics(http: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {s.labels["reason"]: s.value
            for f in text_string_to_metric_families(text) if f.name == "gpumarket_rejected_requests"
            for s in f.samples if s.name.endswith("_total")}


@pytest.fixture
def audited(tmp_path):
    """A broker with its HTTP side (for the rejection metric) and a client key."""
    m = Marketplace(tmp_path)
    m.start_broker(*LEASE_ARGS, "--http", "127.0.0.1:0")
    assert m.cli("keys", "init").returncode == 0
    m.http = json.loads((tmp_path / "broker" / "broker.json").read_text())["http"]
    yield m
    m.close()


def test_call_tokens_that_are_forged_stale_or_replayed_are_refused(audited):
    market = audited
    me = market.identity()
    req = mp.GetJobRequest(job_id="nope")

    async def scenario():
        async with await market.channel(False) as channel:      # no tokens added
            stub = marketplace_pb2_grpc.MarketplaceStub(channel)
            got = {}
            got["none"] = await call(stub.GetJob, req, None)
            good = token(market, me, GET_JOB, req)
            env = pb.Envelope.FromString(good)
            tampered = pb.Envelope()
            tampered.CopyFrom(env)
            tampered.payload = env.payload[:-1] + bytes([env.payload[-1] ^ 1])
            got["tampered"] = await call(stub.GetJob, req, tampered.SerializeToString())
            reserialized = pb.Envelope()
            reserialized.CopyFrom(env)   # same fields, encoded differently: not the signed bytes
            reserialized.payload = env.payload + b"\xf8\x01\x00"
            got["re-serialized"] = await call(stub.GetJob, req, reserialized.SerializeToString())
            got["wrong type"] = await call(stub.GetJob, req,
                                           seal(me, pb.JobSpec(name="x")).SerializeToString())
            got["garbage"] = await call(stub.GetJob, req, b"\x00not a token")
            got["expired"] = await call(stub.GetJob, req, token(
                market, me, GET_JOB, req, issued=now_ms() - 10 * 60_000))
            got["not yet valid"] = await call(stub.GetJob, req, token(
                market, me, GET_JOB, req, issued=now_ms() + 10 * 60_000))
            got["too long-lived"] = await call(stub.GetJob, req, token(
                market, me, GET_JOB, req, lifetime=3600_000))
            got["other method"] = await call(stub.GetJob, req, token(
                market, me, "/gpumarket.v1.Marketplace/CancelJob", req))
            got["other request"] = await call(stub.GetJob, req, token(
                market, me, GET_JOB, mp.GetJobRequest(job_id="other")))
            got["other broker"] = await call(stub.GetJob, req, token(
                market, me, GET_JOB, req, audience=Identity.generate().id))
            got["first use"] = await call(stub.GetJob, req, good)
            got["replayed"] = await call(stub.GetJob, req, good)
            got["anonymous offer search"] = await call(
                stub.SearchOffers, mp.SearchOffersRequest(), None)
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            return got, good

    got, used = run(scenario())
    U, F = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION
    expected = {
        "none": (U, "needs a call token"), "tampered": (U, "does not verify"),
        "re-serialized": (U, "does not verify"), "wrong type": (U, "expected a signed"),
        "garbage": (U, "does not parse"), "expired": (F, "expired"),
        "not yet valid": (F, "not valid yet"), "too long-lived": (U, "longer than 5 minutes"),
        "other method": (U, "is for /gpumarket.v1.Marketplace/CancelJob"),
        "other request": (U, "another request"), "other broker": (U, "not this one"),
        "first use": (grpc.StatusCode.NOT_FOUND, "no job"),
        "replayed": (grpc.StatusCode.ALREADY_EXISTS, "used before"),
        "anonymous offer search": (grpc.StatusCode.OK, ""),
    }
    for name, (code, text) in expected.items():
        assert got[name][0] == code and text in got[name][1], (name, got[name])

    # Audit: each refusal is logged with its reason and counted; the token is not logged.
    counted = metrics(market.http)
    for reason, n in (("unauthenticated", 1), ("bad_signature", 5), ("expired", 1),
                      ("not_yet_valid", 1), ("wrong_call", 3), ("replay", 1)):
        assert counted.get(reason) == n, (reason, counted)
    log = market.broker.text()
    assert f"refused {GET_JOB} from" in log and "(replay)" in log
    assert used.hex() not in log

    # The nonce outlives a restart of the broker: the same token is still a replay.
    market.broker.stop()
    market.start_broker(*LEASE_ARGS, "--http", "127.0.0.1:0", listen=market.address)

    async def again():
        async with await market.channel(False) as channel:
            return await call(marketplace_pb2_grpc.MarketplaceStub(channel).GetJob, req, used)

    assert run(again())[0] == grpc.StatusCode.ALREADY_EXISTS


def test_signed_payloads_cannot_be_swapped_or_borrowed(market, tmp_path):
    """A job spec whose kind is swapped, a spec or cancel order sent under another key's
    call, an admin order from a non-operator."""
    from gpumarket.client import jobfile
    from gpumarket.client.submit import build_spec

    me, other = market.identity(), Identity.generate()

    async def scenario():
        async with BrokerClient(market.address, me, trust=market.trust()) as broker:
            job = jobfile.load(training_job(tmp_path / "job.toml"))
            refs = [await broker.upload(i.path, i.name) for i in job.inputs]
            spec = build_spec(job, refs, now_ms())
            env = seal(me, spec)
            swapped = pb.Envelope()
            swapped.CopyFrom(env)
            changed = pb.JobSpec.FromString(env.payload)
            changed.kind = pb.JOB_KIND_RENDER
            swapped.payload = changed.SerializeToString()
            with pytest.raises(Exception, match="does not verify"):
                await broker.submit(swapped)
            assert await broker.list_jobs(me.id) == []
        async with BrokerClient(market.address, other, trust=market.trust()) as thief:
            with pytest.raises(PermissionDenied, match="signed by another key than the call"):
                await thief.submit(env)
            from gpumarket.proto.v1 import admin_pb2 as ad
            order = seal(other, ad.AdminOrder(method="ListAllJobs", at_ms=now_ms()))
            with pytest.raises(PermissionDenied, match="not an operator"):
                await thief.admin_call("ListAllJobs", order)
            broker_key = Identity.load(market.root / "broker" / "broker.key")
            stolen = seal(broker_key, ad.AdminOrder(method="ListAllJobs", at_ms=now_ms()))
            with pytest.raises(PermissionDenied, match="signed by another key than the call"):
                await thief.admin_call("ListAllJobs", stolen)

    run(scenario())


def test_clients_see_only_their_own_jobs_and_artifacts(market, tmp_path):
    job_file = training_job(tmp_path / "job.toml")
    r = market.cli("submit", str(job_file))
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.split()[0]
    owner = market.identity()
    stranger = Identity.generate()
    secret = tmp_path / "secret.bin"
    secret.write_bytes(os.urandom(300_000))

    async def scenario():
        async with BrokerClient(market.address, owner, trust=market.trust()) as broker:
            ref = await broker.upload(secret, "secret.bin")
            mine = await broker.get_job(job_id)
        async with await market.channel(stranger) as channel:
            stub = marketplace_pb2_grpc.MarketplaceStub(channel)
            arts = artifacts_pb2_grpc.ArtifactsStub(channel)
            got = {
                "get": await call(stub.GetJob, mp.GetJobRequest(job_id=job_id), None),
                "watch": await call(stub.WatchJob, mp.WatchJobRequest(job_id=job_id), None),
                "logs": await call(stub.StreamLogs, mp.StreamLogsRequest(job_id=job_id), None),
                "list": await call(stub.ListJobs, mp.ListJobsRequest(client_id=owner.id), None),
                "cancel": await call(stub.CancelJob, mp.CancelJobRequest(order=seal(
                    stranger, mp.CancelOrder(job_id=job_id, at_ms=now_ms()))), None),
                "download": await call(arts.Download, ap.DownloadRequest(sha256=ref.sha256),
                                       None),
            }
            stat = await arts.StatArtifact(ap.StatArtifactRequest(sha256=ref.sha256), timeout=10)
            own_list = await stub.ListJobs(mp.ListJobsRequest(), timeout=10)
        async with BrokerClient(market.address, stranger, trust=market.trust()) as thief:
            # naming the owner's blob as an input does not make it the thief's
            from gpumarket.client import jobfile
            from gpumarket.client.submit import build_spec
            job = jobfile.load(job_file)
            refs = [await thief.upload(i.path, i.name) for i in job.inputs]
            spec = build_spec(job, [*refs, ref], now_ms())
            with pytest.raises(FailedPrecondition, match="is not uploaded \\(by you\\)"):
                await thief.submit(seal(stranger, spec))
            with pytest.raises(FailedPrecondition, match="is not uploaded \\(by you\\)"):
                await thief.quote(spec)
            # ... but uploading every byte of it (proof of possession) does
            await thief.upload(secret, "secret.bin")
            back = tmp_path / "back.bin"
            await thief.download(ref, back)
        return got, stat, own_list, mine

    got, stat, own_list, mine = run(scenario())
    # Another client's job answers exactly as a job that does not exist (no existence oracle).
    for name in ("get", "watch", "logs", "cancel"):
        assert got[name] == (grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}"), (name, got[name])
    for name in ("list", "download"):
        assert got[name][0] == grpc.StatusCode.PERMISSION_DENIED, (name, got[name])
    assert "is not yours" in got["download"][1]
    assert not stat.complete and own_list.jobs == []
    assert mine.client_id == owner.id and market.job(job_id)["state"] == "QUEUED"
    assert (tmp_path / "back.bin").read_bytes() == secret.read_bytes()


def test_a_revoked_key_is_refused_everywhere(market, tmp_path):
    key = market.root / "broker" / "broker.key"
    client_id = market.identity().id

    def admin(*args):
        return subprocess.run([str(BIN / "gpumarket-broker"), *args, "--key", str(key),
                               "--broker", market.address], env=market.env,
                              capture_output=True, text=True, timeout=60)

    assert market.cli("list").returncode == 0
    r = admin("revoke", client_id, "--reason", "key leaked")
    assert r.returncode == 0 and f"revoked {client_id}" in r.stdout, r.stderr
    for args in (("list",), ("status", "x"), ("submit", str(training_job(tmp_path / "j.toml")))):
        r = market.cli(*args)
        assert r.returncode == 1 and f"key {client_id} is revoked on this broker" in r.stderr, \
            (args, r.stderr)
    # a provider session with a revoked key is refused at once
    p_key = Identity.generate()
    assert admin("revoke", p_key.id).returncode == 0

    async def session():
        from gpumarket.proto.v1 import gateway_pb2_grpc
        async with await market.channel(p_key) as channel:
            stream = gateway_pb2_grpc.ProviderGatewayStub(channel).Session()
            try:    # refused as the call starts, before the hello (a write could race it)
                await stream.read()
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details()
            return None

    assert run(session()) == (grpc.StatusCode.PERMISSION_DENIED,
                              f"key {p_key.id} is revoked on this broker")
    r = admin("revoke", Identity.load(key).id)
    assert r.returncode == 1 and "operator key" in r.stderr
    assert admin("unrevoke", client_id).returncode == 0
    assert market.cli("list").returncode == 0


def test_transport_pins_the_broker_key(market, tmp_path):
    env = {k: v for k, v in market.env.items() if k != "GPUMARKET_BROKER_KEY"}
    env["GPUMARKET_HOME"] = str(tmp_path / "tofu-home")

    def cli(*args, **extra):
        return subprocess.run([str(BIN / "gpumarket"), *args], env={**env, **extra},
                              capture_output=True, text=True, timeout=60)

    assert cli("keys", "init").returncode == 0
    r = cli("list")    # first use: trusted and remembered
    assert r.returncode == 0 and f"trusting broker {market.broker_id}" in r.stderr, r.stderr
    known = (tmp_path / "tofu-home" / "known_brokers").read_text()
    assert known == f"{market.address} {market.broker_id}\n"
    assert "trusting" not in cli("list").stderr
    wrong = Identity.generate().id
    r = cli("list", GPUMARKET_BROKER_KEY=wrong)
    assert r.returncode == 1 and f"presents key {market.broker_id}, not the pinned {wrong}" \
        in r.stderr
    # Another broker (another key) on the same address: refused, nothing sent to it.
    market.broker.stop()
    impostor = Marketplace(tmp_path / "impostor")
    (tmp_path / "impostor").mkdir()
    try:
        impostor.start_broker(listen=market.address)
        r = cli("submit", str(training_job(tmp_path / "job.toml")))
        assert r.returncode == 1 and "was trusted before" in r.stderr \
            and "refusing to connect" in r.stderr, r.stderr
        assert not list((tmp_path / "impostor" / "broker" / "artifacts" / "blobs").glob("*/*"))
    finally:
        impostor.close()


def test_certificate_attestation_must_match_the_certificate_key():
    broker = Identity.generate()
    k1, k2 = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    good = x509.load_pem_x509_certificate(make_certificate(broker, k1))
    assert broker_key_of(good) == broker.public_key
    # The attestation of k1 copied onto a certificate for k2 (an interceptor's key).
    ext = good.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    now = datetime.datetime.now(datetime.timezone.utc)
    forged = (x509.CertificateBuilder().subject_name(good.subject).issuer_name(good.subject)
              .public_key(k2.public_key()).serial_number(1)
              .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
              .add_extension(ext, critical=False).sign(k2, hashes.SHA256()))
    with pytest.raises(Untrusted, match="does not verify"):
        broker_key_of(forged)
    bare = (x509.CertificateBuilder().subject_name(good.subject).issuer_name(good.subject)
            .public_key(k2.public_key()).serial_number(2)
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(k2, hashes.SHA256()))
    with pytest.raises(Untrusted, match="no gpumarket key attestation"):
        broker_key_of(bare)


def test_plaintext_only_on_loopback_and_only_when_asked(tmp_path):
    with pytest.raises(InvalidArgument, match="only to a loopback address"):
        split_address("plaintext://10.1.2.3:7070")
    r = subprocess.run([str(BIN / "gpumarket-broker"), "serve", "--plaintext", "--listen",
                        "0.0.0.0:0", "--data-dir", str(tmp_path / "b")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "plaintext is allowed only on a loopback address" in r.stderr
    assert not (tmp_path / "b" / "broker.db").exists()


def test_limits_answer_resource_exhausted(tmp_path):
    """A plaintext loopback broker (asked for) with small limits: queued jobs per client,
    artifact bytes per key, calls a second, and gRPC's 4 MiB message cap."""
    market = Marketplace(tmp_path)
    config = tmp_path / "broker.toml"
    config.write_text("max_key_artifact_gib = 0.001\n")    # about 1 MiB
    try:
        market.start_broker(*LEASE_ARGS, "--plaintext", "--max-queued-jobs", "1",
                            "--rate-limit", "4", "--config", str(config))
        assert market.address.startswith("plaintext://127.0.0.1:")
        assert market.cli("keys", "init").returncode == 0
        r = market.cli("submit", str(training_job(tmp_path / "a.toml")))
        assert r.returncode == 0, r.stderr
        r = market.cli("submit", str(training_job(tmp_path / "b.toml", steps=31)))
        assert r.returncode == 1 and "you already have 1 queued jobs" in r.stderr, r.stderr
        big = tmp_path / "big.bin"
        big.write_bytes(os.urandom(2 << 20))

        async def scenario():
            me = market.identity()
            async with BrokerClient(market.address, me, trust=Trust()) as broker:
                with pytest.raises(ResourceExhausted, match="over this broker's limit"):
                    await broker.upload(big, "big.bin")
            # 5 MiB in one message: refused by gRPC's default limit on the broker (before
            # any handler, so the token does not matter)
            target = market.address.removeprefix("plaintext://")
            async with grpc.aio.insecure_channel(
                    target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
                stub = marketplace_pb2_grpc.MarketplaceStub(channel)
                huge = mp.SubmitJobRequest(spec=pb.Envelope(payload=b"x" * (5 << 20)))
                oversized = await call(stub.SubmitJob, huge, None)
            async with BrokerClient(market.address, None, trust=Trust()) as anonymous:
                searches = []
                for _ in range(60):      # no token: limited by the caller's host
                    try:
                        await anonymous.search_offers(mp.SearchOffersRequest())
                        searches.append("ok")
                    except ResourceExhausted as exc:
                        searches.append(str(exc))
            async with BrokerClient(market.address, me, trust=Trust()) as broker:
                codes = []
                for _ in range(60):
                    try:
                        await broker.list_jobs(me.id)
                        codes.append("ok")
                    except ResourceExhausted as exc:
                        codes.append(str(exc))
                    except Exception:
                        codes.append("other")
            return oversized, codes, searches

        oversized, codes, searches = run(scenario())
        assert searches.count("ok") >= 5 and any("from 127.0.0.1; slow down" in s
                                                 for s in searches), searches
        assert oversized[0] == grpc.StatusCode.RESOURCE_EXHAUSTED, oversized
        limited = [c for c in codes if "calls a second" in c]
        assert limited and "slow down" in limited[0], codes
        assert codes.count("ok") >= 5 and "other" not in codes, codes
        assert market.broker.alive()
    finally:
        market.close()



def test_a_provider_cannot_act_on_another_providers_lease(market, tmp_path):
    """Provider A, with a session of its own, reports on the job leased to provider B and
    asks for its inputs: refused, and B's job runs on."""
    from gpumarket.proto.v1 import gateway_pb2 as gw

    market.start_provider("p1")
    market.wait_for_offers(1)
    r = market.cli("submit", str(training_job(tmp_path / "long.toml", steps=100_000,
                                              checkpoint_every=1000)))
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.split()[0]
    market.wait_state(job_id, "RUNNING")
    epoch = 1       # its first lease
    attacker = Identity.generate()

    async def scenario():
        async with BrokerClient(market.address, market.identity(),
                                trust=market.trust()) as owner:
            spec = pb.JobSpec.FromString((await owner.get_job(job_id)).spec.payload)
        async with await market.channel(attacker) as channel:
            stream = await open_session(channel, attacker)
            await stream.write(gw.ProviderMessage(job_update=gw.JobUpdate(
                job_id=job_id, epoch=epoch, failed=gw.JobFailed(error="fake failure"))))
            settled = (await asyncio.wait_for(stream.read(), 30)).settled
            stream.cancel()
            download = await call(artifacts_pb2_grpc.ArtifactsStub(channel).Download,
                                  ap.DownloadRequest(sha256=spec.inputs[0].sha256), None)
        return settled, download

    settled, download = run(scenario())
    assert not settled.accepted and "held by this provider" in settled.reason, settled
    assert download[0] == grpc.StatusCode.PERMISSION_DENIED, download
    assert market.job(job_id)["state"] == "RUNNING"
    assert market.cli("cancel", job_id).returncode == 0


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "a/b", ".hidden", "..", "",
                                  "x\x00y", "con\\..\\x"])
def test_artifact_names_never_leave_the_work_dir(name):
    """Job inputs and receipt outputs must be plain names: refused by the spec check, by the
    broker's receipt check and by the client before it writes anything."""
    from gpumarket.client.results import verify_receipts
    from gpumarket.proto.envelope import payload_sha256
    from gpumarket.proto.jobspec import check_artifact_name

    with pytest.raises(InvalidArgument, match="not a plain file name"):
        check_artifact_name(name, "inputs[0].name")
    client, provider = Identity.generate(), Identity.generate()
    spec = seal(client, pb.JobSpec(name="j"))
    receipt = seal(provider, pb.Receipt(
        job_id="j1", provider_id=provider.id, spec_sha256=payload_sha256(spec),
        outputs=[pb.ArtifactRef(name=name, sha256="0" * 64, size_bytes=1)]))
    job = pb.Job(job_id="j1", state=pb.JOB_STATE_SUCCEEDED, spec=spec, receipt=receipt,
                 provider_id=provider.id)
    with pytest.raises(InvalidArgument, match="receipt.outputs\\[0\\].name"):
        verify_receipts(job, client.id)


def test_a_receipt_counts_only_from_the_provider_that_ran_it_for_this_spec():
    """The client takes a receipt (a job's, or an array task's own) only when it is signed
    by the provider the broker says ran it, for that job (or lease) and that exact spec."""
    from gpumarket.client.results import verify_receipts
    from gpumarket.client.tasks import task_receipt
    from gpumarket.proto.envelope import payload_sha256

    client, provider, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    training = pb.TrainingParams(checkpoint_every=7)
    spec = seal(client, pb.JobSpec(name="j", kind=pb.JOB_KIND_TRAINING, training=training))
    other_spec = seal(client, pb.JobSpec(name="k", kind=pb.JOB_KIND_TRAINING,
                                         training=training))

    def receipt(signer=provider, job_id="j1", of=spec, name="model.safetensors"):
        return seal(signer, pb.Receipt(
            job_id=job_id, provider_id=signer.id, spec_sha256=payload_sha256(of),
            outputs=[pb.ArtifactRef(name=name, sha256="0" * 64, size_bytes=1)]))

    def job(r):
        return pb.Job(job_id="j1", state=pb.JOB_STATE_SUCCEEDED, spec=spec, receipt=r,
                      provider_id=provider.id)

    assert verify_receipts(job(receipt()), client.id)[0].outputs[0].name == "model.safetensors"
    with pytest.raises(BadSignature, match="not signed by the provider that ran it"):
        verify_receipts(job(receipt(signer=stranger)), client.id)
    for forged in (receipt(job_id="j2"), receipt(of=other_spec)):
        with pytest.raises(BadSignature, match="is for another job"):
            verify_receipts(job(forged), client.id)

    def task(r, lease="a1-1"):
        return pb.ArrayTask(task=4, provider_id=provider.id, lease_job_id=lease, receipt=r)

    array = pb.Job(job_id="a1", spec=spec)
    mine = receipt(job_id="a1-1", name="task000004.out.json")
    assert task_receipt(array, task(mine)).outputs[0].name == "task000004.out.json"
    with pytest.raises(BadSignature, match="task 4: its receipt is for another job"):
        task_receipt(array, task(mine, lease="a1-2"))
    with pytest.raises(BadSignature, match="task 4: its receipt is not signed"):
        task_receipt(array, task(receipt(signer=stranger, job_id="a1-1")))
    with pytest.raises(InvalidArgument, match="task 4: receipt.outputs\\[0\\].name"):
        task_receipt(array, task(receipt(job_id="a1-1", name="../x")))


def test_the_unauthenticated_http_side_stays_on_loopback_unless_asked(tmp_path):
    r = subprocess.run([str(BIN / "gpumarket-broker"), "serve", "--http", "0.0.0.0:0",
                        "--data-dir", str(tmp_path / "b")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "has no authentication" in r.stderr, r.stderr


def test_the_shipped_keepalives_agree():
    """The client pings an idle connection every 30 s; the broker accepts one every 20 s
    by default (with gRPC's own default of 5 minutes, ours was dropped after about 90 s):
    the live test below proves the mechanism on a scaled clock, this the shipped numbers."""
    from gpumarket.broker.config import BrokerConfig
    from gpumarket.broker.server import server_options
    from gpumarket.proto import wire

    client = dict(wire.CLIENT_OPTIONS)["grpc.keepalive_time_ms"]
    floor = dict(server_options(BrokerConfig(data_dir=Path("/nonexistent"))))
    assert floor["grpc.http2.min_ping_interval_without_data_ms"] == 20_000
    assert client >= 1.5 * floor["grpc.http2.min_ping_interval_without_data_ms"], client
    assert dict(wire.CLIENT_OPTIONS)["grpc.keepalive_permit_without_calls"] == 1


def test_idle_connections_are_kept_by_matching_keepalives(market, monkeypatch, tmp_path):
    """The shipped keepalives on a clock ten times faster (the broker set to accept a ping
    every 2 s, `min_ping_interval`): two connections idle for 12 s after one call; ours
    (pinging every 3 s: four pings, more than the two strikes the broker forgives) stays
    READY the whole time; one that pings every 0.5 s is sent GOAWAY too_many_pings and
    drops to IDLE — so the broker's limit is live and a client within it is kept."""
    import gpumarket.link.channel as channel_module
    from gpumarket.proto.v1 import marketplace_pb2_grpc

    market.broker.stop()
    conf = tmp_path / "broker.toml"
    conf.write_text("min_ping_interval = 2\n")
    market.start_broker(*LEASE_ARGS, "--config", str(conf), credit=0)

    def pinging_every(ms: int) -> tuple:
        return tuple((k, ms if k == "grpc.keepalive_time_ms" else v)
                     for k, v in channel_module.CLIENT_OPTIONS)

    async def scenario():
        monkeypatch.setattr(channel_module, "CLIENT_OPTIONS", pinging_every(3000))
        ours = await market.channel()
        monkeypatch.setattr(channel_module, "CLIENT_OPTIONS", pinging_every(500))
        eager = await market.channel()
        for c in (ours, eager):
            await marketplace_pb2_grpc.MarketplaceStub(c).ListJobs(mp.ListJobsRequest(),
                                                                   timeout=10)
        states: dict[str, list[str]] = {"ours": [], "eager": []}
        for _ in range(24):
            await asyncio.sleep(0.5)
            for name, c in (("ours", ours), ("eager", eager)):
                states[name].append(c.get_state(try_to_connect=False).name)
        await ours.close()
        await eager.close()
        return states

    states = run(scenario())
    assert set(states["ours"]) == {"READY"}, states
    assert "IDLE" in states["eager"], states
