"""Receipts for an array's task results. A provider signs one receipt for each task results
update, over a hash tree of its tasks' outputs (kinds/receipt_tree.py): the broker checks
that one signature and each task's outputs against it, keeps each task's path up the tree,
and a client checks every task's outputs alone against it. An older provider's receipt of
its own for each task is still taken. Also: its provider's id worked out once per identity,
never another identity's."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from gpumarket.broker.jobs import arrays as broker_arrays
from gpumarket.kinds import arrays, receipt_tree
from gpumarket.proto.envelope import open_envelope, payload_sha256, seal
from gpumarket.proto.errors import BadSignature, InvalidArgument
from gpumarket.proto.identity import Identity
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider import receipts
from gpumarket.provider.leases import Assignment
from tests.test_array_rules import inline_world, task_rows


def _assignment(provider: Identity) -> Assignment:
    lease = pb.Lease(lease_id="a-1.1", job_id="a-1", attempt=1, epoch=1,
                     provider_id=provider.id, device_indices=[0])
    return Assignment(lease, pb.JobSpec(), "client", "a" * 64)


def test_each_identity_signs_receipts_naming_itself():
    refs = [pb.ArtifactRef(name="task000001.result.json", sha256="b" * 64, size_bytes=10)]
    ones = [Identity.generate() for _ in range(12)]     # more than the ids kept at once
    for _ in range(2):
        for one in ones:
            receipt, signer = open_envelope(receipts.sign(one, _assignment(one), refs, 0.5),
                                            pb.Receipt)
            assert receipt.provider_id == signer == one.id
            assert list(receipt.outputs) == refs


def test_the_broker_refuses_a_task_receipt_another_key_signed():
    honest, other = Identity.generate(), Identity.generate()
    good = receipts.sign(honest, _assignment(honest), [], 0.1)
    forged = receipts.sign(other, _assignment(honest), [], 0.1)
    results = [gw.TaskResult(task=1, ok=True, receipt=good)]
    assert set(broker_arrays.task_receipts(results, honest.id)) == {1}
    with pytest.raises(BadSignature, match="not signed by the lease's provider"):
        broker_arrays.task_receipts([gw.TaskResult(task=2, ok=True, receipt=forged)],
                                    honest.id)


def _refs(task: int, *files: bytes) -> list[pb.ArtifactRef]:
    return [pb.ArtifactRef(name=arrays.output_name(task, f"r{n}.json"),
                           sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
            for n, data in enumerate(files)]


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 13])
def test_a_receipt_tree_proves_each_task_s_outputs_and_nothing_else(count):
    tasks = {t: _refs(t, b"%d" % t, b"x") for t in range(10, 10 + count)}
    leaves = [receipt_tree.task_leaf(t, refs) for t, refs in tasks.items()]
    root, paths = receipt_tree.tree(leaves)
    assert receipt_tree.root(leaves) == root        # (the provider's, without the paths)
    receipt = pb.Receipt(tasks_root=root)
    for (task, refs), path in zip(tasks.items(), paths):
        assert receipt_tree.covers(receipt, task, refs, path)
        assert receipt_tree.covers(receipt, task, list(reversed(refs)), path)   # any order
        assert not receipt_tree.covers(receipt, task + 100, refs, path)
        assert not receipt_tree.covers(receipt, task, refs[:1], path)           # one hidden
        assert not receipt_tree.covers(receipt, task, refs + _refs(task, b"more")[:1], path)
        changed = pb.ArtifactRef()
        changed.CopyFrom(refs[0])
        changed.size_bytes += 1
        assert not receipt_tree.covers(receipt, task, [changed, refs[1]], path)
        if path:
            assert not receipt_tree.covers(receipt, task, refs, path[:-1])     # malformed
            assert not receipt_tree.covers(receipt, task, refs, b"X" + path[1:])
        assert not receipt_tree.covers(receipt, task, refs, path + b"L" + root)  # too long
        if count > 1:
            other = paths[(list(tasks).index(task) + 1) % count]
            assert not receipt_tree.covers(receipt, task, refs, other)
    # An inner node is no leaf: no task's leaf equals a node over two others.
    assert not receipt_tree.covers(pb.Receipt(tasks_root=b"\0" * 31), 10, tasks[10], b"")


def _world(store, tmp_path):
    from gpumarket.broker.jobs import transitions as jobs

    state, servicer, session, provider, _, answers = inline_world(store, tmp_path)
    top = asyncio.run(store.read(jobs.job_row, "a5"))
    # The spec's real hash (the world's rows carry a stand-in), as the client checks it.
    spec_sha = payload_sha256(pb.Envelope.FromString(top["spec"]))
    asyncio.run(store.write(lambda db: db.execute("UPDATE jobs SET spec_sha256 = ?",
                                                  [spec_sha])))
    return state, servicer, session, provider, answers, spec_sha, top


def _update(provider, spec_sha: str, files: dict[int, list[bytes]], signer=None,
            alter=None) -> gw.JobUpdate:
    """Tasks ``files`` names succeeded with those outputs, carried along, under one receipt
    for the update (signed by ``signer``, default the provider; ``alter``: what to change
    in the results after signing)."""
    results = [gw.TaskResult(task=t, ok=True, seconds=0.1, outputs=_refs(t, *data))
               for t, data in files.items()]
    root, _ = receipt_tree.tree([receipt_tree.task_leaf(r.task, r.outputs) for r in results])
    signer = signer or provider
    receipt = seal(signer, pb.Receipt(job_id="a5-1", epoch=1, provider_id=signer.id,
                                      spec_sha256=spec_sha, tasks_root=root))
    if alter:
        alter(results, receipt)
    blobs = {hashlib.sha256(d).hexdigest(): d for data in files.values() for d in data}
    return gw.JobUpdate(job_id="a5-1", epoch=1, tasks=gw.TaskResults(
        results=results, seq=1, receipt=receipt,
        blobs=[gw.TaskOutputBlob(sha256=s, data=d) for s, d in blobs.items()]))


def _listed(db) -> list[pb.ArrayTask]:
    """The tasks as ListTasks gives them to the client (broker/api/marketplace.py)."""
    import json

    return [pb.ArrayTask(task=t["task"], provider_id=t["provider_id"],
                         lease_job_id=t["batch_id"],
                         receipt=pb.Envelope.FromString(t["receipt"]),
                         receipt_path=bytes(t["receipt_path"]),
                         outputs=[pb.ArtifactRef(**o) for o in json.loads(t["outputs"])])
            for t in broker_arrays.tasks(db, "a5", 0, 10, [])[0]]


def test_one_receipt_signs_an_update_s_tasks_and_the_client_checks_each_alone(
        store, tmp_path):
    """The broker takes an update's one receipt for both tasks' outputs: SUCCEEDED with
    them, each with its path kept; the client checks each task against the one signature,
    and refuses one task's outputs under another's row or path. The update as sent is left
    as it came: sent again, acknowledged again, nothing counted twice."""
    from gpumarket.broker.store import blob_holdings
    from gpumarket.client.tasks import task_receipt

    _, servicer, session, provider, answers, spec_sha, top = _world(store, tmp_path)
    files = {0: [b'{"task": 0}', b"zero"], 1: [b'{"task": 1}']}
    sent = _update(provider, spec_sha, files)
    before = sent.SerializeToString()

    async def scenario():
        await servicer._job_update(session, sent)
        held = await store.read(blob_holdings.uploaded_bytes, provider.id)
        await servicer._job_update(session, sent)
        assert await store.read(blob_holdings.uploaded_bytes, provider.id) == held
        return await store.read(task_rows), await store.read(_listed)

    rows, listed = asyncio.run(scenario())
    assert answers() == [(1, True, ""), (1, True, "")]
    assert sent.SerializeToString() == before
    assert {t: row[0] for t, row in rows.items()} == {0: pb.JOB_STATE_SUCCEEDED,
                                                      1: pb.JOB_STATE_SUCCEEDED}
    array = pb.Job(job_id="a5", spec=pb.Envelope.FromString(top["spec"]))
    opened: dict = {}
    for t in listed:
        assert len(t.receipt_path) == receipt_tree.STEP_BYTES       # two leaves: one step
        got = task_receipt(array, t, opened)
        assert [o.name for o in got.outputs] == [o.name for o in t.outputs]
    assert len(opened) == 1                                         # one signature checked
    swapped = pb.ArrayTask()
    swapped.CopyFrom(listed[0])
    swapped.receipt_path = listed[1].receipt_path
    with pytest.raises(BadSignature, match="task 0: its outputs are not the ones"):
        task_receipt(array, swapped)
    swapped.CopyFrom(listed[0])
    del swapped.outputs[1]                          # the broker hides one of its outputs
    with pytest.raises(BadSignature, match="task 0: its outputs are not the ones"):
        task_receipt(array, swapped, opened)


def _other_size(results, receipt):
    results[0].outputs[0].size_bytes += 1


def _both(results, receipt):
    results[1].receipt.CopyFrom(receipt)


@pytest.mark.parametrize("attack, why", [
    ("stranger", "not signed by the lease's provider"),
    ("altered", "does not sign its tasks' outputs"),
    ("unsigned", "signed by no receipt"),
    ("both", "names its outputs in it"),
])
def test_outputs_no_update_receipt_signs_are_refused(store, tmp_path, attack, why):
    """An update whose receipt another key signed, whose outputs differ from what it
    signed, that has no receipt, or a result with a receipt of its own beside outputs named
    in the result: refused with the reason, no task SUCCEEDED, nothing stored or held."""
    from gpumarket.broker.store import blob_holdings

    _, servicer, session, provider, answers, spec_sha, _ = _world(store, tmp_path)
    files = {0: [b"a"], 1: [b"b"]}
    sent = _update(provider, spec_sha, files,
                   signer=Identity.generate() if attack == "stranger" else None,
                   alter={"altered": _other_size, "both": _both}.get(attack))
    if attack == "unsigned":
        sent.tasks.ClearField("receipt")

    async def scenario():
        await servicer._job_update(session, sent)
        return await store.read(blob_holdings.uploaded_bytes, provider.id), \
            await store.read(task_rows)

    held, rows = asyncio.run(scenario())
    [(seq, accepted, reason)] = answers()
    assert (seq, accepted) == (1, False) and why in reason, reason
    assert held == 0
    assert all(s != pb.JOB_STATE_SUCCEEDED and outputs is None for s, outputs in rows.values())
    assert list((tmp_path / "artifacts" / "blobs").rglob("*")) == []


def test_a_task_s_own_receipt_may_not_be_an_update_s():
    """An update's receipt signs outputs by its root: passed off as one task's own (which
    names its outputs itself) it would sign none of them, so it is refused."""
    honest = Identity.generate()
    update_receipt = receipts.sign(honest, _assignment(honest), [], 0.1, tasks_root=b"r" * 32)
    with pytest.raises(BadSignature, match="its receipt is an update's"):
        broker_arrays.task_receipts([gw.TaskResult(task=1, ok=True, receipt=update_receipt)],
                                    honest.id)
    with pytest.raises(InvalidArgument, match="two receipts in one update"):
        own = receipts.sign(honest, _assignment(honest), [], 0.1)
        broker_arrays.task_receipts([gw.TaskResult(task=1, ok=True, receipt=own)] * 2,
                                    honest.id)
