"""The provider's parts, each in-process with a fake peer: an attempt (one job from lease to
final update) with a fake host standing in for the daemon and the broker's artifact store,
and the broker session against a fake broker (a real gRPC server on loopback that speaks
the gateway protocol and records what it hears). The job is a real child process: the
test-only checksum kind (tests/kind_checksum.py)."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import grpc
import pytest

from gpumarket import kinds
from gpumarket.proto.envelope import open_envelope, payload_sha256, seal
from gpumarket.proto.errors import NotFound
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import gateway_pb2_grpc
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider import config as provider_config
from gpumarket.provider.attempt import Attempt
from gpumarket.provider.cache import ArtifactCache
from gpumarket.provider.inventory import cpu_devices
from gpumarket.provider.isolation import Isolation
from gpumarket.provider.leases import Assignment
from gpumarket.provider.session import BrokerSession
from tests.kind_checksum import digest

BROKER, CLIENT, PROVIDER = Identity.generate(), Identity.generate(), Identity.generate()


@pytest.fixture(scope="module", autouse=True)
def checksum_kind():
    if not any(k.name == "checksum" for k in kinds.all_kinds()):
        kinds.load_plugins("tests.kind_checksum")


def config(tmp_path: Path, **kw):
    return provider_config.build({"broker": kw.pop("broker", "plaintext://127.0.0.1:1"),
                                  "data_dir": tmp_path, "isolate": False,
                                  "warm_runners": False, **kw})


def checksum_assignment(data: bytes, rounds: int = 2) -> Assignment:
    spec = pb.JobSpec(max_price_per_gpu_hour=1.0, nonce=os.urandom(16),
                      resources=pb.Resources(gpus=1), created_at_ms=now_ms(),
                      expires_at_ms=now_ms() + 3600_000,
                      inputs=[pb.ArtifactRef(name="data.bin",
                                             sha256=hashlib.sha256(data).hexdigest(),
                                             size_bytes=len(data))])
    kinds.get("checksum").write(spec, {"data": "data.bin", "rounds": rounds})
    spec_env = seal(CLIENT, spec)
    lease = pb.Lease(lease_id="j.1", job_id="j", attempt=1, epoch=1, provider_id=PROVIDER.id,
                     client_id=CLIENT.id, device_indices=[0], job_spec=spec_env)
    return Assignment(lease, spec, CLIENT.id, payload_sha256(spec_env))


class FakeHost:
    """The daemon as an attempt sees it, with the broker's artifact store as a dict."""

    def __init__(self, tmp_path: Path, blobs: dict[str, bytes]) -> None:
        self.config = config(tmp_path)
        self.identity = PROVIDER
        self.isolation = Isolation()
        self.devices = cpu_devices(1)
        self.draining = False
        self.forks = None             # every job cold (tests/test_forkserver.py forks them)
        self.update_receipts = True   # a broker of issue 32 on (one receipt an update)
        self.blobs = blobs
        self.sent: list[gw.ProviderMessage] = []
        self.final: gw.ProviderMessage | None = None
        self.pid = 0
        self.blob_calls: list[int] = []

    def send(self, message):
        self.sent.append(message)

    async def fetch(self, ref, target):
        if ref.sha256 not in self.blobs:
            raise NotFound(f"no artifact {ref.sha256}")
        target.write_bytes(self.blobs[ref.sha256])

    async def upload(self, source, name, digest=None):
        data = os.pread(source, 1 << 30, 0) if isinstance(source, int) else source.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        self.blobs[sha] = data
        return pb.ArtifactRef(name=name, sha256=sha, size_bytes=len(data))

    async def upload_blobs(self, blobs):
        self.blob_calls.append(len(blobs))
        for sha, data in blobs:
            assert hashlib.sha256(data).hexdigest() == sha
            self.blobs[sha] = data
        return []

    async def started(self, attempt, pid):
        self.pid = pid

    async def finished(self, attempt, final):
        self.final = final


def test_an_attempt_runs_its_job_and_signs_a_receipt_for_its_outputs(tmp_path):
    data = os.urandom(10_000)
    host = FakeHost(tmp_path, {hashlib.sha256(data).hexdigest(): data})
    assignment = checksum_assignment(data, rounds=3)
    job = Attempt(assignment, tmp_path / "jobs" / "j.1", host)
    job.workdir.mkdir(parents=True)
    asyncio.run(job.run())
    kinds_sent = [m.job_update.WhichOneof("update") for m in host.sent]
    assert kinds_sent[0] == "started" and "progress" in kinds_sent, kinds_sent
    assert host.pid > 0
    assert host.final.job_update.WhichOneof("update") == "receipt", host.final
    receipt, signer = open_envelope(host.final.job_update.receipt, pb.Receipt)
    assert signer == PROVIDER.id and receipt.spec_sha256 == assignment.spec_sha256
    [out] = receipt.outputs
    assert out.name == "checksum.json"
    assert digest(data, "sha256", 3) in host.blobs[out.sha256].decode()


def test_an_attempt_whose_input_cannot_be_had_fails_with_the_reason(tmp_path):
    host = FakeHost(tmp_path, {})
    job = Attempt(checksum_assignment(b"missing"), tmp_path / "jobs" / "j.1", host)
    job.workdir.mkdir(parents=True)
    asyncio.run(job.run())
    assert host.pid == 0                     # nothing started
    assert host.final.job_update.WhichOneof("update") == "failed"
    assert "no artifact" in host.final.job_update.failed.error


def array_attempt(tmp_path: Path, tasks: int) -> tuple[FakeHost, Attempt]:
    host = FakeHost(tmp_path, {})
    assignment = checksum_assignment(b"x")
    assignment.lease.tasks.extend(range(tasks))
    return host, Attempt(assignment, tmp_path / "jobs" / "j.1", host)


def open_under(root) -> list[str]:
    """The files under ``root`` this process holds open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(root)):
            found.append(target)
    return found


def task_results(host: FakeHost) -> dict[int, gw.TaskResult]:
    return {r.task: r for m in host.sent if m.job_update.WhichOneof("update") == "tasks"
            for r in m.job_update.tasks.results}


def signed_outputs(host: FakeHost) -> dict[int, pb.Receipt]:
    """Each task's receipt as the broker takes it from the updates sent: the update's one
    signature and its hash tree checked (broker/jobs/arrays.py task_receipts), naming the
    task's outputs."""
    from gpumarket.broker.jobs import arrays as broker_arrays

    out: dict[int, pb.Receipt] = {}
    for m in host.sent:
        if m.job_update.WhichOneof("update") == "tasks":
            tasks = m.job_update.tasks
            out.update(broker_arrays.task_receipts(list(tasks.results), PROVIDER.id,
                                                   tasks.receipt))
    return out


def test_task_outputs_go_up_in_few_calls_each_content_once_before_their_tasks_are_told(
        tmp_path, monkeypatch):
    """An array lease's tasks each leave many files: the small ones of tasks that end
    together go up in few calls (not one a file), content alike once, a large one on its
    own; each task is then passed on naming its files, under its update's one receipt. A
    task that left a link fails alone. (Uploaded: none goes with the task results here.)"""
    from gpumarket.kinds import arrays
    from gpumarket.kinds.arrays import output_name

    monkeypatch.setattr(arrays, "INLINE_OUTPUT_BYTES", 0)
    from gpumarket.proto.artifacts import CHUNK_BYTES
    from gpumarket.provider.reports import TaskEnded

    host, job = array_attempt(tmp_path, 42)
    for task in range(42):
        out = job.workdir / "tasks" / f"{task:06d}" / "outputs"
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")               # alike in every task
        for i in range(30):
            (out / f"part-{i:02d}.txt").write_text(f"{task} {i}")
    big = os.urandom(CHUNK_BYTES + 1)
    (job.workdir / "tasks" / "000040" / "outputs" / "big.bin").write_bytes(big)
    (job.workdir / "tasks" / "000041" / "outputs" / "key").symlink_to("/etc/hostname")
    uploads: list[str] = []
    real_upload = host.upload

    async def upload(source, name, digest=None):
        uploads.append(name)
        return await real_upload(source, name, digest)

    host.upload = upload

    async def scenario():
        for task in range(42):
            job.task_ended(TaskEnded(task, True, "", 0.01))
        await job.task_results.settle()

    asyncio.run(scenario())
    # No output file is left open (counting every descriptor of this worker process instead
    # flaked: another test's leftovers closed or opened meanwhile).
    assert open_under(job.workdir) == []
    results = task_results(host)
    assert sorted(results) == list(range(42))
    assert not results[41].ok and "a link" in results[41].error, results[41]
    assert uploads == [output_name(40, "big.bin")]
    assert host.blob_calls == [1000, 41 * 30 + 1 - 1000]    # every small content once
    signed = signed_outputs(host)
    assert sorted(signed) == list(range(41))
    for task in range(41):
        r = results[task]
        assert r.ok, r
        receipt = signed[task]
        assert receipt.provider_id == PROVIDER.id and receipt.job_id == "j" \
            and receipt.epoch == 1
        names = {o.name: o for o in receipt.outputs}
        assert len(names) == 31 + (task == 40)
        assert host.blobs[names[output_name(task, "part-07.txt")].sha256] \
            == f"{task} 7".encode()
        assert names[output_name(task, "config.json")].sha256 == hashlib.sha256(b"{}").hexdigest()
    assert host.blobs[hashlib.sha256(big).hexdigest()] == big


@pytest.mark.parametrize("broker", ["one-receipt-an-update", "before-issue-32"])
def test_small_task_outputs_go_with_their_results_kept_until_the_broker_acknowledges(
        tmp_path, broker):
    """Small outputs travel in the task results update itself (no upload call), a larger
    one is uploaded first; each update has its number and is kept, to be sent again on the
    next session, until the broker acknowledges it. Its outputs are signed by one receipt
    for the update, or, where the broker's welcome did not say it takes that (an older
    broker, which would record the tasks without their outputs), by a receipt in each
    result naming its task's outputs alone; the broker takes either."""
    from gpumarket.kinds import arrays
    from gpumarket.provider.reports import TaskEnded

    host, job = array_attempt(tmp_path, 3)
    host.update_receipts = broker == "one-receipt-an-update"
    big = os.urandom(arrays.INLINE_OUTPUT_BYTES + 1)
    for task in range(3):
        out = job.workdir / "tasks" / f"{task:06d}" / "outputs"
        out.mkdir(parents=True)
        (out / "result.json").write_text(f'{{"task": {task}}}')
    (job.workdir / "tasks" / "000002" / "outputs" / "big.bin").write_bytes(big)
    uploaded: list[str] = []
    real = host.upload_blobs

    async def upload_blobs(blobs):
        uploaded.extend(sha for sha, _ in blobs)
        return await real(blobs)

    host.upload_blobs = upload_blobs

    async def scenario():
        for task in range(3):
            job.task_ended(TaskEnded(task, True, "", 0.01))
        await job.task_results.settle()

    asyncio.run(scenario())
    assert uploaded == [hashlib.sha256(big).hexdigest()]
    [message] = [m for m in host.sent if m.job_update.WhichOneof("update") == "tasks"]
    update = message.job_update.tasks
    assert update.seq == 1 and sorted(r.task for r in update.results) == [0, 1, 2]
    carried = {b.sha256: b.data for b in update.blobs}
    assert sorted(carried.values()) == [b'{"task": %d}' % t for t in range(3)]
    assert bool(update.receipt.payload) == host.update_receipts
    assert all(bool(r.receipt.payload) != host.update_receipts
               and bool(r.outputs) == host.update_receipts for r in update.results)
    signed = signed_outputs(host)
    assert sorted(signed) == [0, 1, 2]
    assert len(signed[2].outputs) == 2
    for receipt in signed.values():
        assert all(o.sha256 in carried or o.sha256 == hashlib.sha256(big).hexdigest()
                   for o in receipt.outputs)
    assert job.task_results.pending() == [message]
    job.task_results.settled(gw.TaskResultsSettled(job_id="j", epoch=1, seq=1, accepted=True))
    assert job.task_results.pending() == []


@pytest.mark.parametrize("never", [False, True], ids=["stored-on-the-third-try", "never"])
def test_outputs_that_cannot_be_stored_are_tried_again_then_their_tasks_fail(tmp_path,
                                                                           monkeypatch, never):
    """A task is passed on as succeeded only once its outputs are stored: uploads that fail
    are tried again, backing off; where they never go up the task is reported failed (the
    broker runs it again), never as a success without them."""
    from gpumarket.proto.errors import ResourceExhausted
    from gpumarket.provider import task_results as results_module
    from gpumarket.provider.reports import TaskEnded

    from gpumarket.kinds import arrays

    monkeypatch.setattr(results_module, "UPLOAD_BACKOFF_S", 0.01)
    monkeypatch.setattr(arrays, "INLINE_OUTPUT_BYTES", 0)    # the upload path
    failures = results_module.UPLOAD_TRIES if never else 2
    host, job = array_attempt(tmp_path, 3)
    for task in range(3):
        out = job.workdir / "tasks" / f"{task:06d}" / "outputs"
        out.mkdir(parents=True)
        (out / "result.json").write_text(f'{{"task": {task}}}')
    real, tries = host.upload_blobs, []

    async def throttled(blobs):
        tries.append(len(blobs))
        if len(tries) <= failures:
            raise ResourceExhausted("more than 50 calls a second from key k; slow down")
        return await real(blobs)

    host.upload_blobs = throttled

    async def scenario():
        for task in range(3):
            job.task_ended(TaskEnded(task, True, "", 0.01))
        job.task_ended(TaskEnded(3, True, "", 0.01))     # not a task of this lease
        await job.task_results.settle()

    asyncio.run(scenario())
    results = task_results(host)
    assert sorted(results) == [0, 1, 2]
    assert len(tries) == min(failures + 1, results_module.UPLOAD_TRIES), tries
    signed = signed_outputs(host)
    for r in results.values():
        assert r.ok == (not never), r
        assert (r.task in signed) == (not never)
        if never:
            assert "could not be stored at the broker" in r.error
            assert "slow down" in r.error


def test_the_cache_downloads_an_artifact_once_for_leases_that_want_it_at_once(tmp_path):
    """Two leases of one array on one provider start together and want the same inputs:
    one download, which a lease cancelled meanwhile does not take down with it."""
    downloads: list[str] = []

    class Store:
        async def download(self, ref, target: Path) -> None:
            downloads.append(ref.sha256)
            partial = target.with_name(f".{target.name}.partial")
            partial.write_bytes(b"part")
            await asyncio.sleep(0.2)
            partial.rename(target)          # as publish_verified does: the partial is gone

    async def via_broker(call):
        return await call(Store())

    async def scenario() -> None:
        cache = ArtifactCache(tmp_path / "cache", via_broker, lambda: None)
        ref = pb.ArtifactRef(name="in.bin", sha256="ab" * 32, size_bytes=4)
        cancelled = asyncio.ensure_future(cache.put(ref, tmp_path / "c.bin"))
        both = asyncio.gather(cache.put(ref, tmp_path / "a.bin"),
                              cache.put(ref, tmp_path / "b.bin"))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        await both
        assert cache.fetching == {}

    asyncio.run(scenario())
    assert downloads == ["ab" * 32]
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes() == b"part"
    assert not (tmp_path / "c.bin").exists()


class FakeBroker(gateway_pb2_grpc.ProviderGatewayServicer):
    """The broker's side of a session: handshake, then one lease and one cancel; records
    what the provider sends."""

    def __init__(self, lease: pb.Envelope) -> None:
        self.lease = lease
        self.heard: list[gw.ProviderMessage] = []

    async def Session(self, request_iterator, context):
        hello = await context.read()
        nonce = os.urandom(32)
        await context.write(gw.BrokerMessage(challenge=gw.SessionChallenge(
            nonce=nonce, broker_public_key=BROKER.public_key)))
        proof, signer = open_envelope((await context.read()).proof, gw.SessionProof)
        assert proof.nonce == nonce and hello.hello.public_key == PROVIDER.public_key
        await context.write(gw.BrokerMessage(welcome=gw.SessionWelcome(
            provider_id=signer, heartbeat_interval_ms=200, lease_timeout_ms=5000)))
        await context.write(gw.BrokerMessage(lease=self.lease))
        await context.write(gw.BrokerMessage(cancel=gw.CancelLease(job_id="j", epoch=1,
                                                                   reason="cancelled")))
        while (message := await context.read()) is not grpc.aio.EOF:
            self.heard.append(message)


class FakePeer:
    draining = False

    def __init__(self) -> None:
        self.leases, self.cancels = [], []

    def offer(self):
        return seal(PROVIDER, pb.Offer(provider_id=PROVIDER.id))

    def running(self):
        return [("j", 1)]

    def pending(self):
        return [gw.ProviderMessage(job_update=gw.JobUpdate(
            job_id="old", epoch=3, released=gw.JobReleased(reason="unsettled")))]

    async def on_lease(self, envelope):
        self.leases.append(envelope)

    async def on_cancel(self, cancel):
        self.cancels.append(cancel)

    async def on_settled(self, settled):
        pass


def test_a_session_hands_leases_and_cancels_over_and_keeps_the_broker_informed(tmp_path):
    # A lease for a job the peer does not run yet (one it runs is dropped as sent twice).
    lease = seal(BROKER, pb.Lease(lease_id="k.1", job_id="k", epoch=1))
    broker, peer = FakeBroker(lease), FakePeer()

    async def scenario():
        server = grpc.aio.server()
        gateway_pb2_grpc.add_ProviderGatewayServicer_to_server(broker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        session = BrokerSession(config(tmp_path, broker=f"plaintext://127.0.0.1:{port}"),
                                PROVIDER, peer)
        stopping = asyncio.Event()
        running = asyncio.create_task(session.run(stopping))
        for _ in range(200):
            if peer.cancels and sum(m.HasField("heartbeat") for m in broker.heard) >= 2:
                break
            await asyncio.sleep(0.05)
        stopping.set()
        await running
        await server.stop(0)
        return session

    session = asyncio.run(scenario())
    assert [e.payload for e in peer.leases] == [lease.payload]
    assert peer.cancels[0].job_id == "j" and peer.cancels[0].reason == "cancelled"
    assert session.broker_key == BROKER.public_key
    kinds_heard = [m.WhichOneof("msg") for m in broker.heard]
    assert kinds_heard[:2] == ["offer", "job_update"], kinds_heard   # offer, then unsettled
    beats = [m.heartbeat for m in broker.heard if m.HasField("heartbeat")]
    assert [(r.job_id, r.epoch) for r in beats[0].running] == [("j", 1)]
