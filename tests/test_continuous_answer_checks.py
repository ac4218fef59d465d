"""Answers of CUDA's default engines are checked (docs/verification.md, Endpoint answers).
The continuous engine (run here on the CPU, in process) fingerprints each answer as it ends
by one prefill on a twin of its model: an honest replica passes the checker's prefill, also
where continuous batching switched the model's attention to "paged|eager"; one answering
with another model, or with its tokens swapped, is found wrong. vLLM cannot run here: its
replica's answers (token ids alone) are checked on the broker's side, greedy ones by the
token gap. The check's flow (held pay, verdict) is tests/test_answer_checks.py's."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from gpumarket import kinds
from gpumarket.broker.money import ledger
from gpumarket.broker.serving import endpoints
from gpumarket.kinds import fingerprints as fp
from gpumarket.kinds.engine_protocol import Complete, Final, encode_request
from gpumarket.proto.v1 import types_pb2 as pb
from tests import test_answer_checks as answer_checks
from tests.test_answer_checks import (BLOBS, PROMPTS, answer_world, compare, end_window,
                                      replay, serve_on)
from tests.test_fingerprints import ENGINE_PARAMS, answered, judge
from tests.test_serving_hostile_scaling import CLIENT, endpoint_job, seal

MAX_TOKENS = 33         # two fingerprints an answer (fp.EVERY = 32)

# the answer checks' fixtures: their world, models, batch-engine answers and kept blobs
w, models, served = answer_checks.w, answer_checks.models, answer_checks.served
keep_blobs = answer_checks.keep_blobs


def continuous_answers(model_dir: Path, attention: str = "") -> list[tuple[Complete, Final]]:
    """PROMPTS answered together by the continuous engine (greedy, each joining a little
    after the one before), the model's attention set to ``attention`` first where given:
    (request, final message) each."""
    import torch

    from gpumarket.provider.runners.batching import ContinuousEngine
    from gpumarket.provider.runners.engine import Settings
    from gpumarket.provider.runners.generate import load

    tokenizer, model = load(model_dir, torch.device("cpu"), torch.float32)
    if attention:
        model.set_attn_implementation(attention)
    settings = Settings.from_params({**ENGINE_PARAMS, "engine": "continuous"})

    def seen(engine) -> None:
        continuous_answers.attention = (model.config._attn_implementation,
                                        engine.committer.model.config._attn_implementation)

    return answered(lambda: ContinuousEngine(tokenizer, model, settings, 256), [
        Complete(prompt=p, max_tokens=MAX_TOKENS + i, temperature=0)
        for i, p in enumerate(PROMPTS)], stagger=0.01, inside=seen)


@pytest.fixture(scope="module")
def continuous(models):
    return {name: continuous_answers(path) for name, path in models.items()}


def test_an_honest_continuous_replica_commits_to_every_answer_and_passes_its_check(
        w, tmp_path, models, continuous):
    for request, final in continuous["right"]:
        assert final.error is None, final
        assert len(final.token_ids) == final.output_tokens
        assert len(final.fingerprints) == len(fp.positions(final.output_tokens)) == 2
    lease = serve_on(w, "ep-r1", "h1")
    answered = [(encode_request(r), f) for r, f in continuous["right"]]
    check_id = end_window(w, lease, answered, "continuous (transformers continuous batching)")
    assert ledger.balance(w.db, ledger.disputed("ep-r1", "h1")) > 0     # held while checked
    agrees, detail = compare(w, check_id, replay(w, tmp_path, models, check_id, "h2"),
                             tmp_path)
    assert agrees, detail
    assert all(agrees for agrees, _ in judge(models["right"], continuous["right"], "float32"))


def test_the_twin_keeps_the_checker_s_attention_where_continuous_batching_switched_it(
        models, monkeypatch):
    """A model loaded with eager attention is switched to "paged|eager" by continuous
    batching, whose plain forward pass computes other states: the answers' fingerprints are
    made on a twin that kept eager and pass; made on the switched model itself, they fail."""
    from gpumarket.provider.runners import fingerprint

    honest = continuous_answers(models["right"], "eager")
    assert continuous_answers.attention == ("paged|eager", "eager")
    verdicts = judge(models["right"], honest, "float32")
    assert all(agrees for agrees, _ in verdicts), verdicts
    monkeypatch.setattr(fingerprint, "twin", lambda model: model)
    switched = continuous_answers(models["right"], "eager")
    assert continuous_answers.attention == ("paged|eager", "paged|eager")
    assert [f.token_ids for _, f in switched] == [f.token_ids for _, f in honest]
    verdicts = judge(models["right"], switched, "float32")
    assert not any(agrees for agrees, _ in verdicts), verdicts


def test_a_doctored_continuous_replica_is_caught(w, tmp_path, models, continuous):
    """Answers from another model; the right answers with tokens swapped, their fingerprints
    kept; and swapped tokens fingerprinted again by the right model (the token gap)."""
    import torch

    from gpumarket.provider.runners import fingerprint
    from gpumarket.provider.runners.generate import load

    lease = serve_on(w, "ep-r2", "liar")
    answered = [(encode_request(r), f) for r, f in continuous["other"]]
    check_id = end_window(w, lease, answered, "continuous (transformers continuous batching)")
    agrees, detail = compare(w, check_id, replay(w, tmp_path, models, check_id, "h3"),
                             tmp_path)
    assert not agrees and "answer 0" in detail, detail

    def swapped(final: Final) -> list[int]:
        ids = list(final.token_ids)
        ids[3], ids[20] = (ids[3] + 1) % 300, (ids[20] + 7) % 300
        return ids

    kept = [(r, replace(f, token_ids=swapped(f))) for r, f in continuous["right"]]
    _, model = load(models["right"], torch.device("cpu"), torch.float32)
    prompts = [load_prompt(models["right"], r) for r, _ in continuous["right"]]
    refit = fingerprint.commit(model, [(p, f.token_ids) for p, (_, f) in zip(prompts, kept)],
                               "cpu")
    remade = [(r, replace(f, fingerprints=p)) for (r, f), p in zip(kept, refit)]
    for doctored in (kept, remade):
        verdicts = judge(models["right"], doctored)
        assert not any(agrees for agrees, _ in verdicts), verdicts


def load_prompt(model_dir: Path, request: Complete) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(request.prompt)["input_ids"]


def test_commit_makes_the_checker_s_fingerprints(models, continuous):
    """The replica's pass (logits only at the fingerprinted positions) sees what the
    checker's prefill sees, row for row."""
    import torch

    from gpumarket.provider.runners import fingerprint
    from gpumarket.provider.runners.generate import load

    _, model = load(models["right"], torch.device("cpu"), torch.float32)
    rows = [(load_prompt(models["right"], r), f.token_ids) for r, f in continuous["right"]]
    rows.append((rows[0][0], rows[0][1][:5]))         # a short row beside long ones
    assert fingerprint.commit(model, rows, "cpu") == \
        [prints for prints, _ in fingerprint.prefill(model, rows, "cpu")]


# -- vLLM (the broker's side: vLLM cannot run here) ---------------------------------------------


@pytest.fixture
def vllm_world(tmp_path):
    """The answer checks' world with a vLLM endpoint (its signed spec's engine)."""
    spec = pb.JobSpec(name="tiny", kind=endpoints.KIND, max_price_per_gpu_hour=1.0)
    kinds.get(endpoints.KIND).write(spec, {"model_name": "m", "min_replicas": 2,
                                           "max_replicas": 2, "engine": "vllm"})
    job = replace(endpoint_job(2, 2, hold=10**8, enforce=True),
                  spec=seal(CLIENT, spec).SerializeToString(), nonce=os.urandom(16).hex())
    return answer_world(tmp_path, job)


def test_a_vllm_replica_s_greedy_answers_are_judged_by_their_tokens(
        vllm_world, tmp_path, models, served):
    """A vLLM replica's answers carry their token ids alone (what vLLM gives): sampled, kept
    as committing to those, and judged by the token gap: the right model's greedy tokens
    pass, another model's are found wrong."""
    w = vllm_world
    said = "vllm (AsyncLLM) on 1 GPU(s)"
    results = {}
    for name, replica, provider, checker in (("right", "ep-r1", "h1", "h2"),
                                             ("other", "ep-r2", "liar", "h3")):
        tokens = [(q, replace(f, fingerprints=None)) for q, f in served[name]]
        check_id = end_window(w, serve_on(w, replica, provider), tokens, said)
        expect = BLOBS[json.loads(w.db.execute("SELECT expect FROM checks WHERE id = ?",
                                               [check_id]).fetchone()[0])["answers.jsonl"]
                       ["sha256"]]
        assert expect.count(b'"tokens_only":true') == len(PROMPTS)
        results[name] = compare(w, check_id, replay(w, tmp_path, models, check_id, checker),
                                tmp_path)
    assert results["right"][0], results["right"][1]
    assert not results["other"][0] and "greedy token" in results["other"][1]


def test_answers_ending_while_one_prefill_runs_go_into_the_next_together(models, monkeypatch):
    """The Committer's thread takes every answer that ended while its last prefill ran (up
    to its BATCH) in one prefill, and each answer gets its own row's fingerprints; the
    answers of a prefill that fails are delivered without them (the client keeps its answer;
    a check that samples one fails the replica), and the thread goes on."""
    import threading

    import torch

    from gpumarket.provider.runners import fingerprint
    from gpumarket.provider.runners.generate import load

    _, model = load(models["right"], torch.device("cpu"), torch.float32)
    committer = fingerprint.Committer(model)
    real, calls, hold = fingerprint.commit, [], threading.Event()

    def commit(m, rows, device):
        calls.append(len(rows))
        assert hold.wait(60)
        if any(len(g) == 1 for _, g in rows):
            raise RuntimeError("out of memory")
        return real(m, rows, device)

    monkeypatch.setattr(fingerprint, "commit", commit)

    class Ended:
        def __init__(self, n: int) -> None:
            self.prompt_ids, self.got, self.done = [1, 2 + n], None, threading.Event()

        def deliver(self, final: Final) -> None:
            self.got = final
            self.done.set()

        def deliver_failure(self, message: str) -> None:
            self.got = message
            self.done.set()

    streams = [Ended(n) for n in range(12)]
    finals = [Final(token_ids=list(range(3, 40 + n))) for n in range(12)]
    committer(streams[0], finals[0])            # its prefill starts and waits on ``hold``
    while not calls:
        threading.Event().wait(0.01)
    for s, f in zip(streams[1:], finals[1:]):   # these end while it runs
        committer(s, f)
    failing = Ended(99)
    committer(failing, Final(token_ids=[5]))
    hold.set()
    assert all(s.done.wait(60) for s in [*streams, failing])
    committer.close()
    assert calls == [1, 8, 4]                   # 11 waiting, and the failing one: 8 + 4
    assert failing.got.token_ids == [5] and failing.got.fingerprints is None
    # each its own row's, as the same batch gives them
    assert [s.got.fingerprints for s in streams[1:9]] == real(
        model, [(s.prompt_ids, f.token_ids) for s, f in zip(streams[1:9], finals[1:9])], "cpu")
    assert len({tuple(s.got.fingerprints) for s in streams[1:9]}) == 8
    assert [s.got.fingerprints for s in streams[9:]] == [None] * 3  # in the failing prefill
