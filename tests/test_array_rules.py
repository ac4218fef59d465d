"""Job arrays without processes: a job file's [array] table (grid, tasks file, every error a
line naming the file and the task), the task parameters every role reads alike, and the
broker's bookkeeping of tasks, batches, retries and the array's state on a real store."""

from __future__ import annotations

import json

import pytest
from gpumarket import kinds
from gpumarket.client import jobfile
from gpumarket.kinds import arrays
from gpumarket.broker.jobs.job import LeaseTerms
from gpumarket.proto.errors import JobFileError

SCRIPT = """
kind = "script"
max_price = 1.0

[script]
code = "main.py"

[array]
{array}
"""


def job_file(tmp_path, array: str):
    (tmp_path / "main.py").write_text("pass\n")
    path = tmp_path / "job.toml"
    path.write_text(SCRIPT.format(array=array))
    return path


def test_a_grid_makes_every_combination_last_fastest(tmp_path):
    job = jobfile.load(job_file(tmp_path, 'grid = { args = [["a"], ["b"]], steps = [1, 2, 3] }'))
    assert job.array_count == 6
    data = next(i.data for i in job.inputs if i.name == "tasks.jsonl")
    lines = [json.loads(x) for x in data.decode().splitlines()]
    assert lines[:3] == [{"args": ["a"], "steps": 1}, {"args": ["a"], "steps": 2},
                         {"args": ["a"], "steps": 3}]


@pytest.mark.parametrize("array, words", [
    ('grid = { args = [["a"]] }\ntasks = "t.jsonl"', "either 'grid' or 'tasks'"),
    ('', "either 'grid' or 'tasks'"),
    ('grid = { nope = [1] }', "task 0: script.nope: not a parameter of this kind"),
    ('grid = { steps = ["x"] }', "task 0: script.steps: must be an integer"),
    ('grid = { code = ["other.py"] }', "task 0: script.code"),
    ('grid = { steps = [1] }\nper_lease = 5000', "array.per_lease"),
    ('grid = { steps = [1] }\nbogus = 1', "unknown field 'array.bogus'"),
    ('tasks = "missing.jsonl"', "cannot read"),
    ('grid = { steps = [1] }\ninputs = ["nope.txt"]', "is not a file"),
])
def test_a_bad_array_table_is_one_line_naming_the_field(tmp_path, array, words):
    with pytest.raises(JobFileError) as exc:
        jobfile.load(job_file(tmp_path, array))
    assert words in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_a_bad_line_of_a_tasks_file_is_named(tmp_path):
    (tmp_path / "t.jsonl").write_text('{"steps": 1}\n[1, 2]\n')
    with pytest.raises(JobFileError, match="task 1: not an object of parameters"):
        jobfile.load(job_file(tmp_path, 'tasks = "t.jsonl"'))
    (tmp_path / "t.jsonl").write_text('{"steps": 1}\n{"model": "x"}\n')
    with pytest.raises(JobFileError, match="not a parameter"):
        jobfile.load(job_file(tmp_path, 'tasks = "t.jsonl"'))


def test_a_task_may_not_change_what_the_array_was_matched_on():
    kind = kinds.get("generate")
    base = {p.name: p.zero() for p in kind.params}
    base.update(model_name="m", prompts="prompts.jsonl")
    with pytest.raises(kinds.ParamError, match="the same for every task"):
        arrays.task_values(kind, base, {"model_name": "bigger"}, {"prompts.jsonl"}, 4)
    got = arrays.task_values(kind, base, {"max_tokens": 3}, {"prompts.jsonl"}, 4)
    assert got["max_tokens"] == 3 and got["model_name"] == "m"


def test_output_names_round_trip_and_refuse_lookalikes():
    assert arrays.output_task(arrays.output_name(42, "a.json")) == (42, "a.json")
    for name in ("task42.a", "taskxxxxxx.a", "task000042.", "other.json"):
        assert arrays.output_task(name) is None


def array_job(client, job_id: str, count: int, per_lease: int, only=(), max_attempts: int = 1):
    from gpumarket.broker.market.admission import Needs, NewJob
    from gpumarket.proto.envelope import seal
    from gpumarket.proto.v1 import types_pb2 as pb

    spec = pb.JobSpec(name="sweep", kind=pb.JOB_KIND_SCRIPT, array=pb.JobArray(
        count=count, tasks_input="tasks.jsonl", per_lease=per_lease, only=list(only)))
    needs = Needs(kind=pb.JOB_KIND_SCRIPT, gpus=1, min_memory_bytes=0,
                  accelerator=pb.ACCELERATOR_UNSPECIFIED, max_price_per_gpu_hour=1.0)
    return NewJob(id=job_id, client_id=client.id, name="sweep",
                  spec=seal(client, spec).SerializeToString(), spec_sha256="0" * 64,
                  needs=needs, expires_at_ms=10**13, max_attempts=max_attempts,
                  nonce=job_id.encode().hex().ljust(32, "0"))


def test_a_yielded_lease_gives_back_the_tasks_it_did_not_run_without_an_attempt(store):
    """The broker asks a running lease to yield: its tasks not reported yet are marked; one
    that still reports is recorded; when the lease ends the rest go back to the queue in a
    new lease, their attempts untouched (one attempt each here: a counted one would fail
    them). A lease lost meanwhile forgets the yield: its batch runs them all again."""
    import asyncio

    from gpumarket.broker.jobs import arrays as broker_arrays
    from gpumarket.broker.jobs import endings
    from gpumarket.broker.jobs import transitions as jobs
    from gpumarket.proto.envelope import seal
    from gpumarket.proto.identity import Identity
    from gpumarket.proto.v1 import gateway_pb2 as gw
    from gpumarket.proto.v1 import types_pb2 as pb

    broker, client, provider = Identity.generate(), Identity.generate(), Identity.generate()
    sign = lambda lease: seal(broker, lease)
    w, r = store.write, store.read

    def states(db):
        return dict(db.execute("SELECT task, state || ':' || attempts || ':' ||"
                               " coalesce(batch_id, '-') FROM array_tasks").fetchall())

    async def scenario():
        await w(broker_arrays.submit, array_job(client, "a1", 6, 6), 1)
        await w(jobs.create_lease, LeaseTerms("a1-1", "p1", (0,), 1.0, 60_000, 0), 2, sign)
        await w(jobs.mark_started, "a1-1", 1, "p1", 3)
        ok = [gw.TaskResult(task=t, ok=True) for t in (0, 1)]
        await w(broker_arrays.record_results, "a1-1", 1, "p1", ok, 4)
        assert await w(broker_arrays.yield_lease, "a1-1", 1, 5) == 4
        assert await w(broker_arrays.yield_lease, "a1-1", 1, 5) == 0      # asked already
        [lease] = await r(broker_arrays.running_leases)
        assert (lease["id"], lease["open"], lease["yielding"]) == ("a1-1", 4, True)
        await w(broker_arrays.record_results, "a1-1", 1, "p1",
                [gw.TaskResult(task=2, ok=True)], 6)    # the task it ran when asked
        receipt = seal(provider, pb.Receipt(job_id="a1-1", epoch=1, provider_id="p1"))
        await w(jobs.succeed, "a1-1", 1, "p1", receipt.SerializeToString(), 7)
        S, Q = pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_QUEUED
        assert await r(states) == {0: f"{S}:0:a1-1", 1: f"{S}:0:a1-1", 2: f"{S}:0:a1-1",
                                   3: f"{Q}:0:a1-2", 4: f"{Q}:0:a1-2", 5: f"{Q}:0:a1-2"}
        # The new lease runs them; asked to yield, then lost (its batch's one attempt):
        # the tasks it did not report go back once more, still without an attempt.
        await w(jobs.create_lease, LeaseTerms("a1-2", "p2", (0,), 1.0, 60_000, 0), 8, sign)
        await w(jobs.mark_started, "a1-2", 1, "p2", 9)
        assert await w(broker_arrays.yield_lease, "a1-2", 1, 10) == 3
        assert await w(endings.lose_lease, "a1-2.1", "missed heartbeats", 11)
        assert (await r(jobs.job_row, "a1-2"))["state"] == pb.JOB_STATE_FAILED
        assert [v for t, v in sorted((await r(states)).items()) if t >= 3] == \
            [f"{Q}:0:a1-3"] * 3
        assert (await r(jobs.job_row, "a1"))["state"] != pb.JOB_STATE_FAILED

    asyncio.run(scenario())


def test_an_array_of_some_lines_runs_those_tasks_each_by_its_own_index(store):
    """A resubmission names tasks of the tasks input (``only``): the array has those tasks,
    with their indices, in leases of them alone; a spec naming them out of order, twice or
    past the input is refused."""
    import asyncio

    from gpumarket.broker.jobs import arrays as broker_arrays
    from gpumarket.broker.jobs import transitions as jobs
    from gpumarket.proto.identity import Identity
    from gpumarket.proto.v1 import types_pb2 as pb

    client = Identity.generate()

    async def scenario():
        await store.write(broker_arrays.submit, array_job(client, "a2", 50, 0, [3, 17, 40]), 1)
        top = await store.read(jobs.job_row, "a2")
        assert (top["tasks"], top["progress_total"]) == (3, 3)
        leased = [await store.read(broker_arrays.lease_tasks, f"a2-{i}") for i in (1, 2, 3)]
        assert leased == [[3], [17], [40]]      # eight lanes by default: one task each

    asyncio.run(scenario())
    kind = kinds.get("script")
    for only, words in (([4, 3], "ascending"), ([3, 3], "ascending"), ([50], "past the 50")):
        spec = pb.JobSpec(array=pb.JobArray(count=50, tasks_input="t.jsonl", only=only),
                          inputs=[pb.ArtifactRef(name="t.jsonl")])
        with pytest.raises(kinds.ParamError, match=words):
            arrays.check_array(spec, kind)


def test_task_lists_read_as_a_user_writes_them():
    assert arrays.parse_indices("3,17,40-42", 50) == [3, 17, 40, 41, 42]
    assert arrays.parse_indices(" 5 , 1,1 ") == [1, 5]
    assert arrays.format_indices([3, 17, 40, 41, 42, 44]) == "3,17,40-42,44"
    for text, words in (("", "not a task index"), ("4-2", "a range goes up"),
                        ("1-", "not a task index"), ("50", "past the array's 50 tasks"),
                        ("-3", "not a task index")):
        with pytest.raises(ValueError, match=words):
            arrays.parse_indices(text, 50)


def test_a_failed_task_runs_again_on_another_provider_first(store, tmp_path):
    """A task that reported ``ok=false`` counts an attempt and runs again in a new lease:
    the scheduler places that lease on another provider while one fits, though the one it
    failed on is cheaper (its old provider only if nothing else fits). Its sibling that
    succeeded is not run again. The lease's progress is the tasks it reported."""
    import asyncio

    from gpumarket.broker.config import BrokerConfig
    from gpumarket.broker.jobs import arrays as broker_arrays
    from gpumarket.broker.jobs import transitions as jobs
    from gpumarket.broker.market import providers, scheduler
    from gpumarket.broker.state import BrokerState
    from gpumarket.broker.store.artifact_store import ArtifactStore
    from gpumarket.proto.envelope import open_envelope, seal
    from gpumarket.proto.identity import Identity
    from gpumarket.proto.v1 import gateway_pb2 as gw
    from gpumarket.proto.v1 import types_pb2 as pb

    from tests.helpers import signed_offer

    broker, client = Identity.generate(), Identity.generate()
    keys = {"cheap": Identity.generate(), "dear": Identity.generate()}
    state = BrokerState(BrokerConfig(data_dir=tmp_path), broker, store,
                        ArtifactStore(tmp_path / "artifacts", 1 << 20))

    def leased() -> list[tuple[str, str]]:
        """The leases sent to each provider's session since last asked."""
        out = []
        for name, key in keys.items():
            outbox = state.sessions.get(key.id).outbox
            while not outbox.empty():
                lease, _ = open_envelope(outbox.get_nowait().lease, pb.Lease)
                out.append((lease.job_id, name))
        return out

    async def scenario():
        w = store.write
        for name, key in keys.items():
            offer = signed_offer(key, kinds=(pb.JOB_KIND_SCRIPT,))
            parsed, _ = open_envelope(offer, pb.Offer)
            parsed.price_per_gpu_hour = 0.1 if name == "cheap" else 0.9
            offer = seal(key, parsed)
            await w(providers.online, key.id, key.public_key, 1)
            await w(providers.store_offer, key.id, offer.SerializeToString(), parsed, 1)
            session = state.sessions.open(key.id)
            session.offer, session.offer_envelope = parsed, offer
        cheap = keys["cheap"].id
        await w(broker_arrays.submit, array_job(client, "a3", 2, 2, max_attempts=3), 1)
        assert await scheduler.place_queued(state) == 1
        assert leased() == [("a3-1", "cheap")]
        await w(jobs.mark_started, "a3-1", 1, cheap, 3)
        await w(broker_arrays.record_results, "a3-1", 1, cheap,
                [gw.TaskResult(task=0, ok=True), gw.TaskResult(task=1, ok=False, error="boom")],
                4)
        # The lease's progress is its tasks reported (its provider sends no progress).
        assert (await store.read(jobs.job_row, "a3-1"))["progress_step"] == 2
        receipt = seal(keys["cheap"], pb.Receipt(job_id="a3-1", epoch=1, provider_id=cheap))
        await w(jobs.succeed, "a3-1", 1, cheap, receipt.SerializeToString(), 5)
        assert await store.read(broker_arrays.lease_tasks, "a3-2") == [1]
        assert await store.read(broker_arrays.failed_on, "a3-2") == {cheap}
        assert await scheduler.place_queued(state) == 1
        assert leased() == [("a3-2", "dear")]    # not back to the cheaper one it failed on

    asyncio.run(scenario())


def inline_world(store, tmp_path, quota: int = 1 << 30):
    """A broker (its gateway servicer, state, a provider's open session) with an array of
    two tasks leased to that provider and started; and a maker of that lease's task results
    updates whose outputs travel in the update."""
    import asyncio
    import dataclasses
    import hashlib

    from gpumarket.broker.api.gateway import ProviderGatewayServicer
    from gpumarket.broker.config import BrokerConfig
    from gpumarket.broker.jobs import arrays as broker_arrays
    from gpumarket.broker.jobs import transitions as jobs
    from gpumarket.broker.market import providers
    from gpumarket.broker.state import BrokerState
    from gpumarket.broker.store.artifact_store import ArtifactStore
    from gpumarket.proto.envelope import seal
    from gpumarket.proto.identity import Identity
    from gpumarket.proto.v1 import gateway_pb2 as gw
    from gpumarket.proto.v1 import types_pb2 as pb

    broker, client, provider = Identity.generate(), Identity.generate(), Identity.generate()
    config = dataclasses.replace(BrokerConfig(data_dir=tmp_path), max_key_artifact_bytes=quota)
    state = BrokerState(config, broker, store, ArtifactStore(tmp_path / "artifacts", 1 << 30))
    servicer = ProviderGatewayServicer(state)
    session = state.sessions.open(provider.id)

    async def setup():
        w = store.write
        await w(providers.online, provider.id, provider.public_key, 1)
        await w(broker_arrays.submit, array_job(client, "a5", 2, 2, max_attempts=3), 1)
        await w(jobs.create_lease, LeaseTerms("a5-1", provider.id, (0,), 1.0, 60_000, 0), 2,
                lambda lease: seal(broker, lease))
        await w(jobs.mark_started, "a5-1", 1, provider.id, 3)
        return (await store.read(jobs.job_row, "a5-1"))["spec_sha256"]

    spec_sha = asyncio.run(setup())

    def update(seq: int, outputs: dict[int, list[bytes]], blobs=None) -> gw.JobUpdate:
        """Tasks ``outputs`` names succeeded, each with those files (result-N.json), their
        bytes carried along (``blobs``: these instead)."""
        results, carried = [], {}
        for task, files in outputs.items():
            refs = []
            for n, data in enumerate(files):
                sha = hashlib.sha256(data).hexdigest()
                refs.append(pb.ArtifactRef(name=arrays.output_name(task, f"result-{n}.json"),
                                           sha256=sha, size_bytes=len(data)))
                carried[sha] = data
            receipt = seal(provider, pb.Receipt(job_id="a5-1", epoch=1, provider_id=provider.id,
                                                spec_sha256=spec_sha, outputs=refs))
            results.append(gw.TaskResult(task=task, ok=True, seconds=0.1, receipt=receipt))
        blobs = carried.items() if blobs is None else blobs
        return gw.JobUpdate(job_id="a5-1", epoch=1, tasks=gw.TaskResults(
            results=results, seq=seq,
            blobs=[gw.TaskOutputBlob(sha256=s, data=d) for s, d in blobs]))

    def answers() -> list:
        out = []
        while not session.outbox.empty():
            m = session.outbox.get_nowait()
            if m.WhichOneof("msg") == "tasks_settled":
                out.append((m.tasks_settled.seq, m.tasks_settled.accepted,
                            m.tasks_settled.reason))
        return out

    return state, servicer, session, provider, update, answers


def task_rows(db):
    return {r[0]: (r[1], json.loads(r[2]) if r[2] else None) for r in db.execute(
        "SELECT task, state, outputs FROM array_tasks ORDER BY task")}


def test_small_outputs_travel_with_their_task_results_stored_held_and_acknowledged(
        store, tmp_path):
    """A provider sends a task's small outputs inside its task results update: the broker
    stores them and marks the task SUCCEEDED with them in one go, the provider then holds
    them as if it had uploaded them (its quota counts them, once), and the update is
    acknowledged (seq) so the provider may forget it. Sent again (its acknowledgement
    lost): acknowledged again, nothing counted twice."""
    import asyncio

    from gpumarket.broker.store import blob_holdings
    from gpumarket.proto.v1 import types_pb2 as pb

    state, servicer, session, provider, update, answers = inline_world(store, tmp_path)
    files = {0: [b'{"task": 0}', b"x" * arrays.INLINE_OUTPUT_BYTES], 1: [b'{"task": 1}']}
    sent = update(7, files)

    async def scenario():
        await servicer._job_update(session, sent)
        assert answers() == [(7, True, "")]
        held = await store.read(blob_holdings.uploaded_bytes, provider.id)
        assert held == sum(len(d) for fs in files.values() for d in fs)
        await servicer._job_update(session, sent)                  # again: no harm
        assert answers() == [(7, True, "")]
        assert await store.read(blob_holdings.uploaded_bytes, provider.id) == held
        return await store.read(task_rows)

    rows = asyncio.run(scenario())
    assert {t: row[0] for t, row in rows.items()} == {0: pb.JOB_STATE_SUCCEEDED,
                                                             1: pb.JOB_STATE_SUCCEEDED}
    for task, (_, outputs) in rows.items():
        assert [state.artifacts.read_blob(o["sha256"], 1 << 20) for o in outputs] == files[task]


@pytest.mark.parametrize("attack", ["oversized", "too-much", "too-many", "unnamed",
                                    "wrong-bytes", "over-quota", "ended-lease"])
def test_a_provider_s_oversized_or_too_many_carried_outputs_are_refused(
        store, tmp_path, monkeypatch, attack):
    """What a provider carries in a task results update is bounded: an output over 64 KiB,
    over 1 MiB of them, more than the update may carry, one no receipt names, bytes that
    are not what they claim, more than the provider's quota, or outputs of a lease that is
    no longer its (files written for it would be held by no row, out of the collector's
    reach): the update is refused with the reason (its tasks run again), no task SUCCEEDED
    and nothing of it stored or held."""
    import asyncio
    import hashlib

    from gpumarket.broker.store import blob_holdings
    from gpumarket.proto.v1 import types_pb2 as pb

    monkeypatch.setattr(arrays, "INLINE_UPDATE_BLOBS", 3)
    _, servicer, session, provider, update, answers = inline_world(
        store, tmp_path, quota=100 if attack == "over-quota" else 1 << 30)
    small = [b"%d" % i for i in range(4)]
    if attack == "too-much":
        monkeypatch.setattr(arrays, "INLINE_UPDATE_BYTES", 65_000)
    big = b"y" * 40_000
    sent, why = {
        "oversized": (update(1, {0: [b"z" * (arrays.INLINE_OUTPUT_BYTES + 1)]}), "65,536"),
        "too-much": (update(1, {0: [big + b"1"], 1: [big + b"2"]}), "65,000 bytes"),
        "too-many": (update(1, {0: small}), "at most 3 outputs"),
        "unnamed": (update(1, {0: [b"a"]}, blobs=[(hashlib.sha256(b"b").hexdigest(), b"b")]),
                    "no receipt"),
        "wrong-bytes": (update(1, {0: [b"a"]}, blobs=[(hashlib.sha256(b"a").hexdigest(),
                                                       b"b")]), "hash"),
        "over-quota": (update(1, {0: [b"q" * 101]}), "limit"),
        "ended-lease": (update(1, {0: [b"a"]}), "stale"),
    }[attack]

    async def scenario():
        if attack == "ended-lease":
            from gpumarket.broker.jobs import endings
            await store.write(endings.release, "a5-1", 1, provider.id, "gone", 4, "rejected")
        await servicer._job_update(session, sent)
        return answers(), await store.read(blob_holdings.uploaded_bytes, provider.id), \
            await store.read(task_rows)

    [(seq, accepted, reason)], held, rows = asyncio.run(scenario())
    assert (seq, accepted) == (1, False) and why in reason, reason
    assert held == 0
    assert all(s != pb.JOB_STATE_SUCCEEDED and outputs is None for s, outputs in rows.values())
    assert list((tmp_path / "artifacts" / "blobs").rglob("*")) == []


def test_a_heartbeat_heard_before_a_lease_ended_does_not_cancel_it_again(store):
    """A provider's heartbeat lists a lease; its final update ends the lease before the
    broker writes that heartbeat (the next pass, woken by the end itself): the lease is not
    "no longer its" (no cancel after every array lease). One heard after the end is."""
    import asyncio

    from gpumarket.broker.jobs import arrays as broker_arrays
    from gpumarket.broker.jobs import transitions as jobs
    from gpumarket.broker.market import providers
    from gpumarket.proto.envelope import seal
    from gpumarket.proto.identity import Identity
    from gpumarket.proto.v1 import types_pb2 as pb

    broker, client, provider = Identity.generate(), Identity.generate(), Identity.generate()

    async def scenario():
        w = store.write
        await w(broker_arrays.submit, array_job(client, "a6", 1, 1), 1)
        await w(jobs.create_lease, LeaseTerms("a6-1", "p1", (0,), 1.0, 60_000, 0), 2,
                lambda lease: seal(broker, lease))
        await w(jobs.mark_started, "a6-1", 1, "p1", 3)
        receipt = seal(provider, pb.Receipt(job_id="a6-1", epoch=1, provider_id="p1"))
        await w(jobs.succeed, "a6-1", 1, "p1", receipt.SerializeToString(), 6)
        before = await w(providers.heartbeats, {"p1": 5}, {"p1": [("a6-1", 1)]})
        after = await w(providers.heartbeats, {"p1": 7}, {"p1": [("a6-1", 1)]})
        return before, after

    assert asyncio.run(scenario()) == ({}, {"p1": [("a6-1", 1)]})


def test_a_lane_gone_idle_steals_the_rest_of_a_slower_lease_split_between_them(store):
    """Work stealing: an array over two lanes; one lease ends while the other has 18 tasks
    left at 0.1 s each. That lease is asked to yield (not before the first ended, not where
    what is left is quicker than two new leases); its last task reported meanwhile counts;
    the rest go back as two batches, one a lane, without an attempt; each task succeeds
    once, none is lost, and a result the yielded lease sends for a task moved on is not
    recorded."""
    import asyncio

    from gpumarket.broker.jobs import arrays as broker_arrays
    from gpumarket.broker.jobs import transitions as jobs
    from gpumarket.proto.envelope import seal
    from gpumarket.proto.errors import FailedPrecondition
    from gpumarket.proto.identity import Identity
    from gpumarket.proto.v1 import gateway_pb2 as gw
    from gpumarket.proto.v1 import types_pb2 as pb

    broker, client, provider = Identity.generate(), Identity.generate(), Identity.generate()
    sign = lambda lease: seal(broker, lease)
    w, r = store.write, store.read
    ok = lambda tasks, s=0.1: [gw.TaskResult(task=t, ok=True, seconds=s) for t in tasks]

    async def run_lease(batch: str, provider_id: str, at: int) -> None:
        await w(jobs.create_lease, LeaseTerms(batch, provider_id, (0,), 1.0, 60_000, 0), at,
                sign)
        await w(jobs.mark_started, batch, 1, provider_id, at + 1)

    async def end_lease(batch: str, provider_id: str, at: int) -> None:
        receipt = seal(provider, pb.Receipt(job_id=batch, epoch=1, provider_id=provider_id))
        await w(jobs.succeed, batch, 1, provider_id, receipt.SerializeToString(), at)

    def tasks(db):
        return {t: (state, attempts, batch) for t, state, attempts, batch in db.execute(
            "SELECT task, state, attempts, batch_id FROM array_tasks ORDER BY task")}

    async def scenario():
        await w(broker_arrays.submit, array_job(client, "a9", 40, 0), 1, 2)   # two lanes
        await run_lease("a9-1", "p1", 2)
        await run_lease("a9-2", "p2", 2)
        # Both lanes busy: nothing to steal for.
        assert await w(broker_arrays.record_results, "a9-2", 1, "p2", ok([20]), 4) == 0
        assert await w(broker_arrays.record_results, "a9-1", 1, "p1", ok(range(20)), 5) == 0
        await end_lease("a9-1", "p1", 6)
        # Lane p1 idle; a9-2 has 18 left: at 1 ms a task, quicker than two new leases.
        assert await w(broker_arrays.record_results, "a9-2", 1, "p2", ok([21], 0.001), 7) == 0
        assert await w(broker_arrays.record_results, "a9-2", 1, "p2", ok([22]), 8) == 17
        # Asked again while the lane is idle (a provider whose split is pending ignores it).
        assert await w(broker_arrays.record_results, "a9-2", 1, "p2", ok([23]), 9) == 16
        await end_lease("a9-2", "p2", 10)
        got = await r(tasks)
        S, Q = pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_QUEUED
        assert all(got[t] == (S, 0, "a9-2") for t in range(20, 24))
        assert {t: got[t] for t in range(24, 40)} == \
            {t: (Q, 0, "a9-3" if t < 32 else "a9-4") for t in range(24, 40)}
        with pytest.raises(FailedPrecondition):     # that lease is over: its late results
            await w(broker_arrays.record_results, "a9-2", 1, "p2", ok([30]), 11)
        await run_lease("a9-3", "p1", 12)
        await run_lease("a9-4", "p2", 12)
        await w(broker_arrays.record_results, "a9-3", 1, "p1", ok(range(24, 32)), 14)
        await w(broker_arrays.record_results, "a9-4", 1, "p2", ok(range(32, 40)), 14)
        await end_lease("a9-3", "p1", 15)
        await end_lease("a9-4", "p2", 15)
        got = await r(tasks)
        assert [got[t][:2] for t in range(40)] == [(S, 0)] * 40
        assert (await r(jobs.job_row, "a9"))["state"] == S

    asyncio.run(scenario())


def test_a_lease_ending_asks_the_busiest_lease_of_its_array_to_yield_at_once(store):
    """The steal for a lane gone idle is made when its lease ends (gateway: a batch's
    receipt), not at the other lease's next report: the running lease with the most tasks
    left yields them; none while every lane is busy, none for a lease that has reported no
    task yet (no pace); a lease asked to split is asked again (its answer may have been
    none: it tells nothing then), one asked to stop is not."""
    import asyncio

    from gpumarket.broker.jobs import arrays as broker_arrays
    from gpumarket.broker.jobs import transitions as jobs
    from gpumarket.proto.envelope import seal
    from gpumarket.proto.identity import Identity
    from gpumarket.proto.v1 import gateway_pb2 as gw
    from gpumarket.proto.v1 import types_pb2 as pb

    broker, client, provider = Identity.generate(), Identity.generate(), Identity.generate()
    w = store.write
    ok = lambda tasks: [gw.TaskResult(task=t, ok=True, seconds=0.1) for t in tasks]

    async def two_lanes(array: str, at: int) -> None:
        await w(broker_arrays.submit, array_job(client, array, 40, 0), at, 2)
        for batch, p in ((f"{array}-1", "p1"), (f"{array}-2", "p2")):
            await w(jobs.create_lease, LeaseTerms(batch, p, (0,), 1.0, 60_000, 0), at,
                    lambda lease: seal(broker, lease))
            await w(jobs.mark_started, batch, 1, p, at + 1)

    async def first_lane_ends(array: str, at: int) -> None:
        await w(broker_arrays.record_results, f"{array}-1", 1, "p1", ok(range(20)), at)
        receipt = seal(provider, pb.Receipt(job_id=f"{array}-1", epoch=1, provider_id="p1"))
        await w(jobs.succeed, f"{array}-1", 1, "p1", receipt.SerializeToString(), at + 1)

    async def scenario():
        await two_lanes("a8", 1)
        assert await w(broker_arrays.steal_for_idle_lane, "a8", 3) is None     # both busy
        assert await w(broker_arrays.record_results, "a8-2", 1, "p2", ok([20]), 4) == 0
        await first_lane_ends("a8", 5)
        assert await w(broker_arrays.steal_for_idle_lane, "a8", 7) == ("p2", "a8-2", 1, 19)
        assert await w(broker_arrays.steal_for_idle_lane, "a8", 8) == ("p2", "a8-2", 1, 19)
        assert await w(broker_arrays.yield_lease, "a8-2", 1, 9) == 19     # another client
        assert await w(broker_arrays.steal_for_idle_lane, "a8", 10) is None    # it stops
        await two_lanes("a7", 10)
        await first_lane_ends("a7", 12)
        assert await w(broker_arrays.steal_for_idle_lane, "a7", 14) is None    # no pace yet

    asyncio.run(scenario())
