"""Checks of endpoint answers (docs/verification.md, Endpoint answers): the router keeps a
bounded sample of each replica's answers at the broker's rate; a window's sample becomes a
check whose pay hold, verdict, conviction, ban and replacement are those of every check. The
replays run the real answer_check prefill on the tests' tiny random Llamas (a second random
init is "another model"); the ledger and checks run on a real SQLite file through the
broker's own transactions."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest

from gpumarket import kinds
from gpumarket.broker.checks import answers, disputes, verification
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs.job import LeaseTerms
from gpumarket.broker.money import ledger
from gpumarket.broker.serving import answer_samples, endpoints
from gpumarket.broker.serving.answer_samples import AnswerSamples
from gpumarket.kinds.endpoint import ANSWERS
from gpumarket.kinds.engine_protocol import (
    Complete, Final, decode_answer, encode_answer, encode_request,
)
from gpumarket.proto.v1 import types_pb2 as pb
from tests.test_answer_sampling import FakeReplica, answer
from tests.test_ledger import World, sign
from tests.test_serving_hostile_scaling import CLIENT, endpoint_job
from tests.test_verification_rules import CHECK, checks

# -- the check: held pay, verdict, conviction ---------------------------------------------------

PROMPTS = ["the quick brown fox", "a marketplace for idle gpus", "providers advertise"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.models import tiny_causal_lm

    root = tmp_path_factory.mktemp("answer-models")
    return {"right": tiny_causal_lm(root / "right", 0), "other": tiny_causal_lm(root / "other", 1)}


@pytest.fixture(scope="module")
def served(models):
    """The batch engine's answers to PROMPTS with each model: (request bytes, Final)."""
    from tests.test_fingerprints import serve_answers

    return {name: [(encode_request(r), f) for r, f in serve_answers(path, PROMPTS, 33)]
            for name, path in models.items()}


def answer_world(tmp_path, endpoint) -> World:
    """A broker's store with the replica's provider ("liar"), three checkers, a funded
    client and its ``endpoint`` (a NewJob) submitted."""
    world = World(tmp_path / "broker.db")
    for p in ("liar", "h1", "h2", "h3"):
        world.db["providers"].insert({"id": p, "public_key": b"", "first_seen_ms": 0,
                                      "last_seen_ms": 0, "online": 1})
    world.write(ledger.credit, CLIENT.id, 10**9, "client", "", "op", "k", 1)
    world.write(endpoints.submit, endpoint, world.now)
    return world


@pytest.fixture
def w(tmp_path):
    return answer_world(tmp_path, endpoint_job(2, 2, hold=10**8, enforce=True))


def serve_on(w: World, replica: str, provider: str) -> dict:
    """Lease the replica to ``provider`` (a CPU) and have it serve; returns its lease row."""
    w.now += 1000
    w.write(jobs.create_lease, LeaseTerms(replica, provider, (0,), 1.0, 60_000, 0,
                                          accelerator=pb.ACCELERATOR_CPU), w.now, sign)
    epoch = w.job(replica)["epoch"]
    w.write(jobs.mark_started, replica, epoch, provider, w.now)
    w.write(endpoints.mark_ready, replica, epoch, provider, "batch", w.now)
    return jobs.lease_row(w.db, w.job(replica)["lease_id"])


def end_window(w: World, lease: dict, answered: list[tuple[bytes, Final]],
               engine: str = "") -> str:
    """The replica answered these in a window (each sampled, as at rate 1); the autoscaler's
    settle pass ends the window. Returns the check queued."""
    from gpumarket.kinds.endpoint import settings_of, tokens_only

    samples = AnswerSamples(1.0)
    top = w.job(w.job(lease["job_id"])["parent_id"])
    r = FakeReplica(lease["provider_id"], lease["id"], lease["job_id"], engine=engine,
                    tokens_only=tokens_only(settings_of(top["spec"]), lease["accelerator"],
                                            engine))
    for request, fin in answered:
        answer(samples, r, request, fin)
    (window,) = samples.take()
    blobs = {lease["id"]: answers.window_blobs(window.lease_id, window.answers,
                                               window.samples, window.drawn)}
    w.now += 60_000
    before = set(checks(w, lease["job_id"]))
    w.write(endpoints.settle_running, w.now, blobs, {lease["provider_id"]: CHECK})
    (check_id,) = [c for c, row in checks(w, lease["job_id"]).items()
                   if c not in before and row["role"] == "check"]
    return check_id


def replay(w: World, tmp_path: Path, models, check_id: str, checker: str) -> Path:
    """``checker`` runs the check as the serve runner does (answer_check.run_check, the
    claimed answers it is given) on the endpoint's right model; returns its answers.jsonl."""
    from gpumarket.kinds.runner_job import RunnerJob
    from gpumarket.provider.runners.answer_check import run_check

    c = verification.check_row(w.db, check_id)
    scope = json.loads(c["scope"])
    assert verification.excluded(w.db, check_id) >= {c["provider_id"]}
    # the checker reads the claimed answers (requests and token ids), never the fingerprints
    claimed_blob = answers_data(w, c, scope["claimed"]["sha256"])
    assert b"fingerprints" not in claimed_blob
    work = tmp_path / check_id
    work.mkdir()
    (work / "claimed.jsonl").write_bytes(claimed_blob)
    job = RunnerJob(params={"model": "", "model_name": "tiny", "task": "", "dtype": "",
                            "max_seq_len": 0, "max_concurrency": 8, "engine": "batch",
                            "trust_remote_code": False},
                    model_dir=str(models["right"]), check_of=c["job_id"],
                    check_claimed=str(work / "claimed.jsonl"))

    class Report:
        def done(self, **metrics):
            self.metrics = metrics

    run_check(job, work, Report())
    w.now += 1000
    w.write(jobs.create_lease, LeaseTerms(check_id, checker, (0,), 1.0, 60_000, 0,
                                          accelerator=pb.ACCELERATOR_CPU), w.now, sign)
    epoch = w.job(check_id)["epoch"]
    w.write(jobs.mark_started, check_id, epoch, checker, w.now)
    return work / "outputs" / ANSWERS


BLOBS: dict[str, bytes] = {}


def answers_data(w: World, c: dict, sha: str) -> bytes:
    return BLOBS[sha]


def compare(w: World, check_id: str, got: Path, tmp_path: Path) -> tuple[bool, str]:
    c = verification.check_row(w.db, check_id)
    expect = tmp_path / f"{check_id}.expect"
    expect.write_bytes(BLOBS[json.loads(c["expect"])[ANSWERS]["sha256"]])
    return kinds.get(pb.JOB_KIND_ENDPOINT).compare({ANSWERS: expect}, {ANSWERS: got},
                                                   json.loads(c["scope"]))


@pytest.fixture(autouse=True)
def keep_blobs(monkeypatch):
    """What the autoscaler writes to the artifact store, kept in memory here."""
    real = answers.window_blobs

    def kept(*args):
        out = real(*args)
        for b in (out.expect, out.claimed):
            BLOBS[b.sha256] = b.data
        return out

    monkeypatch.setattr(answers, "window_blobs", kept)


def returned(w: World, check_id: str, checker: str) -> None:
    from tests.test_verification_rules import receipt

    w.now += 1000
    w.write(jobs.succeed, check_id, w.job(check_id)["epoch"], checker,
            receipt(check_id, checker, [ANSWERS], w), w.now)


def test_a_check_of_honest_answers_passes_and_the_held_pay_is_paid(w, tmp_path, models, served):
    lease = serve_on(w, "ep-r1", "h1")
    check_id = end_window(w, lease, served["right"])
    # the window's pay is held while its answers are checked
    held = ledger.balance(w.db, ledger.disputed("ep-r1", "h1"))
    assert held > 0 and ledger.balance(w.db, ledger.provider("h1")) == 0
    got = replay(w, tmp_path, models, check_id, "h2")
    agrees, detail = compare(w, check_id, got, tmp_path)
    assert agrees, detail
    returned(w, check_id, "h2")
    w.write(disputes.conclude, check_id, agrees, False, detail, w.now)
    assert checks(w, "ep-r1")[check_id]["state"] == "passed"
    assert ledger.balance(w.db, ledger.disputed("ep-r1", "h1")) == 0
    assert ledger.balance(w.db, ledger.provider("h1")) > 0
    assert verification.record(w.db, "h1") == (1, 1, 0)
    assert w.job("ep-r1")["state"] == pb.JOB_STATE_RUNNING      # it serves on
    # what it compared is not kept for the endpoint's lifetime once the check ended
    assert evidence(w) == set()
    assert ledger.audit(w.db) == []


def evidence(w: World) -> set[str]:
    return {r[0] for r in w.db.execute("SELECT sha256 FROM artifact_refs WHERE job_id = 'ep'"
                                       " AND role = 'evidence'").fetchall()}


def test_an_ended_answer_check_leaves_evidence_another_open_check_compares(w, served):
    """Two windows of the same answers (one blob): the first check's end keeps the blob
    the second still compares; the second's end lets it go."""
    lease = serve_on(w, "ep-r1", "h1")
    first = end_window(w, lease, served["right"])
    second = end_window(w, lease, served["right"])
    shared = json.loads(verification.check_row(w.db, first)["expect"])[ANSWERS]["sha256"]
    assert shared == json.loads(verification.check_row(w.db, second)["expect"])[ANSWERS][
        "sha256"]
    w.write(disputes.skip, first, "test", w.now)
    assert shared in evidence(w)
    w.write(disputes.skip, second, "test", w.now)
    assert evidence(w) == set()


def convict(w: World, tmp_path: Path, models, check_id: str, replica: str):
    """Two honest replays (h2, then h3 as tie-breaker) judge the window; returns the
    tie-break's Outcome."""
    got = replay(w, tmp_path, models, check_id, "h2")
    agrees, detail = compare(w, check_id, got, tmp_path)
    assert not agrees, detail
    returned(w, check_id, "h2")
    w.write(disputes.conclude, check_id, False, False, detail, w.now)
    (tiebreak,) = [c for c, row in checks(w, replica).items() if row["first_check"] == check_id]
    assert verification.excluded(w.db, tiebreak) >= {"liar", "h2"}
    got2 = replay(w, tmp_path, models, tiebreak, "h3")
    agrees2, detail2 = compare(w, tiebreak, got2, tmp_path)
    first = verification.check_row(w.db, tiebreak)
    scope = {**json.loads(first["scope"]), "replays": True}
    agrees_first = kinds.get(pb.JOB_KIND_ENDPOINT).compare({ANSWERS: got}, {ANSWERS: got2},
                                                           scope)[0]
    assert not agrees2 and agrees_first
    returned(w, tiebreak, "h3")
    return w.write(disputes.conclude, tiebreak, agrees2, agrees_first, detail2, w.now)


def test_a_replica_answering_with_another_model_is_convicted_unpaid_replaced_then_banned(
        w, tmp_path, models, served):
    leases = [serve_on(w, "ep-r1", "liar")]
    check_id = end_window(w, leases[0], served["other"])
    assert ledger.balance(w.db, ledger.disputed("ep-r1", "liar")) > 0
    outcome = convict(w, tmp_path, models, check_id, "ep-r1")
    assert checks(w, "ep-r1")[check_id]["state"] == "failed"
    assert verification.record(w.db, "liar")[2] == 1
    # unpaid: its held window returned to the endpoint's hold, nothing left to it
    assert ledger.balance(w.db, ledger.disputed("ep-r1", "liar")) == 0
    assert ledger.balance(w.db, ledger.provider("liar")) <= 0
    # replaced: its lease stopped, the replica queued again, never to go back to it
    assert ("ep-r1", leases[0]["epoch"], "liar") in outcome.stop
    replica = w.job("ep-r1")
    assert replica["state"] == pb.JOB_STATE_QUEUED and replica["attempt"] == 2
    assert "liar" in verification.excluded(w.db, "ep-r1")
    assert outcome.banned == ()
    # a second replica of it is caught too: the second failure bans it
    leases.append(serve_on(w, "ep-r2", "liar"))
    check2 = end_window(w, leases[1], served["other"])
    outcome = convict(w, tmp_path, models, check2, "ep-r2")
    assert outcome.banned == ("liar",)
    assert w.db.execute("SELECT banned FROM providers WHERE id = 'liar'").fetchone()[0]
    assert ledger.audit(w.db) == []


def test_a_replica_that_omits_its_fingerprints_fails_its_check(w, tmp_path, models, served):
    lease = serve_on(w, "ep-r1", "liar")
    bare = [(request, replace(fin, token_ids=None, fingerprints=None))
            for request, fin in served["right"]]
    check_id = end_window(w, lease, bare)
    outcome = convict(w, tmp_path, models, check_id, "ep-r1")
    assert "no fingerprints" in checks(w, "ep-r1")[check_id]["detail"] or \
        "fingerprints" in verification.check_row(w.db, check_id)["detail"]
    assert checks(w, "ep-r1")[check_id]["state"] == "failed"
    assert ("ep-r1", lease["epoch"], "liar") in outcome.stop
    assert ledger.balance(w.db, ledger.provider("liar")) <= 0


def test_an_answer_check_lease_names_neither_the_replica_nor_its_provider(w, served):
    """The checker of a window's answers gets the sampled requests and token ids as a
    content-addressed ref it alone may read, under a name of the check's own: nothing in its
    lease names the replica (or its lease) whose answers they are, nor its provider."""
    from gpumarket.broker.jobs import views
    from tests.test_verification_rules import _strings

    lease = serve_on(w, "ep-r1", "h1")
    check_id = end_window(w, lease, served["right"])
    w.now += 1000
    w.write(jobs.create_lease, LeaseTerms(check_id, "h2", (0,), 1.0, 60_000, 0,
                                          accelerator=pb.ACCELERATOR_CPU), w.now, sign)
    envelope = w.db.execute("SELECT envelope FROM leases WHERE job_id = ?",
                            [check_id]).fetchone()[0]
    got = pb.Lease.FromString(pb.Envelope.FromString(envelope).payload)
    assert got.HasField("check") and got.check.claimed.sha256
    assert not [s for s in _strings(got) if "ep-r1" in s or "h1" in s]
    got.ClearField("job_spec")          # the endpoint's signed spec, which it must run
    assert b"ep-r1" not in got.SerializeToString() and b"h1" not in got.SerializeToString()
    assert b"h1" not in BLOBS[got.check.claimed.sha256]
    assert views.may_read(w.db, "h2", got.check.claimed.sha256)
    assert not views.may_read(w.db, "h3", got.check.claimed.sha256)


def test_a_window_is_not_held_without_a_sample_nor_when_checks_are_off(w):
    lease = serve_on(w, "ep-r1", "h1")
    w.now += 60_000
    w.write(endpoints.settle_running, w.now, {}, {})
    assert ledger.balance(w.db, ledger.provider("h1")) > 0
    assert checks(w, "ep-r1") == {}
    samples = AnswerSamples(1.0)
    answer(samples, FakeReplica("h1", lease["id"], "ep-r1"),
           encode_request(Complete(prompt="hi", max_tokens=3)))
    (window,) = samples.take()
    w.now += 60_000
    w.write(endpoints.settle_running, w.now,
            {lease["id"]: answers.window_blobs(lease["id"], 1, window.samples)},
            {"h1": verification.OFF})
    assert checks(w, "ep-r1") == {}
    assert ledger.balance(w.db, ledger.disputed("ep-r1", "h1")) == 0


def test_kept_answers_survive_a_broker_restart_and_their_window_is_still_checked(w, served):
    """Each kept answer is written to the store as it is kept: a broker that restarts (or a
    new leader) with an empty router still queues the window's check and holds its pay, and
    the store keeps the router's bounds though a fresh router counts from nothing."""
    lease = serve_on(w, "ep-r1", "h1")
    r = FakeReplica("h1", lease["id"], "ep-r1")
    samples = AnswerSamples(1.0, keep=lambda kept: w.write(answer_samples.keep, kept, w.now))
    for request, fin in served["right"]:
        assert answer(samples, r, request, fin)
    del samples                                 # the broker stops: its router is gone ...
    w.db.conn.close()
    now, w = w.now, World(w.path)               # ... and the next opens the same file
    w.now = now
    restarted = AnswerSamples(1.0, keep=lambda kept: w.write(answer_samples.keep, kept, w.now))
    assert restarted.take() == []
    # it keeps more of the same window, up to the bounds as stored
    request, fin = served["right"][0]
    for _ in range(answer_samples.MAX_PER_WINDOW):
        answer(restarted, r, request, fin)
    restarted.take()                            # its memory says nothing of the first three
    (window,) = w.write(answer_samples.take_stored)
    assert window.lease_id == lease["id"] and window.provider_id == "h1"
    assert len(window.samples) == answer_samples.MAX_PER_WINDOW      # not 3 + 64
    assert [s["request"] for s in window.samples[:3]] == \
        [json.loads(q) for q, _ in served["right"]]
    assert window.samples[0]["token_ids"] == served["right"][0][1].token_ids
    assert w.write(answer_samples.take_stored) == []        # taken: a new window begins
    w.now += 60_000
    blobs = {lease["id"]: answers.window_blobs(window.lease_id, window.answers,
                                               window.samples, window.drawn)}
    w.write(endpoints.settle_running, w.now, blobs, {"h1": CHECK})
    (check_id,) = checks(w, "ep-r1")
    assert verification.check_row(w.db, check_id)["state"] == "queued"
    assert ledger.balance(w.db, ledger.disputed("ep-r1", "h1")) > 0     # its pay held
    assert ledger.balance(w.db, ledger.provider("h1")) == 0


def test_the_broker_s_writer_stores_each_kept_answer_and_the_settle_pass_takes_them(
        tmp_path, served):
    """The broker's path: StoreWriter writes a kept answer in a transaction of its own on the
    store's writer; take_kept (the autoscaler's settle pass) waits for those writes and takes
    the windows as stored, counting the answers the router saw; an answer not kept is never
    written."""
    from gpumarket.broker.store.store import Store

    async def main():
        store = Store(tmp_path / "broker.db")
        store.open()
        try:
            samples = AnswerSamples(0.0, keep=answer_samples.StoreWriter(store))
            samples.settled = frozenset({"p1"})     # past its warm-up: nothing drawn, none kept
            r = FakeReplica()
            request, fin = served["right"][0]
            assert not answer(samples, r, request, fin)
            samples.rate = 1.0
            for request, fin in served["right"]:
                assert answer(samples, r, request, fin)
            (window,) = await samples.take_kept(store)
            stored = await store.read(lambda db: db.execute(
                "SELECT count(*) FROM answer_samples").fetchone()[0])
            return window, stored
        finally:
            store.close()

    window, stored = asyncio.run(main())
    assert (window.lease_id, len(window.samples), window.drawn) == ("ep-r1.1", 3, 3)
    assert window.answers == 4          # the router's count: one answered but not kept
    assert stored == 0                  # taken


def test_a_replica_that_stops_before_its_window_ends_is_still_checked_and_not_revived(
        w, tmp_path, models, served):
    """A replica scaled in (or drained) during its window: its last settlement is held and
    the window checked all the same; convicted, the ended replica stays ended (it is not
    queued again as a live replica would be)."""
    lease = serve_on(w, "ep-r1", "liar")
    w.now += 30_000
    w.write(endpoints.retire, "ep-r1", "scale in", w.now)
    assert ledger.balance(w.db, ledger.provider("liar")) > 0        # paid at its end ...
    check_id = end_window(w, lease, served["other"])
    assert ledger.balance(w.db, ledger.provider("liar")) == 0       # ... and held now
    convict(w, tmp_path, models, check_id, "ep-r1")
    assert w.job("ep-r1")["state"] == pb.JOB_STATE_CANCELLED
    assert ledger.balance(w.db, ledger.provider("liar")) <= 0
    assert verification.record(w.db, "liar")[2] == 1
    assert ledger.audit(w.db) == []


FALLBACK = "batch (one transformers generate call at a time: asked for) on cpu"


def fallback_answers(model_dir: Path) -> list[tuple[bytes, Final]]:
    """PROMPTS answered together by the batch engine's fallback (left-padded generate calls,
    no fingerprints), as a replica whose engine fell back answers them."""
    from gpumarket.kinds.runner_job import RunnerJob
    from gpumarket.provider.runners.batching import BatchEngine
    from gpumarket.provider.runners.engine import Settings, load_engine
    from tests.test_fingerprints import ENGINE_PARAMS

    job = RunnerJob(params=ENGINE_PARAMS, model_dir=str(model_dir))

    async def run():
        loaded = load_engine(job, model_dir)
        engine = BatchEngine(loaded.tokenizer, loaded.model, Settings.from_params(job.params),
                             loaded.max_seq_len, stepwise=False)
        assert engine.description.startswith(FALLBACK[:40])
        out = {}

        async def one(i):
            request = Complete(prompt=PROMPTS[i], max_tokens=33 + i, temperature=0)
            async for event in engine.complete(f"r{i}", request):
                if isinstance(event, Final):
                    out[i] = (encode_request(request), event)
        try:
            await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(PROMPTS)))), 300)
        finally:
            await engine.close()
        return [out[i] for i in range(len(PROMPTS))]

    return asyncio.run(run())


def test_a_replica_saying_its_engine_fell_back_is_still_checked_by_its_greedy_tokens(
        w, tmp_path, models, served):
    """A replica that says its batch engine fell back to generate calls (no fingerprints)
    commits to its token ids: its greedy answers are judged by the token gap, so saying so
    does not let a replica answer without the model unchecked. An honest one passes; one
    whose tokens are another model's is found wrong; one that sends no token ids commits to
    nothing."""
    honest = fallback_answers(models["right"])
    # through the wire as the engine writes it: token ids without fingerprints
    for _, f in honest:
        back = decode_answer(encode_answer(f))
        assert back.token_ids == f.token_ids and len(f.token_ids) == f.output_tokens > 0
        assert back.fingerprints is None
    # a cheat's: another model's tokens, said to come from the fallback
    cheat = [(q, replace(f, fingerprints=None)) for q, f in served["other"]]
    results = {}
    for name, provider, answered in (("right", "h1", honest), ("other", "liar", cheat)):
        replica = "ep-r1" if name == "right" else "ep-r2"
        lease = serve_on(w, replica, provider)
        check_id = end_window(w, lease, answered, FALLBACK)
        expect = BLOBS[json.loads(verification.check_row(w.db, check_id)["expect"])
                       [ANSWERS]["sha256"]]
        assert b'"tokens_only":true' in expect and b"AAAA" not in expect
        got = replay(w, tmp_path, models, check_id, "h2" if name == "right" else "h3")
        results[name] = compare(w, check_id, got, tmp_path)
    assert results["right"][0], results["right"][1]
    assert not results["other"][0] and "greedy token" in results["other"][1]
    # no token ids: commits to nothing
    rows = [{"index": 0, "token_ids": None, "fingerprints": None, "greedy": True,
             "tokens_only": True}]
    want, have = tmp_path / "want.jsonl", tmp_path / "have.jsonl"
    want.write_text("".join(json.dumps(r) + "\n" for r in rows))
    have.write_text(json.dumps({"index": 0, "fingerprints": [], "token_gap": 0.0}) + "\n")
    agrees, why = kinds.get(pb.JOB_KIND_ENDPOINT).compare({ANSWERS: want}, {ANSWERS: have}, {})
    assert not agrees and "no token ids" in why


@pytest.mark.slow     # the serve runner and its model in a child process (~45 s in the fast lane)
def test_the_serve_runner_in_check_mode_replays_the_claimed_answers(tmp_path, models, served):
    """As a provider runs a check lease of an endpoint: job.json with the check's fields
    (check_of, check_claimed), the engine socket on stdin; the runner prefills the claimed
    answers, writes answers.jsonl and reports done, without serving."""
    import socket
    import subprocess
    import sys

    from gpumarket.kinds.runner_job import RunnerJob

    samples = AnswerSamples(1.0)
    for request, fin in served["right"]:
        answer(samples, FakeReplica(), request, fin)
    (window,) = samples.take()
    blobs = answers.window_blobs(window.lease_id, window.answers, window.samples)
    work = tmp_path / "work"
    work.mkdir()
    (work / "claimed.jsonl").write_bytes(blobs.claimed.data)
    job = RunnerJob(params={"model": "", "model_name": "tiny", "task": "", "dtype": "",
                            "max_seq_len": 0, "max_concurrency": 8, "engine": "",
                            "trust_remote_code": False},
                    model_dir=str(models["right"]), check_of="ep-r1", check_batch_size=8,
                    check_claimed=str(work / "claimed.jsonl"))
    (work / "job.json").write_text(job.to_json())
    ours, theirs = socket.socketpair()
    with ours, theirs:
        done = subprocess.run([sys.executable, "-m", "gpumarket.provider.runners.serve",
                               str(work)], stdin=theirs.fileno(), capture_output=True,
                              text=True, timeout=300, env={**__import__("os").environ,
                                                           "GPUMARKET_REPORT_FILE":
                                                           str(work / "report.jsonl")})
    assert done.returncode == 0, done.stderr[-2000:]
    reports = [json.loads(x) for x in (work / "report.jsonl").read_text().splitlines()]
    assert reports[-1]["event"] == "done" and reports[-1]["metrics"]["answers"] == len(PROMPTS)
    expect = tmp_path / "expect.jsonl"
    expect.write_bytes(blobs.expect.data)
    agrees, detail = kinds.get(pb.JOB_KIND_ENDPOINT).compare(
        {ANSWERS: expect}, {ANSWERS: work / "outputs" / ANSWERS}, {"dtype": ""})
    assert agrees, detail


def test_a_window_checked_only_because_its_provider_is_new_is_its_warm_up(w, served):
    """Paid for by the provider (disputes.charge_warmups when the endpoint ends), not by the
    client; a window the rate drew is the client's."""
    lease = serve_on(w, "ep-r1", "h1")
    samples = AnswerSamples(0.0)                 # no answer drawn: the window's minimum only
    r = FakeReplica("h1", lease["id"], "ep-r1")
    for request, fin in served["right"]:
        answer(samples, r, request, fin)
    (window,) = samples.take()
    assert (len(window.samples), window.drawn) == (1, 0)
    w.now += 60_000
    w.write(endpoints.settle_running, w.now,
            {lease["id"]: answers.window_blobs(lease["id"], window.answers, window.samples,
                                               window.drawn)}, {"h1": CHECK})
    (row,) = checks(w, "ep-r1").values()
    assert row["paid_by"] == "h1"
    drawn = end_window(w, lease, served["right"])          # drawn at the rate (1.0 there)
    assert checks(w, "ep-r1")[drawn]["paid_by"] is None


def test_a_window_nobody_can_check_is_paid_and_said_once_an_hour(w):
    """No other provider of its device class online: the window is paid unchecked, and the
    endpoint's events say so once an hour, not once a window."""
    lease = serve_on(w, "ep-r1", "h1")
    alone = verification.Policy(enabled=True, others_online=frozenset(), draw=0.0)
    for _ in range(3):
        samples = AnswerSamples(1.0)
        answer(samples, FakeReplica("h1", lease["id"], "ep-r1"),
               encode_request(Complete(prompt="hi", max_tokens=3)))
        (window,) = samples.take()
        w.now += 60_000
        w.write(endpoints.settle_running, w.now,
                {lease["id"]: answers.window_blobs(lease["id"], 1, window.samples, 1)},
                {"h1": alone})
    assert checks(w, "ep-r1") == {}
    assert ledger.balance(w.db, ledger.disputed("ep-r1", "h1")) == 0
    notes = w.db.execute("SELECT message FROM events WHERE job_id = 'ep' AND message LIKE"
                         " '%left unchecked%'").fetchall()
    assert len(notes) == 1, notes
