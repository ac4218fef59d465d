"""Issue 34: a render check's exact sample sized to catch one doctored frame of a long lease
(a quarter of its frames, every check alike), and compared by the broker within a time budget
a pass: a comparison that runs out of time is neither a pass nor a disagreement, and the next
pass goes on where it stopped (kinds/render.py ``compare_sample``, broker/checks/verdicts.py).
In-process: the kind's compare on small PNGs, and the broker's verdict loop over a real
SQLite store driven through its own transactions."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import random
import threading

import pytest

from gpumarket.broker.checks import verdicts, verification
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.money import ledger
from gpumarket.kinds import render
from gpumarket.kinds.base import Unfinished
from gpumarket.proto.v1 import types_pb2 as pb
from tests.test_check_comparisons import RENDER, frame_png
from tests.test_ledger import new_job
from tests.test_verification_rules import CHECK, start


def test_every_check_samples_a_quarter_so_one_frame_of_a_long_lease_is_caught_in_20():
    """The cap of 32 frames found one doctored frame of 1,000 in 3 % of checks (0.48 within
    a new provider's 20 checked jobs). A quarter of any lease up to 16,384 frames is at least
    the 0.206 a check must catch for 0.99 within 20; the same share for a warm-up check as a
    steady one, so its size tells a checker nothing of the checked provider's record."""
    assert [render.check_frames(n) for n in (1, 4, 10, 128, 1000, 16_384)] == [
        1, 1, 3, 32, 250, 4096]
    assert render.check_frames(10**6) == render.MAX_CHECK_FRAMES == 4096
    for n in (1, 10, 100, 1000, 5000, 16_384):
        assert 1 - (1 - render.catch_probability(n, 1)) ** 20 >= 0.99, n
    assert 1 - (1 - render.catch_probability(10**5, 1)) ** 20 < 0.99   # past the cap: less


def sample_files(tmp_path, frames, doctored=()):
    """(the provider's delivery, the checker's replay) of ``frames``, by name."""
    honest = {f: frame_png(tmp_path / f"h{f}.png", f % 250) for f in frames}
    delivered = {render.frame_name(f): frame_png(tmp_path / f"d{f}.png", 255 - f % 250)
                 if f in doctored else honest[f] for f in frames}
    return delivered, {render.frame_name(f): honest[f] for f in frames}


def test_a_sample_compared_in_part_is_neither_passed_nor_failed_and_goes_on(tmp_path,
                                                                            monkeypatch):
    frames = list(range(1, 13))
    monkeypatch.setattr(render, "SAMPLE_COMPARE_S", -1.0)   # one frame a pass
    monkeypatch.setattr(render, "_draw", random.Random(5))
    expect, got = sample_files(tmp_path, frames)
    compared: list[int] = []
    for passes in range(1, len(frames) + 1):
        try:
            ok, why = render.KIND.compare(expect, got, {"frames": frames,
                                                        "compared": compared})
            break
        except Unfinished as part:
            assert part.progress["compared"] != compared     # a frame more each pass
            compared = part.progress["compared"]
            assert len(compared) == passes and f"{passes} of the 12 sampled" in str(part)
    assert ok and passes == len(frames) and why == "12 frames drawn from 1-12: pixels identical"
    # A doctored frame is found at the pass that reaches it, never passed before.
    expect, got = sample_files(tmp_path, frames, doctored={9})
    compared = []
    while True:
        try:
            ok, why = render.KIND.compare(expect, got, {"frames": frames,
                                                        "compared": compared})
            break
        except Unfinished as part:
            compared = part.progress["compared"]
            assert 9 not in compared
    assert not ok and why.startswith("frame_000009.png: 48 of 48 pixels differ")
    # Within its time the whole sample is compared in one pass.
    monkeypatch.setattr(render, "SAMPLE_COMPARE_S", 60.0)
    assert not render.KIND.compare(expect, got, {"frames": frames})[0]


class Broker:
    """The broker's state over a real SQLite store, driven as tests/test_verification_rules
    drives its World (``write``, ``now``, ``job``), and its verdict loop run a pass at a
    time."""

    def __init__(self, tmp_path):
        from gpumarket.broker.config import BrokerConfig
        from gpumarket.broker.state import BrokerState
        from gpumarket.broker.store.artifact_store import ArtifactStore
        from gpumarket.broker.store.store import Store
        from gpumarket.proto.identity import Identity

        self.store = Store(tmp_path / "broker.db")
        self.store.open()
        self.state = BrokerState(BrokerConfig(data_dir=tmp_path, verify=True),
                                 Identity.generate(), self.store,
                                 ArtifactStore(tmp_path / "artifacts", 1 << 30))
        self.loop = asyncio.Runner()
        self.now = 1_000_000

    def write(self, fn, *args):
        return self.loop.run(self.store.write(fn, *args))

    def read(self, fn, *args):
        return self.loop.run(self.store.read(fn, *args))

    def job(self, job_id):
        return self.read(jobs.job_row, job_id)

    def checks(self, job_id: str) -> list[dict]:
        return self.read(lambda db: [verification.check_row(db, r[0]) for r in db.execute(
            "SELECT id FROM checks WHERE job_id = ? ORDER BY created_at_ms, id", [job_id])])

    def decide(self) -> int:
        return self.loop.run(verdicts.decide(self.state))

    def close(self):
        self.loop.close()
        self.store.close()

    def receipt(self, job_id: str, provider: str, files: dict) -> bytes:
        """A receipt of ``files`` (name: path), each stored as the broker stores a blob."""
        outs = []
        for name, path in files.items():
            data = path.read_bytes()
            sha = hashlib.sha256(data).hexdigest()
            blob = self.state.artifacts.blob_path(sha)
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            self.write(_stored, sha, provider, len(data), self.now)
            outs.append(pb.ArtifactRef(name=name, sha256=sha, size_bytes=len(data)))
        r = pb.Receipt(job_id=job_id, provider_id=provider, outputs=outs)
        return pb.Envelope(payload=r.SerializeToString()).SerializeToString()


def _stored(db, sha: str, owner: str, size: int, now: int) -> None:
    db.execute("INSERT INTO artifacts (sha256, size_bytes, created_at_ms) VALUES (?, ?, ?)"
               " ON CONFLICT DO NOTHING", [sha, size, now])
    db.execute("INSERT INTO artifact_owners (sha256, owner_id, size_bytes, created_at_ms)"
               " VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING", [sha, owner, size, now])


def _providers(db) -> None:
    for p in ("pa", "h1", "h2"):
        db["providers"].insert({"id": p, "public_key": b"", "first_seen_ms": 0,
                                "last_seen_ms": 0, "online": 1})


@pytest.fixture
def broker(tmp_path, monkeypatch):
    monkeypatch.setattr(render, "MAX_PREVIEW_FRAMES", 0)     # the exact sample alone here
    b = Broker(tmp_path)
    b.write(_providers)
    b.write(ledger.credit, "ca", 10**7, "client", "", "op", "k", 1)
    yield b
    b.close()


def rendered_job(b: Broker, tmp_path, doctored=(), job_id: str = "j", frames: int = 40
                 ) -> tuple[str, list[int]]:
    """A render job of ``frames`` frames run by "pa" (``doctored`` frames wrong) and its
    check replayed by "h1"; returns the check and its sampled frames."""
    spec = pb.JobSpec()
    render.KIND.write(spec, {**RENDER, "frame_end": frames})
    job = new_job(job_id, "ca", 500_000, True)
    b.write(jobs.submit, dataclasses.replace(
        job, spec=pb.Envelope(payload=spec.SerializeToString()).SerializeToString(),
        needs=dataclasses.replace(job.needs, kind=pb.JOB_KIND_RENDER)), b.now)
    start(b, job_id, "pa")
    delivered, replayed = sample_files(tmp_path, range(1, frames + 1), doctored)
    b.now += 60_000
    b.write(jobs.succeed, job_id, b.job(job_id)["epoch"], "pa",
            b.receipt(job_id, "pa", delivered), b.now, CHECK)
    (check,) = b.checks(job_id)
    check_id, sample = check["id"], b.read(verification.scope_of, check["id"]).frames
    start(b, check_id, "h1")
    b.now += 30_000
    b.write(jobs.succeed, check_id, b.job(check_id)["epoch"], "h1",
            b.receipt(check_id, "h1", {render.frame_name(f): replayed[render.frame_name(f)]
                                       for f in sample}), b.now)
    return check_id, list(sample)


def test_the_broker_judges_a_sample_compared_over_passes_only_once_it_is_whole(
        broker, tmp_path, monkeypatch):
    """Honest work: each pass of the verdict loop compares one more frame (its time for the
    sample spent), the check stays returned and the job verifying, the held pay held; the
    pass that compares the last frame passes it and pays the segment on."""
    check_id, frames = rendered_job(broker, tmp_path)
    assert len(frames) == 10                              # a quarter of 40
    monkeypatch.setattr(render, "SAMPLE_COMPARE_S", -1.0)
    for done in range(1, len(frames)):
        assert broker.decide() == 0
        (check,) = broker.checks("j")
        progress = json.loads(check["scope"])["progress"]["checked"]["compared"]
        assert check["state"] == "returned" and len(progress) == done
        assert broker.job("j")["state"] == pb.JOB_STATE_VERIFYING
        assert broker.read(verification.summary, "j") == "checking"
        assert broker.read(ledger.balance, ledger.disputed("j", "pa")) > 0
    assert broker.decide() == 1
    (check,) = broker.checks("j")
    assert check["state"] == "passed" and "10 frames drawn from" in check["detail"]
    assert broker.read(verification.summary, "j") == "verified"
    assert broker.read(ledger.balance, ledger.disputed("j", "pa")) == 0


def test_a_doctored_frame_found_on_a_later_pass_calls_a_tie_break_that_starts_afresh(
        broker, tmp_path, monkeypatch):
    monkeypatch.setattr(render, "_draw", random.Random(1))
    probe = render.KIND.check_scope({**RENDER, "frame_end": 40}, 0, 1, {}, 0)["frames"]
    monkeypatch.setattr(render, "_draw", random.Random(1))   # the check draws the same
    check_id, frames = rendered_job(broker, tmp_path, doctored={probe[-1]})
    assert frames == probe
    monkeypatch.setattr(render, "SAMPLE_COMPARE_S", -1.0)
    passes = 0
    while broker.decide() == 0:
        passes += 1
        assert passes < len(frames)
    first, tiebreak = broker.checks("j")
    assert first["state"] == "disagreed" and "pixels differ" in first["detail"]
    assert "progress" not in json.loads(tiebreak["scope"])   # compares every frame again
    assert json.loads(tiebreak["scope"])["frames"] == frames
    # The tie-break's two comparisons go on over passes too; the one against the checked
    # result, once ended, is kept, not redone, while the other goes on.
    _, replayed = sample_files(tmp_path, range(1, 41))
    start(broker, tiebreak["id"], "h2")
    broker.now += 30_000
    broker.write(jobs.succeed, tiebreak["id"], broker.job(tiebreak["id"])["epoch"], "h2",
                 broker.receipt(tiebreak["id"], "h2", {render.frame_name(f): replayed[
                     render.frame_name(f)] for f in frames}), broker.now)
    memos = []
    while broker.decide() == 0:
        memos.append(json.loads(broker.checks("j")[1]["scope"])["progress"])
        assert len(memos) < 2 * len(frames)
    assert memos[-1]["checked"]["verdict"][0] is False      # kept from an earlier pass
    assert len(memos[-1]["first"]["compared"]) == len(frames) - 1
    assert [c["state"] for c in broker.checks("j")] == ["failed", "failed"]
    assert broker.read(verification.record, "pa")[2] == 1     # pa was found wrong


def test_two_checks_are_compared_at_once_so_a_long_one_holds_back_no_verdict(
        broker, tmp_path, monkeypatch):
    """The verdict loop compared one check after another: a render sample taking its 120 s
    a pass held back every check behind it. Now checks are compared side by side (COMPARERS
    threads): each comparison here waits, in its thread, until the other has begun — one
    after another, the first would wait alone and fail."""
    rendered_job(broker, tmp_path, job_id="j")
    rendered_job(broker, tmp_path, job_id="k", frames=20)
    both = threading.Barrier(2, timeout=10)
    compare = verdicts._compare

    def side_by_side(*args):
        both.wait()
        return compare(*args)

    monkeypatch.setattr(verdicts, "_compare", side_by_side)
    assert broker.decide() == 2
    assert [c["state"] for job in ("j", "k") for c in broker.checks(job)] == ["passed"] * 2
