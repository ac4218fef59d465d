"""The sample of endpoint answers a check is made from (docs/verification.md, Endpoint
answers): the router keeps a bounded sample of each replica's answers at the broker's rate, a
new provider's first answer of every window, and what each answer committed to; which
replicas must fingerprint their answers. The checks themselves: tests/test_answer_checks.py."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from gpumarket.broker.serving import answer_samples
from gpumarket.broker.serving.answer_samples import AnswerSamples
from gpumarket.broker.serving.rows import LiveEndpoint, LiveReplica
from gpumarket.kinds.engine_protocol import Complete, Final, encode_request
from gpumarket.proto.v1 import types_pb2 as pb
from tests.serving_fakes import AnsweringSession, collect, ready, router

# -- the sample ------------------------------------------------------------------------------


@dataclass
class FakeReplica:
    provider_id: str = "p1"
    lease_id: str = "ep-r1.1"
    job_id: str = "ep-r1"
    endpoint_id: str = "ep"
    fingerprinted: bool = True
    engine: str = ""                # as its ReplicaReady said
    tokens_only: bool = False       # as the router judges it (kinds/endpoint.tokens_only)


def final(tokens: int = 3, prints: bool = True) -> Final:
    return Final(finish_reason="stop", prompt_tokens=2, output_tokens=tokens,
                 token_ids=list(range(tokens)) if prints else None,
                 fingerprints=["AAAA"] if prints else None)


def answer(samples: AnswerSamples, replica, request: bytes, fin: Final | None = None) -> bool:
    drawn = samples.wants(replica.endpoint_id, [replica])
    return samples.offer(replica, request if drawn is not False else None, fin or final(),
                         bool(drawn))


def test_the_sample_is_taken_at_the_rate_and_a_new_provider_has_every_window_sampled():
    request = encode_request(Complete(prompt="hello", max_tokens=3))
    samples = AnswerSamples(0.02, random.Random(7).random)
    samples.settled = frozenset({"p1"})          # past its warm-up: the rate alone
    kept = 0
    for window in range(40):
        for _ in range(500):
            answer(samples, FakeReplica(), request)
        kept += sum(len(w.samples) for w in samples.take())
    # 20,000 answers at 0.02: 400 expected (sd 20)
    assert 330 <= kept <= 470, kept
    # a new provider: the first answer of every window, even at rate 0
    samples = AnswerSamples(0.0)
    for window in range(5):
        for _ in range(10):
            answer(samples, FakeReplica(provider_id="new"), request)
        taken = samples.take()
        assert [len(w.samples) for w in taken] == [1] and taken[0].answers == 10
    # a replica whose engine records no fingerprints (CUDA's continuous, vLLM) is not sampled
    samples = AnswerSamples(1.0)
    assert not answer(samples, FakeReplica(fingerprinted=False), request)
    assert samples.take() == []


def test_the_sample_is_bounded_per_replica_and_per_endpoint_whatever_the_prompts():
    samples = AnswerSamples(1.0)
    huge = encode_request(Complete(prompt="x" * (900 << 10), max_tokens=3))
    small = encode_request(Complete(prompt="hi", max_tokens=3))
    replicas = [FakeReplica(provider_id=f"p{i}", lease_id=f"ep-r{i}.1", job_id=f"ep-r{i}")
                for i in range(8)]
    for r in replicas:
        for _ in range(10):
            answer(samples, r, huge)
    for _ in range(200):
        answer(samples, replicas[0], small)
    windows = samples.take()
    sizes = {w.lease_id: w.bytes for w in windows}
    assert max(sizes.values()) <= answer_samples.MAX_REPLICA_BYTES
    assert sum(sizes.values()) <= answer_samples.MAX_ENDPOINT_BYTES
    assert all(len(w.samples) <= answer_samples.MAX_PER_WINDOW for w in windows)
    assert max(len(w.samples) for w in windows) == answer_samples.MAX_PER_WINDOW
    assert samples.held_bytes("ep") == 0        # taken: a new window holds nothing


def test_the_router_keeps_what_the_replica_committed_to_or_that_it_committed_to_nothing():
    """Every answer of a fingerprinting replica must carry its token ids and fingerprints
    (the replica cannot know which are sampled); one without them is kept as such."""
    def committing(request: dict) -> list[dict]:
        return [{"text": "a"}, {"done": True, "finish_reason": "stop", "prompt_tokens": 2,
                                "output_tokens": 2, "token_ids": [5, 6],
                                "fingerprints": ["AAAAAA=="]}]

    def silent(request: dict) -> list[dict]:
        return [{"text": "a"}, {"done": True, "finish_reason": "stop", "prompt_tokens": 2,
                                "output_tokens": 2}]

    async def main(answer_fn) -> list:
        sessions = {"p1": AnsweringSession("p1", answer_fn)}
        serving, ep = router(sessions)
        serving.samples.rate = 1.0
        ready(serving, "p1", "ep-r1")
        serving.sync([LiveEndpoint("ep", "c1", "tiny", ep.settings, replicas=(
            LiveReplica("ep-r1", 1, pb.JOB_STATE_RUNNING, epoch=1, provider_id="p1",
                        accelerator=pb.ACCELERATOR_CPU),))])
        assert ep.replicas["ep-r1"].fingerprinted
        for n in range(3):
            await collect(serving.run(ep, Complete(prompt=f"q{n}", max_tokens=4)))
        return serving.samples.take()

    (window,) = asyncio.run(main(committing))
    assert window.answers == 3 and len(window.samples) == 3
    assert window.samples[0]["request"]["prompt"] == "q0"
    assert window.samples[0]["token_ids"] == [5, 6]
    (window,) = asyncio.run(main(silent))
    assert [s["fingerprints"] for s in window.samples] == [None] * 3


def test_which_replicas_must_fingerprint_their_answers():
    from gpumarket.kinds.endpoint import fingerprinted, tokens_only

    cpu, cuda = pb.ACCELERATOR_CPU, pb.ACCELERATOR_CUDA
    generate = {"task": "generate", "engine": ""}
    # every generate replica, whatever its engine: none goes unsampled
    for engine in ("", "auto", "batch", "continuous", "vllm"):
        for accelerator in (cpu, cuda):
            assert fingerprinted({**generate, "engine": engine}, accelerator)
    assert not fingerprinted({"task": "embed", "engine": ""}, cpu)
    # vLLM's answers commit to their token ids alone; the batch and continuous engines'
    # carry fingerprints
    assert tokens_only({**generate, "engine": "vllm"}, cuda, "vllm (AsyncLLM) on 1 GPU(s)")
    assert not tokens_only(generate, cuda, "continuous (transformers continuous batching)")
    # the batch engine's fallback is sampled all the same, judged by its tokens; only a
    # replica that runs the batch engine is believed when it says so
    fallback = ("batch (one transformers generate call at a time: its cache is not made of"
                " plain full-attention layers) on cpu")
    assert fingerprinted(generate, cpu, fallback)
    assert tokens_only(generate, cpu, fallback)
    assert tokens_only({**generate, "engine": "batch"}, cuda, fallback)
    assert not tokens_only(generate, cpu, "batch (step-wise decode) on cpu")
    assert not tokens_only(generate, cuda, fallback)                  # auto on CUDA: continuous
    assert not tokens_only({**generate, "engine": "continuous"}, cpu, fallback)
    assert not tokens_only(generate, cuda, "vllm (AsyncLLM) on 1 GPU(s)")   # not the spec's


def test_the_router_samples_continuous_and_vllm_replicas_vllm_s_by_their_tokens():
    """A CUDA replica of the continuous engine (auto) and a vLLM one are sampled; the vLLM
    one's answers are kept as committing to their token ids alone (judged by the token gap,
    tests/test_answer_checks.py), whatever its replica says of its engine."""
    def tokens(request: dict) -> list[dict]:
        return [{"text": "a"}, {"done": True, "finish_reason": "stop", "prompt_tokens": 2,
                                "output_tokens": 2, "token_ids": [5, 6]}]

    async def main(engine: str) -> list:
        sessions = {"p1": AnsweringSession("p1", tokens)}
        serving, ep = router(sessions, engine=engine)
        serving.samples.rate = 1.0
        ready(serving, "p1", "ep-r1")
        serving.sync([LiveEndpoint("ep", "c1", "tiny", ep.settings, replicas=(
            LiveReplica("ep-r1", 1, pb.JOB_STATE_RUNNING, epoch=1, provider_id="p1",
                        accelerator=pb.ACCELERATOR_CUDA),))])
        replica = ep.replicas["ep-r1"]
        assert replica.fingerprinted and replica.tokens_only == (engine == "vllm")
        for n in range(2):
            await collect(serving.run(ep, Complete(prompt=f"q{n}", max_tokens=4)))
        return serving.samples.take()

    for engine in ("", "continuous", "vllm"):
        (window,) = asyncio.run(main(engine))
        assert len(window.samples) == 2 and window.samples[0]["token_ids"] == [5, 6]
        assert all(s.get("tokens_only", False) == (engine == "vllm") for s in window.samples)
