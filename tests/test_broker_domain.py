"""The broker's plain code: job state machine on a real SQLite file, artifact store."""

from __future__ import annotations

import asyncio
import hashlib
import json
from types import SimpleNamespace

import pytest

from gpumarket.broker.jobs import endings
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs.job import LeaseTerms
from gpumarket.broker.jobs import views
from gpumarket.broker.market import providers
from gpumarket.broker.market.admission import Needs, NewJob
from gpumarket.broker.store.artifact_store import ArtifactStore
from gpumarket.proto.envelope import seal
from gpumarket.proto.errors import (
    FailedPrecondition, InvalidArgument, NotFound, Replay,
)
from gpumarket.proto.identity import Identity
from gpumarket.proto.v1 import types_pb2 as pb

ANY = pb.ACCELERATOR_UNSPECIFIED
TRAIN = pb.JOB_KIND_TRAINING


def new_job(client: Identity, job_id="j1", nonce="00" * 16, max_attempts=2):
    env = seal(client, pb.JobSpec(name="x", kind=TRAIN))
    needs = Needs(kind=TRAIN, gpus=1, min_memory_bytes=0, accelerator=ANY,
                  max_price_per_gpu_hour=1.0)
    return NewJob(id=job_id, client_id=client.id, name="x", spec=env.SerializeToString(),
                  spec_sha256="0" * 64, needs=needs, expires_at_ms=10**13,
                  max_attempts=max_attempts, nonce=nonce)


def test_lifecycle_and_epochs(store):
    broker, client = Identity.generate(), Identity.generate()

    async def scenario():
        w = store.write
        await w(jobs.submit, new_job(client), 1)
        with pytest.raises(Replay):
            await w(jobs.submit, new_job(client, job_id="j2"), 2)
        sign = lambda lease: seal(broker, lease)  # noqa: E731
        await w(jobs.create_lease, LeaseTerms("j1", "p1", (0,), 1.0, 60_000, 10), 3, sign)
        await w(jobs.mark_started, "j1", 1, "p1", 4)
        # p2 does not hold the lease
        with pytest.raises(FailedPrecondition):
            await w(jobs.record_progress, "j1", 1, "p2", pb.Progress(step=1, total=2), 5)
        await w(jobs.record_progress, "j1", 1, "p1", pb.Progress(step=1, total=2), 5)
        # the lease is lost: attempt 2 on epoch 2; epoch 1 is stale from now on
        assert await w(endings.lose_lease, "j1.1", "missed heartbeats", 6)
        with pytest.raises(FailedPrecondition, match="stale"):
            await w(jobs.record_progress, "j1", 1, "p1", pb.Progress(step=2, total=2), 7)
        await w(jobs.create_lease, LeaseTerms("j1", "p2", (0,), 1.0, 60_000, 10), 8, sign)
        assert await w(providers.renew_leases, "p1", [("j1", 1)], 9) == [("j1", 1)]
        assert await w(providers.renew_leases, "p2", [("j1", 2)], 9) == []
        # losing the second lease exceeds max_attempts=2: the job fails
        await w(endings.lose_lease, "j1.2", "provider session ended", 10)
        job = await store.read(views.get_job, "j1")
        assert job.state == pb.JOB_STATE_FAILED
        assert "gave up after 2 attempts" in job.error
        assert [(a.epoch, a.outcome) for a in job.attempts] == [(1, "lost"), (2, "lost")]
        events = await store.read(views.events_after, "j1", 0)
        assert [e.type for e in events] == ["submitted", "leased", "started", "progress",
                                            "requeued", "leased", "failed"]
        with pytest.raises(NotFound):
            await store.read(views.get_job, "nope")

    asyncio.run(scenario())


def test_cancel_is_the_owners_alone(store):
    broker, client, other = Identity.generate(), Identity.generate(), Identity.generate()

    async def scenario():
        await store.write(jobs.submit, new_job(client), 1)
        await store.write(jobs.create_lease, LeaseTerms("j1", "p1", (0,),
                          1.0, 60_000, 10), 2, lambda lease: seal(broker, lease))
        # another client's job answers as a job that does not exist
        with pytest.raises(NotFound, match="^no job 'j1'$"):
            await store.write(endings.cancel, "j1", other.id, 3)
        state, ended = await store.write(endings.cancel, "j1", client.id, 3)
        assert state == pb.JOB_STATE_CANCELLED
        assert ended == [jobs.EndedLease("j1", 1, "p1")]
        assert await store.read(views.busy_devices) == {}

    asyncio.run(scenario())


def test_a_failed_write_leaves_nothing(store):
    client = Identity.generate()

    def half_then_fail(db):
        jobs.submit(db, new_job(client), 1)
        raise RuntimeError("boom")

    async def scenario():
        with pytest.raises(RuntimeError):
            await store.write(half_then_fail)
        assert await store.read(lambda db: db.execute("SELECT count(*) FROM jobs").fetchone()[0]) == 0
        assert await store.read(lambda db: db.execute("SELECT count(*) FROM events").fetchone()[0]) == 0

    asyncio.run(scenario())


def test_artifact_upload_resumes_and_checks_the_hash(tmp_path):
    store = ArtifactStore(tmp_path, max_blob_bytes=1 << 20)
    data = b"x" * 1000
    sha = hashlib.sha256(data).hexdigest()
    me, other = "a" * 26, "b" * 26
    up = store.begin_upload(sha, len(data), 0, me)
    up.write(data[:400])
    up.close()  # connection broke
    assert store.stat(sha, me).received_bytes == 400
    assert store.stat(sha, other).received_bytes == 0      # each uploader has its own partial
    with pytest.raises(FailedPrecondition, match="offset 400"):
        store.begin_upload(sha, len(data), 0, me)
    up = store.begin_upload(sha, len(data), 400, me)
    up.write(data[400:])
    assert up.finish() == 1000
    assert store.stat(sha, me).complete
    assert store.begin_upload(sha, len(data), 0, me) is None  # deduplicated
    # someone who may not read it uploads every byte, checked like a new blob
    theirs = store.begin_upload(sha, len(data), 0, other, may_skip=False)
    theirs.write(b"y" * 1000)
    with pytest.raises(InvalidArgument, match="hash to"):
        theirs.finish()
    assert store.blob_path(sha).read_bytes() == data

    bad = hashlib.sha256(b"other").hexdigest()
    up = store.begin_upload(bad, 5, 0, me)
    up.write(b"wrong")
    with pytest.raises(InvalidArgument, match="hash to"):
        up.finish()
    assert not store.stat(bad, me).complete and store.stat(bad, me).received_bytes == 0
    with pytest.raises(InvalidArgument, match="over the broker's limit"):
        store.begin_upload(sha.replace("a", "b", 1) if "a" in sha else "c" * 64, 2 << 20, 0, me)
    with pytest.raises(InvalidArgument):
        store.blob_path("../../etc/passwd")


def test_busy_devices_view(store):
    broker, client = Identity.generate(), Identity.generate()

    async def scenario():
        await store.write(jobs.submit, new_job(client), 1)
        await store.write(jobs.create_lease, LeaseTerms("j1", "p1", (1, 3),
                          1.0, 60_000, 10), 2, lambda lease: seal(broker, lease))
        assert await store.read(views.busy_devices) == {"p1": {1, 3}}
        row = await store.read(jobs.job_row, "j1")
        assert json.loads(row["progress_metrics"]) == {}

    asyncio.run(scenario())


def test_broker_config_example_loads(tmp_path):
    from gpumarket.broker import config as broker_config
    from gpumarket.broker.config import BrokerConfig

    path = tmp_path / "broker.toml"
    path.write_text(broker_config.EXAMPLE)
    cfg = BrokerConfig(**broker_config.load(path))
    assert cfg.listen == "0.0.0.0:7070" and cfg.lease_timeout_s == 15.0
    assert cfg.max_artifact_bytes == 64 * 2**30
    path.write_text('lease_timeout = "soon"\n')
    with pytest.raises(InvalidArgument, match="lease_timeout must be a number"):
        broker_config.load(path)
    assert cfg.min_ping_interval_s == 20
    path.write_text("min_ping_interval = 0.01\n")
    with pytest.raises(InvalidArgument, match="min_ping_interval must be between 1 and 3600"):
        BrokerConfig(data_dir=tmp_path, **broker_config.load(path)).check()


def test_a_split_job_follows_its_parts(store):
    """A split job is never leased itself; it runs while a part runs, succeeds when every
    part has, and fails (its other parts stopped) when one part fails."""
    import dataclasses

    broker, client = Identity.generate(), Identity.generate()
    sign = lambda lease: seal(broker, lease)  # noqa: E731

    async def scenario():
        w = store.write
        await w(jobs.submit, dataclasses.replace(new_job(client), part_sizes=(3, 3)), 1)
        queued = [r["id"] for r in await store.read(views.queued_jobs, 10)]
        assert queued == ["j1-1", "j1-2"]                   # the parent is not leasable
        lease = await w(jobs.create_lease, LeaseTerms("j1-1", "p1", (0,), 1.0, 60_000, 10), 2, sign)
        assert pb.Lease.FromString(lease.payload).part == 1
        assert pb.Lease.FromString(lease.payload).parts == 2
        await w(jobs.mark_started, "j1-1", 1, "p1", 3)
        job = await store.read(views.get_job, "j1")
        assert job.state == pb.JOB_STATE_RUNNING
        assert [p.state for p in job.parts] == [pb.JOB_STATE_RUNNING, pb.JOB_STATE_QUEUED]
        await w(jobs.record_progress, "j1-1", 1, "p1", pb.Progress(step=2, total=3), 4)
        job = await store.read(views.get_job, "j1")
        assert (job.progress.step, job.progress.total) == (2, 6)
        assert await store.read(views.busy_siblings, "j1") == {"p1"}
        await w(jobs.create_lease, LeaseTerms("j1-2", "p2", (0,), 1.0, 60_000, 10), 5, sign)
        await w(endings.fail, "j1-2", 1, "p2", "scene: Blender cannot open it", 6)
        job = await store.read(views.get_job, "j1")    # one provider's word: tried again
        assert job.state == pb.JOB_STATE_RUNNING
        assert (job.parts[1].state, job.parts[1].attempt) == (pb.JOB_STATE_QUEUED, 2)
        await w(jobs.create_lease, LeaseTerms("j1-2", "p3", (0,), 1.0, 60_000, 10), 6, sign)
        await w(endings.fail, "j1-2", 2, "p3", "scene: Blender cannot open it", 6)
        job = await store.read(views.get_job, "j1")
        assert job.state == pb.JOB_STATE_FAILED
        assert job.error == ("part 2/2 failed: failed on 2 providers: p2: scene: Blender"
                             " cannot open it; p3: scene: Blender cannot open it")
        assert job.parts[0].state == pb.JOB_STATE_CANCELLED
        # p1 learns at its next heartbeat that part 1 is no longer its to run
        assert await w(providers.renew_leases, "p1", [("j1-1", 1)], 7) == [("j1-1", 1)]
        listed = await store.read(views.list_jobs, client.id, [], 10)
        assert [j.job_id for j in listed] == ["j1"]

        await w(jobs.submit, dataclasses.replace(new_job(client, "j2", "11" * 16),
                                                 part_sizes=(1, 1, 1)), 8)
        await w(jobs.create_lease, LeaseTerms("j2-3", "p1", (0,), 1.0, 60_000, 10), 9, sign)
        state, ended = await w(endings.cancel, "j2", client.id, 10)
        assert state == pb.JOB_STATE_CANCELLED and ended == [jobs.EndedLease("j2-3", 1, "p1")]
        job = await store.read(views.get_job, "j2")
        assert job.error == "cancelled by client"
        assert [p.state for p in job.parts] == [pb.JOB_STATE_CANCELLED] * 3

    asyncio.run(scenario())


def test_a_database_from_before_job_needs_keeps_its_jobs(tmp_path):
    """m010 moves each job's needs from a column each into one JSON value: a queued job of
    an older broker is matched afterwards exactly as before."""
    from sqlite_utils import Database

    from gpumarket.broker.market.admission import needs_of
    from gpumarket.broker.store.schema import migrations

    db = Database(tmp_path / "old.db")
    migrations.apply(db, stop_before="m010_job_needs")
    client = Identity.generate()
    spec = pb.JobSpec(name="x", kind=TRAIN, training=pb.TrainingParams(checkpoint_every=7))
    db["jobs"].insert({
        "id": "old1", "client_id": client.id, "name": "x", "kind": TRAIN, "state": 1,
        "spec": seal(client, spec).SerializeToString(), "spec_sha256": "0" * 64, "gpus": 2,
        "min_memory_bytes": 5 << 30, "accelerator": ANY, "max_price_per_gpu_hour": 1.5,
        "expires_at_ms": 10**13, "max_attempts": 3, "created_at_ms": 1, "updated_at_ms": 1,
        "objective": "fastest", "gpu_models": '["H100"]', "work_flops": 1e15,
        "engine": "", "model_name": "", "model_sha256": "", "remote_code": 0})
    migrations.apply(db)
    [row] = views.queued_jobs(db, 10)
    job = needs_of(row)
    assert (job.gpus, job.min_memory_bytes, job.max_price_per_gpu_hour, job.objective,
            job.gpu_models, job.work_flops) == (2, 5 << 30, 1.5, "fastest",
                                                frozenset({"H100"}), 1e15)
    assert Needs.from_json(row["needs"]).checkpoint_every == 7
    assert "gpus" not in db["jobs"].columns_dict


def test_heartbeats_are_noted_in_memory_and_written_before_leases_expire(store, tmp_path):
    """A heartbeat costs no write of its own: broker/state.py (Liveness) notes it, and the scheduler
    writes all that were heard in one transaction, before it looks for overdue leases (a
    lease renewed only in memory is not lost) and telling a provider to stop a lease that
    is no longer its."""
    from gpumarket.broker.config import BrokerConfig
    from gpumarket.broker.market import scheduler
    from gpumarket.broker.state import BrokerState
    from gpumarket.broker.store.artifact_store import ArtifactStore
    from gpumarket.proto.jobspec import now_ms

    broker, client = Identity.generate(), Identity.generate()
    state = BrokerState(BrokerConfig(data_dir=tmp_path, lease_timeout_s=4.0), broker, store,
                        ArtifactStore(tmp_path / "artifacts", 1 << 20))
    told: list = []

    class Session:
        def send(self, message):
            told.append((message.cancel.job_id, message.cancel.epoch))

        def log(self, *args):
            pass

    state.sessions.get = lambda provider_id: Session() if provider_id == "p2" else None

    async def scenario():
        w = store.write
        for pid in ("p1", "p2"):
            await w(providers.online, pid, b"key", 1)
        await w(jobs.submit, new_job(client), 1)
        await w(jobs.create_lease, LeaseTerms("j1", "p1", (0,),
                1.0, 60_000, 10), 2, lambda lease: seal(broker, lease))
        old = now_ms() - 60_000            # the lease's last renewal in the database
        await w(lambda db: db.execute("UPDATE leases SET renewed_at_ms = ?", [old]))
        groups = store.groups
        for _ in range(50):                     # heartbeats: noted, nothing written
            state.liveness.heard("p1", [("j1", 1)], now_ms())
            state.liveness.heard("p2", [("j1", 1)], now_ms())
        assert store.groups == groups
        await scheduler.expire(state)           # writes them first: the lease stays
        assert await store.read(lambda db: db.execute(
            "SELECT state FROM leases WHERE job_id = 'j1'").fetchall()) == [("active",)]
        assert await store.read(views.overdue_leases, now_ms() - 4_000) == []
        assert told == [("j1", 1)]              # p2 runs a lease that is not its own
        assert state.liveness.seen == {}
        seen = await store.read(lambda db: db.execute(
            "SELECT last_seen_ms FROM providers WHERE id = 'p1'").fetchone()[0])
        assert seen > old
        await scheduler.expire(state)           # no heartbeat since: nothing to tell
        assert told == [("j1", 1)]

    asyncio.run(scenario())


def test_a_lost_lease_holds_its_devices_until_its_provider_stops_it(store, tmp_path):
    """Found in CI under load: a provider late with its heartbeats lost its lease, the job
    was leased again at once to the same provider on the same device, which refused it (the
    old job was still on it), and every refusal used up an attempt: the job failed within
    a second. Now the provider is told to stop the lost lease, and its devices are not
    leased again until a heartbeat of that provider no longer lists it."""
    from gpumarket.broker.config import BrokerConfig
    from gpumarket.broker.market import scheduler
    from gpumarket.broker.state import BrokerState
    from gpumarket.proto.jobspec import now_ms

    broker, client = Identity.generate(), Identity.generate()
    state = BrokerState(BrokerConfig(data_dir=tmp_path, lease_timeout_s=4.0), broker, store,
                        ArtifactStore(tmp_path / "artifacts", 1 << 20))
    told: list = []

    class Session:
        def send(self, message):
            told.append((message.cancel.job_id, message.cancel.epoch, message.cancel.reason))

        def log(self, *args):
            pass

    state.sessions.get = lambda provider_id: Session() if provider_id == "p1" else None

    async def scenario():
        w = store.write
        await w(providers.online, "p1", b"key", 1)
        await w(jobs.submit, new_job(client, max_attempts=5), 1)
        await w(jobs.create_lease, LeaseTerms("j1", "p1", (0,),
                1.0, 60_000, 10), 2, lambda lease: seal(broker, lease))
        state.liveness.heard("p1", [("j1", 1)], now_ms() - 60_000)
        await w(lambda db: db.execute("UPDATE leases SET renewed_at_ms = ?",
                                      [now_ms() - 60_000]))
        await scheduler.expire(state)           # late: the lease is lost, p1 told to stop
        assert [t[:2] for t in told] == [("j1", 1)] and "missed heartbeats" in told[0][2]
        assert (await store.read(jobs.job_row, "j1"))["state"] == pb.JOB_STATE_QUEUED
        assert await state.busy_devices() == {"p1": {0}}
        state.liveness.heard("p1", [("j1", 1)], now_ms())     # still running it
        assert await state.busy_devices() == {"p1": {0}}
        state.liveness.heard("p1", [], now_ms())              # stopped
        assert await state.busy_devices() == {}
        # another provider cannot hold p1's devices by listing p1's lease
        state.liveness.ended("p2", "j1", 1, now_ms())
        assert await state.busy_devices() == {}

    asyncio.run(scenario())


def test_provider_histories_are_read_in_bulk_each_providers_own(store):
    """views.histories reads many providers' histories in three queries; each provider gets
    its own sessions and leases, and one never seen gets nothing."""
    from gpumarket.broker.market.reliability import ProviderHistory

    client, now = Identity.generate(), 10_000_000

    def rows(db):
        db["provider_sessions"].insert_all([
            {"provider_id": "p1", "started_ms": now - 5_000, "ended_ms": now - 3_000},
            {"provider_id": "p1", "started_ms": now - 2_000, "ended_ms": None},
            {"provider_id": "p2", "started_ms": now - 1_000, "ended_ms": now - 500}])
        for epoch, (pid, state) in enumerate([("p1", "lost"), ("p1", "succeeded"),
                                              ("p1", "succeeded"), ("p2", "lost")], 1):
            db["leases"].insert({
                "id": f"j1.{epoch}", "job_id": "j1", "attempt": epoch, "epoch": epoch,
                "provider_id": pid, "device_indices": "[0]", "price_per_gpu_hour": 1.0,
                "state": state, "issued_at_ms": 1, "renewed_at_ms": 1, "envelope": b""})

    async def scenario():
        await store.write(jobs.submit, new_job(client), 1)
        await store.write(providers.online, "p1", b"key", now - 5_000)
        await store.write(providers.online, "p2", b"key", now - 1_000)
        await store.write(rows)
        return (await store.read(views.histories, ["p1", "p2", "p3"], now),
                await store.read(views.provider_history, "p2", now))

    many, one = asyncio.run(scenario())
    assert many["p1"] == ProviderHistory(uptime_s=4.0, leases_lost=1, leases_completed=2,
                                         uptime_window_s=4.0, window_s=5.0, age_s=5.0)
    assert many["p2"] == one == ProviderHistory(uptime_s=0.5, leases_lost=1,
                                                leases_completed=0, uptime_window_s=0.5,
                                                window_s=1.0, age_s=1.0)
    assert many["p3"] == ProviderHistory(uptime_s=0.0, leases_lost=0, leases_completed=0)


def test_a_change_noted_while_its_waiter_was_reading_wakes_it_at_once():
    """The scheduler and job watchers take ``seen()`` before they read: a notify() that comes
    while they read (a lease ending during a placement pass) must not wait for the timeout."""
    from gpumarket.broker.state import Changes

    async def go() -> float:
        changes = Changes()
        seen = changes.seen()
        changes.notify()                    # written while the waiter was reading
        began = asyncio.get_running_loop().time()
        await changes.wait(30.0, since=seen)
        waited = asyncio.get_running_loop().time() - began
        # Nothing new since: a wait with the current count sleeps until the next notify.
        seen = changes.seen()
        asyncio.get_running_loop().call_later(0.05, changes.notify)
        await asyncio.wait_for(changes.wait(30.0, since=seen), 10)
        return waited

    assert asyncio.run(go()) < 1.0


def test_a_tasks_own_receipt_is_taken_only_for_its_own_uploaded_outputs(store):
    """A provider's receipt for one array task's outputs (sent as the task ended): signed by
    the lease's provider, for that lease, epoch and spec, naming only that task's outputs,
    each a blob that provider uploaded intact; anything else is refused."""
    from gpumarket.broker.jobs import arrays
    from gpumarket.broker.store import blob_holdings
    from gpumarket.kinds.arrays import output_name
    from gpumarket.proto.v1 import gateway_pb2 as gw

    provider, stranger = Identity.generate(), Identity.generate()
    batch = SimpleNamespace(id="a1-1", spec_sha256="ab" * 32)   # the Job fields it reads
    good = hashlib.sha256(b"weights").hexdigest()

    def receipt(task=3, signer=provider, job_id="a1-1", epoch=2, names=None, sha=good, size=7):
        names = names if names is not None else [output_name(task, "model.safetensors")]
        r = pb.Receipt(job_id=job_id, epoch=epoch, provider_id=provider.id,
                       spec_sha256=batch.spec_sha256,
                       outputs=[pb.ArtifactRef(name=n, sha256=sha, size_bytes=size)
                                for n in names])
        return gw.TaskResult(task=task, ok=True, receipt=seal(signer, r))

    def outputs(result: gw.TaskResult):
        taken = arrays.task_receipts([result], provider.id)[result.task]
        return asyncio.run(store.read(arrays.receipted_outputs, batch, 2, provider.id,
                                      {result.task: taken}))[result.task]

    async def scenario():
        await store.write(blob_holdings.record, good, 7, provider.id, 1)

    asyncio.run(scenario())
    with pytest.raises(Exception, match="not signed by the lease's provider"):
        arrays.task_receipts([receipt(signer=stranger)], provider.id)
    assert arrays.task_receipts([gw.TaskResult(task=1, ok=True)], provider.id) == {}
    assert outputs(receipt()) == [{"name": output_name(3, "model.safetensors"),
                                   "sha256": good, "size_bytes": 7}]
    with pytest.raises(Exception, match="another lease or spec"):
        outputs(receipt(epoch=1))
    with pytest.raises(Exception, match="another lease or spec"):
        outputs(receipt(job_id="a1-2"))
    with pytest.raises(InvalidArgument, match="not its own"):
        outputs(receipt(names=[output_name(4, "model.safetensors")]))
    with pytest.raises(FailedPrecondition, match="not uploaded intact"):
        outputs(receipt(sha=hashlib.sha256(b"never sent").hexdigest()))
    with pytest.raises(FailedPrecondition, match="not uploaded intact"):
        outputs(receipt(size=8))
    with pytest.raises(InvalidArgument, match="at most 1,000 outputs"):
        outputs(receipt(names=[output_name(3, f"f{i}") for i in range(1001)]))
