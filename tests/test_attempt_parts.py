"""The parts an attempt is made of, each called directly without a job process: outputs
and receipts (provider/receipts.py), checkpoint uploads (provider/checkpoint_upload.py), a
job array's task results (provider/task_results.py) and taking an attempt up again after a
daemon restart (provider/reattach.py). The daemon and the broker's artifact store are
tests/test_provider_parts.py's FakeHost."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path

import pytest
from gpumarket.kinds import receipt_tree
from gpumarket.proto.envelope import open_envelope
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider import checkpoints, jobfiles, reattach, receipts, task_results
from gpumarket.provider.attempt import Attempt
from gpumarket.provider.checkpoint_upload import CheckpointUploads
from gpumarket.provider.reports import TaskEnded
from gpumarket.provider.task_results import TaskResults

from tests.test_provider_parts import (  # noqa: F401 (checksum_kind: its fixture)
    PROVIDER,
    FakeHost,
    checksum_assignment,
    checksum_kind,
)


def update(**fields) -> gw.ProviderMessage:
    return gw.ProviderMessage(job_update=gw.JobUpdate(job_id="j", epoch=1, **fields))


def sent(host: FakeHost, what: str) -> list[gw.JobUpdate]:
    return [m.job_update for m in host.sent if m.job_update.WhichOneof("update") == what]


# -- receipts --------------------------------------------------------------------------------

def test_a_receipt_names_the_lease_its_outputs_and_device_seconds():
    a = checksum_assignment(b"x")
    a.lease.device_indices.append(1)
    out = pb.ArtifactRef(name="a.txt", sha256="0" * 64, size_bytes=3)
    receipt, signer = open_envelope(receipts.sign(PROVIDER, a, [out], 2.5, {"loss": 0.5}),
                                    pb.Receipt)
    assert signer == PROVIDER.id
    assert (receipt.job_id, receipt.lease_id, receipt.attempt, receipt.epoch) == ("j", "j.1", 1, 1)
    assert receipt.spec_sha256 == a.spec_sha256 and list(receipt.outputs) == [out]
    assert receipt.wall_seconds == 2.5 and receipt.device_seconds == 5.0
    assert dict(receipt.metrics) == {"loss": 0.5}


def test_outputs_go_up_each_content_once_and_in_order(tmp_path):
    host = FakeHost(tmp_path, {})
    out = tmp_path / "w" / "outputs"
    out.mkdir(parents=True)
    for name in ("b.txt", "a.txt"):
        (out / name).write_text("same")
    (out / "c.txt").write_text("other")
    uploads: list[str] = []
    real = host.upload

    async def upload(source, name, digest=None):
        uploads.append(name)
        return await real(source, name, digest)

    host.upload = upload
    refs = asyncio.run(receipts.upload_outputs(host, tmp_path / "w", os.geteuid(),
                                               [("outputs", None)]))
    assert sorted(r.name for r in refs) == ["a.txt", "b.txt", "c.txt"]
    assert len(uploads) == 2                      # "same" once
    by_name = {r.name: r for r in refs}
    assert by_name["a.txt"].sha256 == by_name["b.txt"].sha256 == hashlib.sha256(b"same").hexdigest()
    assert host.blobs[by_name["c.txt"].sha256] == b"other"


def test_outputs_that_are_a_link_are_refused_and_nothing_goes_up(tmp_path):
    """The job may swap an output for a link to a file of the daemon's: it fails the job
    (JobFileError), the file is never read."""
    host = FakeHost(tmp_path, {})
    out = tmp_path / "w" / "outputs"
    out.mkdir(parents=True)
    (out / "key").symlink_to("/etc/hostname")
    with pytest.raises(jobfiles.JobFileError):
        asyncio.run(receipts.upload_outputs(host, tmp_path / "w", os.geteuid(),
                                            [("outputs", None)]))
    assert host.blobs == {}


# -- checkpoint uploads ----------------------------------------------------------------------

def write_checkpoint(workdir: Path, step: int) -> str:
    rel = f"checkpoints/step-{step:08d}"
    (workdir / rel).mkdir(parents=True)
    (workdir / rel / "state.json").write_text(json.dumps({"step": step}))
    (workdir / rel / "results.jsonl").write_text("{}\n")
    (workdir / rel / "COMPLETE").write_text(str(step))
    return rel


def test_the_newest_checkpoint_goes_up_is_reported_and_older_ones_are_removed(tmp_path):
    host = FakeHost(tmp_path, {})
    workdir = tmp_path / "w"
    uploads = CheckpointUploads(workdir, os.geteuid(), host, update, step=1)

    async def scenario():
        uploads.reported(1, write_checkpoint(workdir, 1), 0.1)   # resumed from: not again
        await uploads.finish()
        assert host.sent == []
        for step in (2, 3):
            uploads.reported(step, write_checkpoint(workdir, step), 0.1)
        await uploads.finish()

    asyncio.run(scenario())
    reports = [u.checkpoint for u in sent(host, "checkpoint")]
    assert [r.step for r in reports] in ([2, 3], [3])    # 2 skipped if 3 came first
    assert uploads.uploaded_step == 3 and uploads.report.job_update.checkpoint.step == 3
    assert sorted(os.listdir(workdir / "checkpoints")) == ["step-00000003"]
    tar = tmp_path / "ckpt.tar"
    tar.write_bytes(host.blobs[reports[-1].artifact.sha256])
    got = checkpoints.unpack(tar, tmp_path / "resume")
    assert checkpoints.step_of(got) == 3
    assert not list((workdir / "upload").iterdir())   # no tar left behind


def test_a_checkpoint_swapped_for_a_link_is_not_uploaded(tmp_path):
    host = FakeHost(tmp_path, {})
    workdir = tmp_path / "w"
    (workdir / "checkpoints").mkdir(parents=True)
    (workdir / "checkpoints" / "step-00000002").symlink_to("/etc")
    uploads = CheckpointUploads(workdir, os.geteuid(), host, update)

    async def scenario():
        uploads.reported(2, "checkpoints/step-00000002", 0.1)
        await uploads.finish()

    asyncio.run(scenario())
    assert host.sent == [] and host.blobs == {} and uploads.uploaded_step == 0


# -- task results ----------------------------------------------------------------------------

def test_task_results_go_in_updates_of_bounded_size_and_only_for_the_lease_s_tasks(
        tmp_path, monkeypatch):
    monkeypatch.setattr(task_results, "TASKS_PER_UPDATE", 4)
    host = FakeHost(tmp_path, {})
    tasks = TaskResults(range(10), tmp_path / "w", os.geteuid(), host, update,
                        lambda outputs, seconds, tasks_root=b"": pb.Envelope())

    async def scenario():
        told = [tasks.ended(TaskEnded(t, t % 3 != 0, "boom" if t % 3 == 0 else "", 0.01))
                for t in range(10)]
        assert all(told)
        assert not tasks.ended(TaskEnded(3, True, "", 0.01))     # told already
        assert not tasks.ended(TaskEnded(10, True, "", 0.01))    # not this lease's
        await tasks.settle()

    asyncio.run(scenario())
    updates = sent(host, "tasks")
    assert [len(u.tasks.results) for u in updates] == [4, 4, 2]
    results = [r for u in updates for r in u.tasks.results]
    assert [r.task for r in results] == list(range(10))
    assert [r.ok for r in results] == [t % 3 != 0 for t in range(10)]
    assert tasks.open == set()


@pytest.mark.parametrize("outputs", [False, True], ids=["no-outputs", "one-file-each"])
def test_task_results_updates_halve_toward_the_lease_s_end(tmp_path, monkeypatch, outputs):
    """The array's end waits for the broker to record its leases' last updates: a lease of
    100 tasks sends 50 as soon as 50 are left, then 25, then 16 (LAST_UPDATE_TASKS), and its
    last update holds the 9 left; not one second's worth (TASK_FLUSH_S, out of the way here)
    held to its end. Alike whether its tasks' outputs go up first or not."""
    monkeypatch.setattr(task_results, "TASK_FLUSH_S", 60.0)
    host = FakeHost(tmp_path, {})
    workdir = tmp_path / "w"
    for t in range(100 if outputs else 0):
        out = workdir / task_results.task_outputs(t)
        out.mkdir(parents=True)
        (out / "result.json").write_text(f'{{"task": {t}}}')
    tasks = TaskResults(range(100), workdir, os.geteuid(), host, update,
                        lambda refs, seconds, tasks_root=b"": receipts.sign(
                            PROVIDER, checksum_assignment(b"x"), refs, seconds,
                            tasks_root=tasks_root))
    before_end: list[int] = []

    async def all_end():
        for t in range(100):
            tasks.ended(TaskEnded(t, True, "", 0.01))
            while tasks.to_upload and tasks.due():      # the uploader takes them up
                await asyncio.sleep(0.001)
        while len(host.sent) < 3:                       # (their uploads end)
            await asyncio.sleep(0.001)

    async def scenario():
        await asyncio.wait_for(all_end(), 30)
        before_end.extend(len(u.tasks.results) for u in sent(host, "tasks"))
        await tasks.settle()

    asyncio.run(scenario())
    updates = sent(host, "tasks")
    assert before_end == [50, 25, 16]
    assert [len(u.tasks.results) for u in updates] == [50, 25, 16, 9]
    assert [r.task for u in updates for r in u.tasks.results] == list(range(100))
    assert all(r.ok and len(r.outputs) == outputs and not r.receipt.payload
               for u in updates for r in u.tasks.results)
    assert all(bool(u.tasks.receipt.payload) == outputs for u in updates)
    assert sum(len(u.tasks.blobs) for u in updates) == (100 if outputs else 0)


def test_a_yielding_lease_sends_what_it_holds_at_once(tmp_path, monkeypatch):
    """Asked to yield, a lease stops after its current task: the results it holds go at
    once, and that task's alone when it ends (the stolen tasks' new leases wait for this
    lease's end)."""
    monkeypatch.setattr(task_results, "TASK_FLUSH_S", 60.0)
    host = FakeHost(tmp_path, {})
    tasks = TaskResults(range(100), tmp_path / "w", os.geteuid(), host, update,
                        lambda refs, seconds, tasks_root=b"": pb.Envelope())

    async def scenario():
        for t in range(30):
            tasks.ended(TaskEnded(t, True, "", 0.01))
        assert sent(host, "tasks") == []                # 30 of 100: not due yet
        tasks.yielding()
        assert [len(u.tasks.results) for u in sent(host, "tasks")] == [30]
        tasks.ended(TaskEnded(30, True, "", 0.01))      # the task it ran when asked
        assert [len(u.tasks.results) for u in sent(host, "tasks")] == [30, 1]
        await tasks.settle()

    asyncio.run(scenario())
    assert len(sent(host, "tasks")) == 2


def test_a_task_with_too_many_outputs_fails_alone(tmp_path, monkeypatch):
    from gpumarket.kinds import arrays

    monkeypatch.setattr(arrays, "TASK_OUTPUTS", 3)
    host = FakeHost(tmp_path, {})
    workdir = tmp_path / "w"
    for task, files in ((0, 2), (1, 4)):
        out = workdir / task_results.task_outputs(task)
        out.mkdir(parents=True)
        for i in range(files):
            (out / f"{i}.txt").write_text(f"{task}.{i}")
    signed: list[bytes] = []

    def sign(refs, seconds, tasks_root=b""):
        signed.append(tasks_root)
        return receipts.sign(PROVIDER, checksum_assignment(b"x"), refs, seconds,
                             tasks_root=tasks_root)

    tasks = TaskResults([0, 1], workdir, os.geteuid(), host, update, sign)

    async def scenario():
        for t in (0, 1):
            tasks.ended(TaskEnded(t, True, "", 0.01))
        await tasks.settle()

    asyncio.run(scenario())
    updates = sent(host, "tasks")
    results = {r.task: r for u in updates for r in u.tasks.results}
    assert results[0].ok and [o.name for o in results[0].outputs] == [
        arrays.output_name(0, "0.txt"), arrays.output_name(0, "1.txt")]
    assert not results[1].ok and "more than the 3" in results[1].error
    assert not results[1].outputs
    # One receipt for the update, over task 0's outputs alone.
    assert signed == [receipt_tree.tree([receipt_tree.task_leaf(0, results[0].outputs)])[0]]
    assert [bool(u.tasks.receipt.payload) for u in updates] == [True]


# -- after a daemon restart ------------------------------------------------------------------

def test_an_array_lease_that_ended_while_no_daemon_watched_is_finished_from_its_reports(
        tmp_path):
    """What the runner reported while the daemon was down is all there is: the tasks it
    told, then a receipt for the lease (a task told twice is passed on once)."""
    host = FakeHost(tmp_path, {})
    a = checksum_assignment(b"x")
    a.lease.tasks.extend(range(3))
    job = Attempt(a, tmp_path / "jobs" / "j.1", host)
    job.workdir.mkdir(parents=True)
    lines = [{"event": "task", "task": 0, "ok": True, "error": "", "seconds": 0.1},
             {"event": "task", "task": 2, "ok": False, "error": "bad", "seconds": 0.1},
             {"event": "task", "task": 2, "ok": True, "error": "", "seconds": 0.1},
             {"event": "done", "metrics": {"tasks_ok": 1.0}}]
    (job.workdir / "reports.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))

    async def scenario():
        done = reattach.done_meanwhile(job)
        assert done is not None and done.metrics == {"tasks_ok": 1.0}
        await reattach.finish_meanwhile(job, done)

    asyncio.run(scenario())
    results = [r for u in sent(host, "tasks") for r in u.tasks.results]
    assert [(r.task, r.ok) for r in results] == [(0, True), (2, False)]
    assert host.final.job_update.WhichOneof("update") == "receipt"
    receipt, _ = open_envelope(host.final.job_update.receipt, pb.Receipt)
    assert list(receipt.outputs) == [] and job.task_results.open == {1}


def test_a_job_without_a_done_report_did_not_finish_meanwhile(tmp_path):
    host = FakeHost(tmp_path, {})
    job = Attempt(checksum_assignment(b"x"), tmp_path / "jobs" / "j.1", host)
    job.workdir.mkdir(parents=True)
    assert reattach.done_meanwhile(job) is None
    (job.workdir / "reports.jsonl").write_text(
        json.dumps({"event": "progress", "step": 1, "total": 2, "metrics": {}}) + "\n")
    assert reattach.done_meanwhile(job) is None
