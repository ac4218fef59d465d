"""A job array lease's task results update recorded in bulk (broker/jobs/arrays.py
record_results: a few statements for the whole update) and its carried outputs made durable
together (broker/store/artifact_store.py: one sync of the file system, not one a file), on
a real store, without processes."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest

from gpumarket.broker.jobs import arrays as broker_arrays
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs.job import LeaseTerms
from gpumarket.broker.store import artifact_store, blob_holdings
from gpumarket.broker.store.artifact_store import ArtifactStore
from gpumarket.kinds import arrays
from gpumarket.proto.envelope import seal
from gpumarket.proto.errors import FailedPrecondition
from gpumarket.proto.identity import Identity
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from tests.test_array_rules import array_job

S, Q, F = pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_QUEUED, pb.JOB_STATE_FAILED


def blob(text: str) -> tuple[str, bytes]:
    data = text.encode()
    return hashlib.sha256(data).hexdigest(), data


def leased_array(store, provider: Identity) -> str:
    """Array a7 of six tasks in two batches of three (two attempts a task), its first batch
    leased to ``provider`` and started; returns the batch's spec hash."""
    broker, client = Identity.generate(), Identity.generate()

    async def setup():
        w = store.write
        await w(broker_arrays.submit, array_job(client, "a7", 6, 3, max_attempts=2), 1)
        await w(jobs.create_lease, LeaseTerms("a7-1", provider.id, (0,), 1.0, 60_000, 0), 2,
                lambda lease: seal(broker, lease))
        await w(jobs.mark_started, "a7-1", 1, provider.id, 3)
        return (await store.read(jobs.job_row, "a7-1"))["spec_sha256"]

    return asyncio.run(setup())


def succeeded(provider: Identity, spec_sha: str, task: int, *outputs: tuple[str, bytes]
              ) -> tuple[gw.TaskResult, pb.Receipt]:
    refs = [pb.ArtifactRef(name=arrays.output_name(task, f"r{n}.json"), sha256=sha,
                           size_bytes=len(data)) for n, (sha, data) in enumerate(outputs)]
    receipt = pb.Receipt(job_id="a7-1", epoch=1, provider_id=provider.id,
                         spec_sha256=spec_sha, outputs=refs)
    return gw.TaskResult(task=task, ok=True, seconds=0.2,
                         receipt=seal(provider, receipt)), receipt


def rows(db) -> dict[int, tuple]:
    return {r[0]: (r[1], r[2], r[3], json.loads(r[4]) if r[4] else None) for r in db.execute(
        "SELECT task, state, attempts, batch_id, outputs FROM array_tasks ORDER BY task")}


def test_one_update_records_each_of_its_tasks_once_and_ignores_the_others(store):
    """One update: a task whose output the provider had stored before, one whose output
    comes with it, the first task again (failed this time: the first result counts), a task
    of the array's other batch, and a task that failed. Each of this batch's tasks is
    recorded once (the batch's progress counts three), the other batch's task is untouched,
    the failed one goes back to the queue with an attempt counted, and both outputs are the
    client's (referred) and the provider's (held). The same update again changes nothing."""
    provider = Identity.generate()
    spec_sha = leased_array(store, provider)
    old, new = blob('{"task": 0}'), blob('{"task": 1}')
    first, first_receipt = succeeded(provider, spec_sha, 0, old)
    second, second_receipt = succeeded(provider, spec_sha, 1, new)
    results = [first, second, gw.TaskResult(task=0, ok=False, error="again"),
               gw.TaskResult(task=3, ok=True), gw.TaskResult(task=2, ok=False, error="boom")]
    receipts = {0: first_receipt, 1: second_receipt}

    def referred(db):
        return {r[0] for r in db.execute("SELECT sha256 FROM artifact_refs WHERE job_id = ?"
                                         " AND role = 'output'", ["a7-1"])}

    async def scenario():
        w, r = store.write, store.read
        await w(blob_holdings.record_many, [(old[0], len(old[1]))], provider.id, 1 << 20, 3)
        for _ in range(2):
            await w(broker_arrays.record_results, "a7-1", 1, provider.id, results, 4,
                    receipts, [(new[0], len(new[1]))], 1 << 20)
        return (await r(rows), (await r(jobs.job_row, "a7-1"))["progress_step"],
                await r(referred), await r(blob_holdings.held_sizes, provider.id,
                                           [old[0], new[0]]))

    got, progress, refs, held = asyncio.run(scenario())
    out = lambda task, b: [{"name": arrays.output_name(task, "r0.json"), "sha256": b[0],
                            "size_bytes": len(b[1])}]
    assert got == {0: (S, 0, "a7-1", out(0, old)), 1: (S, 0, "a7-1", out(1, new)),
                   2: (Q, 1, None, None), 3: (Q, 0, "a7-2", None), 4: (Q, 0, "a7-2", None),
                   5: (Q, 0, "a7-2", None)}
    assert progress == 3
    assert refs == {old[0], new[0]}
    assert held == {old[0]: len(old[1]), new[0]: len(new[1])}


@pytest.mark.parametrize("flaw", ["not-held", "other-size"])
def test_an_update_naming_one_output_the_provider_does_not_hold_records_nothing(store, flaw):
    """Of two succeeded tasks, the second's receipt names a blob the provider never stored
    (or one stored with another size than it says): the whole update is refused and no task
    of it is recorded, the good one included."""
    provider = Identity.generate()
    spec_sha = leased_array(store, provider)
    good, bad = blob("good"), blob("bad")
    first, first_receipt = succeeded(provider, spec_sha, 0, good)
    if flaw == "other-size":
        bad = (bad[0], bad[1] + b"!")
    second, second_receipt = succeeded(provider, spec_sha, 1, bad)

    async def scenario():
        w = store.write
        stored = [(good[0], len(good[1]))]
        if flaw == "other-size":
            stored.append((bad[0], len(bad[1]) - 1))
        await w(blob_holdings.record_many, stored, provider.id, 1 << 20, 3)
        with pytest.raises(FailedPrecondition, match=r"task 1: output task000001\.r0\.json"):
            await w(broker_arrays.record_results, "a7-1", 1, provider.id, [first, second],
                    4, {0: first_receipt, 1: second_receipt})
        return await store.read(rows)

    assert {task: row[0] for task, row in asyncio.run(scenario()).items()} == \
        {t: pb.JOB_STATE_RUNNING if t < 3 else Q for t in range(6)}


@pytest.mark.parametrize("syncfs", [True, False])
def test_carried_outputs_are_synced_before_their_names_appear_and_after(
        tmp_path, monkeypatch, syncfs):
    """stage_blobs makes a call's blobs durable before publish_blobs gives them their
    names, and publish_blobs makes the names durable before it returns: with syncfs, one
    sync of the file system each (none a file); without it, an fsync a file and a
    directory. A blob found stored already is synced by the publish as well."""
    store = ArtifactStore(tmp_path / "artifacts", 1 << 20)
    blobs = [blob(f'{{"task": {i}}}') for i in range(20)]
    named = lambda: sum(store.blob_path(sha).exists() for sha, _ in blobs)
    syncs: list[int] = []
    fsyncs: list[int] = []

    def fake_syncfs(fd: int) -> int:
        syncs.append(named())
        return 0

    real_fsync = artifact_store.os.fsync
    monkeypatch.setattr(artifact_store, "_syncfs", [fake_syncfs if syncfs else None])
    monkeypatch.setattr(artifact_store.os, "fsync",
                        lambda fd: (fsyncs.append(named()), real_fsync(fd))[1])
    store.publish_blobs(store.stage_blobs(blobs))
    assert [store.read_blob(sha, 1 << 10) for sha, _ in blobs] == [d for _, d in blobs]
    if syncfs:
        assert (syncs, fsyncs) == ([0, 20], [])
        assert store.stage_blobs(blobs[:1]) == []          # stored already: nothing staged
        store.publish_blobs([])
        assert syncs == [0, 20, 20]
    else:
        dirs = len({sha[:2] for sha, _ in blobs})
        assert syncs == [] and fsyncs == [0] * 20 + [20] * dirs
