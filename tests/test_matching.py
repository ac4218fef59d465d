"""Matching: hard constraints never violated, the chosen offer optimal for the objective,
fairness, spreading, reliability and VRAM estimates (domain units and property tests)."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from datetime import datetime, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumarket.broker.market import admission
from gpumarket.broker.market import matcher
from gpumarket.broker.market import reliability
from gpumarket.broker.market.matcher import Book, JobNeeds, OfferView, Policy, Window
from gpumarket.broker.market.placement import fair_order
from gpumarket.proto.v1 import types_pb2 as pb

CPU, CUDA, ANY = pb.ACCELERATOR_CPU, pb.ACCELERATOR_CUDA, pb.ACCELERATOR_UNSPECIFIED
TRAIN, GEN = pb.JOB_KIND_TRAINING, pb.JOB_KIND_GENERATE
GiB = 2**30
NOON = datetime(2026, 11, 23, 12, 0, tzinfo=timezone.utc)  # a Monday


def offer(pid, price=1.0, n=1, mem=80 * GiB, accel=CUDA, flops=1e14, rel=0.9, mtbf=86400.0,
          cc=9.0, name="NVIDIA H100", busy=(), kinds=(TRAIN,), policy=Policy(), load=0,
          stake=0):
    return OfferView(pid, price, frozenset(kinds), tuple(range(n)), accel, mem, cc, name, flops,
                     rel, mtbf, policy, frozenset(busy), load, stake=stake)


def need(gpus=1, mem=0, accel=ANY, price=10.0, objective="cheapest", **kw):
    return JobNeeds("j", kw.pop("kind", TRAIN), gpus, mem, accel, price, objective=objective,
                    **kw)


def test_every_constraint_excludes_and_is_explained():
    offers = [
        offer("expensive", price=9.0, n=8),
        offer("small", n=2, mem=16 * GiB),
        offer("cpu", price=0.1, accel=CPU, cc=0.0, name="AMD EPYC", n=4),
        offer("busy", n=2, busy={0}),
        offer("old", n=2, cc=7.0, name="Tesla V100"),
        offer("flaky", n=2, rel=0.3),
        offer("fits", price=2.0, n=3),
    ]
    book = Book(offers, NOON)
    job = need(2, 40 * GiB, CUDA, 5.0, min_compute_capability=8.0, min_reliability=0.5)
    placed, _ = book.place(job)
    assert placed.provider_id == "fits" and placed.device_indices == (0, 1)
    assert book.exclusions(job) == {"price": 1, "memory": 1, "accelerator": 1,
                                    "compute_capability": 1, "reliability": 1, "busy": 2}
    text = matcher.explain(book.exclusions(job), len(book))
    assert text.startswith("waiting: of 7 offers, 2 are busy with other jobs")
    assert matcher.explain({}, 0) == "waiting: no provider is online"


def test_an_array_is_spread_over_the_devices_that_fit_it_busy_or_not():
    """Book.lanes: the leases of a job's shape the fitting offers could run at once."""
    from gpumarket.kinds import arrays

    offers = [offer("a", n=3, busy={0, 1, 2}), offer("b", n=2), offer("c", n=5, mem=8 * GiB),
              offer("d", n=4, accel=CPU, cc=0.0, name="CPU")]
    book = Book(offers, NOON)
    assert book.lanes(need(1, 40 * GiB, CUDA)) == 5          # a (busy) and b; not c, d
    assert book.lanes(need(2, 40 * GiB, CUDA)) == 2          # a: one pair, b: one
    assert book.lanes(need(1, 0, ANY)) == 14
    assert book.lanes(need(1, 0, ANY, kind=GEN)) == 0        # nobody runs the kind
    spec = pb.JobSpec(array=pb.JobArray(count=100))
    assert arrays.per_lease(spec, 4) == 25                    # one lease per device
    assert arrays.per_lease(spec, 0) == 13                    # none fit yet: eight leases
    assert arrays.per_lease(spec, 1000) == 1
    assert arrays.per_lease(pb.JobSpec(array=pb.JobArray(count=100, per_lease=7)), 4) == 7
    assert arrays.per_lease(pb.JobSpec(array=pb.JobArray(count=10**6)), 2) == 1000


def test_policy_hours_duration_and_models():
    weekdays = frozenset(range(5))
    night = Window(weekdays, 20 * 60, 6 * 60)   # 20:00-06:00 UTC, wraps midnight
    offers = [
        offer("night", policy=Policy(windows=(night,))),
        offer("denies", policy=Policy(denied_clients=frozenset({"alice"}))),
        offer("only-bob", policy=Policy(allowed_clients=frozenset({"bob"}))),
        offer("short", policy=Policy(max_job_s=600)),
        offer("a100", name="NVIDIA A100-SXM4-80GB", price=0.5),
    ]
    job = need(client_id="alice", max_runtime_s=3600, gpu_models=frozenset({"H100"}))
    book = Book(offers, NOON)
    assert book.best(job) is None
    assert book.exclusions(job) == {"hours": 1, "policy": 2, "duration": 1, "gpu_model": 1}
    assert Book(offers, datetime(2026, 11, 24, 2, 0, tzinfo=timezone.utc)).offers[0] \
        .policy.available(datetime(2026, 11, 24, 2, 0, tzinfo=timezone.utc))  # Tue 02:00
    assert not night.contains(datetime(2026, 11, 23, 2, 0, tzinfo=timezone.utc))  # Mon 02:00
    placed, _ = Book(offers, NOON).place(need(client_id="bob", gpu_models=frozenset({"a100"})))
    assert placed.provider_id == "a100"


def test_objectives_pick_different_offers():
    offers = [
        offer("cheap-slow", price=0.5, flops=1e13, rel=0.7),
        offer("pricey-fast", price=4.0, flops=2e14, rel=0.8),
        offer("steady", price=3.0, flops=1e14, rel=0.99, mtbf=30 * 86400),
    ]
    work = 1e18  # ~28 h on the slow one, ~1.4 h on the fast one
    pick = {o: Book(offers, NOON).best(need(objective=o, work_flops=work, deadline_s=3 * 3600))
            for o in matcher.OBJECTIVES}
    assert offers[pick["cheapest"]].provider_id == "pricey-fast"  # fast enough to be cheapest
    assert offers[pick["fastest"]].provider_id == "pricey-fast"
    assert offers[pick["reliable"]].provider_id == "steady"
    cheap_work = 1e16
    assert offers[Book(offers, NOON).best(need(work_flops=cheap_work))].provider_id in {
        "cheap-slow", "pricey-fast"}
    # deadline: the cheapest that finishes in time
    job = need(objective="deadline", work_flops=work, deadline_s=2 * 3600)
    assert offers[Book(offers, NOON).best(job)].provider_id == "pricey-fast"
    too_soon = need(objective="deadline", work_flops=work, deadline_s=600)
    book = Book(offers, NOON)
    assert book.best(too_soon) is None and book.exclusions(too_soon) == {"deadline": 3}


def test_equivalent_offers_spread_the_work():
    offers = [offer(f"p{i}", n=1) for i in range(4)]
    book = Book(offers, NOON)
    chosen = [book.place(need())[0].provider_id for _ in range(4)]
    assert sorted(chosen) == ["p0", "p1", "p2", "p3"]
    assert book.place(need())[0] is None


def test_a_lost_job_goes_elsewhere_first():
    offers = [offer("a", price=1.0), offer("b", price=1.5)]
    assert offers[Book(offers, NOON).best(need(avoid=frozenset({"a"})))].provider_id == "b"
    only = [offer("a")]
    assert Book(only, NOON).best(need(avoid=frozenset({"a"}))) == 0  # last resort


def test_a_named_model_needs_a_holder_and_a_warm_cache_is_preferred():
    import dataclasses

    sha = "ab" * 32
    cold = offer("cold", price=1.0, kinds=(GEN,))
    warm = dataclasses.replace(offer("warm", price=1.05, kinds=(GEN,)), cached=frozenset({sha}),
                               models=frozenset({"minilm"}))
    dear = dataclasses.replace(warm, provider_id="dear", price_per_gpu_hour=1.5)
    job = need(kind=GEN, work_flops=1e15, warm_sha256=sha)
    # 5 % dearer but holding the model's archive: preferred; 50 % dearer: not
    assert Book([cold, warm], NOON).offers[Book([cold, warm], NOON).best(job)].provider_id == "warm"
    assert Book([cold, dear], NOON).offers[Book([cold, dear], NOON).best(job)].provider_id == "cold"
    assert Book([cold, warm], NOON).offers[
        Book([cold, warm], NOON).best(need(kind=GEN, work_flops=1e15))].provider_id == "cold"
    named = need(kind=GEN, model_name="minilm")
    book = Book([cold, warm], NOON)
    assert book.offers[book.best(named)].provider_id == "warm"
    assert matcher.exclusion(named, cold, NOON) == "kind"
    none = Book([cold], NOON)
    assert none.best(named) is None
    assert "local model" in matcher.explain(none.exclusions(named), 1)
    willing = dataclasses.replace(cold, provider_id="willing",
                                  policy=Policy(allow_remote_code=True))
    code = need(kind=GEN, remote_code=True)
    assert matcher.exclusion(code, cold, NOON) == "kind"
    book = Book([cold, willing], NOON)
    assert book.offers[book.best(code)].provider_id == "willing"


def test_fair_order_interleaves_clients():
    rows = [{"id": f"a{i}", "client_id": "alice", "created_at_ms": i} for i in range(1000)]
    rows.append({"id": "b0", "client_id": "bob", "created_at_ms": 5000})
    order = [r["id"] for r in fair_order(rows, {"alice": 3})]
    assert order[0] == "b0"  # bob has nothing running
    order = [r["id"] for r in fair_order(rows, {})]
    assert order.index("b0") == 1


# -- property tests --------------------------------------------------------------------------

offers_st = st.lists(st.builds(
    offer,
    pid=st.uuids().map(str),
    price=st.floats(0.05, 10),
    n=st.integers(1, 8),
    mem=st.sampled_from([8, 16, 24, 40, 80, 141]).map(lambda g: g * GiB),
    accel=st.sampled_from([CPU, CUDA]),
    flops=st.floats(1e11, 1e15),
    rel=st.floats(0, 1),
    mtbf=st.floats(600, 1e7),
    cc=st.sampled_from([0.0, 7.0, 8.0, 8.6, 9.0]),
    name=st.sampled_from(["NVIDIA H100", "NVIDIA A100", "RTX 4090", "AMD EPYC"]),
    busy=st.sets(st.integers(0, 7), max_size=4),
    kinds=st.sets(st.sampled_from([TRAIN, GEN]), min_size=1),
    policy=st.sampled_from([Policy(), Policy(max_job_s=3600),
                            Policy(denied_clients=frozenset({"c1"})),
                            Policy(windows=(Window(frozenset({0}), 0, 600),))]),
    load=st.integers(0, 5),
), max_size=30)

jobs_st = st.builds(
    need,
    gpus=st.integers(1, 4),
    mem=st.sampled_from([0, 16, 40, 80]).map(lambda g: g * GiB),
    accel=st.sampled_from([ANY, CPU, CUDA]),
    price=st.floats(0.1, 10),
    objective=st.sampled_from(matcher.OBJECTIVES),
    client_id=st.sampled_from(["c1", "c2"]),
    min_compute_capability=st.sampled_from([0.0, 8.0]),
    gpu_models=st.sampled_from([frozenset(), frozenset({"H100", "A100"})]),
    min_reliability=st.floats(0, 1),
    work_flops=st.floats(0, 1e19),
    deadline_s=st.floats(60, 1e6),
    max_runtime_s=st.sampled_from([0.0, 7200.0]),
    kind=st.sampled_from([TRAIN, GEN]),
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(offers_st, jobs_st)
def test_placements_never_break_a_hard_constraint_and_are_optimal(offers, job):
    book = Book(offers, NOON)
    i = book.best(job)
    feasible = [o for o in offers if matcher.exclusion(job, o, NOON) is None]
    if i is None:
        assert feasible == []
        return
    chosen = offers[i]
    assert matcher.exclusion(job, chosen, NOON) is None
    assert len(chosen.free) >= job.gpus and chosen.device_memory_bytes >= job.min_memory_bytes
    assert chosen.price_per_gpu_hour <= job.max_price_per_gpu_hour
    key = matcher.objective_key(job, matcher.expected(job, chosen))[0]
    best = min(matcher.objective_key(job, matcher.expected(job, o))[0] for o in feasible)
    assert key <= best + abs(best) * matcher.EQUIVALENT * 1.01 + 1e-12


@settings(max_examples=100, deadline=None)
@given(offers_st, jobs_st)
def test_exclusion_counts_add_up(offers, job):
    book = Book(offers, NOON)
    excluded = book.exclusions(job)
    feasible = sum(1 for o in offers if matcher.exclusion(job, o, NOON) is None)
    assert sum(excluded.values()) + feasible == len(offers)
    for o in offers:
        reason = matcher.exclusion(job, o, NOON)
        assert reason is None or excluded[reason] >= 1


# -- reliability -----------------------------------------------------------------------------

def history(uptime=0.0, lost=0, done=0, window=0.0, span=0.0, age=0.0):
    return reliability.ProviderHistory(uptime, lost, done, window, span, age)


def test_new_providers_start_below_established_ones():
    new = reliability.score(history())
    established = reliability.score(history(30 * 86400, 0, 100, 7 * 86400 * 0.99, 7 * 86400,
                                            30 * 86400))
    assert new < 0.3 < 0.9 < established <= 1.0


def test_trust_is_slow_to_earn_and_fast_to_lose():
    week = 7 * 86400
    base = dict(uptime=week, window=week, span=week, age=week)
    scores = [reliability.score(history(**base, done=n)) for n in (0, 1, 5, 20, 100)]
    assert scores == sorted(scores)
    after = reliability.score(history(**base, done=20))
    gain = reliability.score(history(**base, done=21)) - after
    one_loss = reliability.score(history(**base, done=20, lost=1))
    assert after - one_loss > 10 * gain  # one loss undoes more than ten successes earn
    flaky = reliability.score(history(uptime=week * 0.3, window=week * 0.3, span=week, age=week,
                                      done=20))
    assert flaky < after
    assert reliability.mtbf_s(history(uptime=3600 * 99, lost=0)) > \
        reliability.mtbf_s(history(uptime=3600 * 99, lost=4))


def test_expected_time_grows_with_failures():
    fast_fail = reliability.expected_time_s(3600, 600, 1.0)
    rare_fail = reliability.expected_time_s(3600, 10**6, 1.0)
    assert fast_fail > rare_fail > 3600
    assert reliability.p_uninterrupted(3600, 3600) == pytest.approx(math.exp(-1))


# -- VRAM --------------------------------------------------------------------------------------

LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
             "vocab_size": 32000}
LLAMA2_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
              "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
              "vocab_size": 32000}
GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
        "tie_word_embeddings": True}


def test_parameter_counts_of_known_models():
    assert admission.model_shape(LLAMA2_7B).params == pytest.approx(6.74e9, rel=0.01)
    assert admission.model_shape(LLAMA2_70B).params == pytest.approx(69.0e9, rel=0.01)
    assert admission.model_shape(GPT2).params == pytest.approx(124e6, rel=0.02)


def test_weight_memory_of_known_models():
    gb = 1e9
    assert admission.weights_bytes(admission.model_shape(LLAMA2_7B), "bf16") / gb == \
        pytest.approx(13.5, abs=0.6)     # "about 14 GB"
    assert admission.weights_bytes(admission.model_shape(LLAMA2_70B), "int4") / gb == \
        pytest.approx(34.5, abs=1.0)     # "about 35 GB"
    assert admission.weights_bytes(admission.model_shape(LLAMA2_7B), "fp32") == \
        2 * admission.weights_bytes(admission.model_shape(LLAMA2_7B), "bf16")


def test_kv_cache_and_training_memory():
    s7 = admission.model_shape(LLAMA2_7B)
    # 2 x 32 layers x 32 heads x 128 x 2 bytes x 4096 tokens = 2 GiB per sequence
    assert admission.kv_cache_bytes(s7, 4096, 1) == 2 * 2**30
    s70 = admission.model_shape(LLAMA2_70B)  # grouped-query attention: 8 KV heads
    assert admission.kv_cache_bytes(s70, 4096, 1) == 2 * 80 * 8 * 128 * 2 * 4096
    inference = admission.inference_bytes(s7, "bf16", 4096, 8)
    assert 13.5e9 + 16 * 2**30 < inference < 35e9
    training = admission.training_bytes(s7, "bf16", 1, 2048)
    assert training > 16 * s7.params  # weights, grads, AdamW moments, fp32 master copy
    with pytest.raises(Exception, match="dtype"):
        admission.weights_bytes(s7, "fp6")
    with pytest.raises(Exception, match="hidden_size"):
        admission.model_shape({"vocab_size": 10})


def test_a_checker_is_drawn_by_stake_and_record_not_price():
    """Issue 34: a spot check's provider is drawn in proportion to (stake + 1) × reliability
    among those that fit; the cheapest offer gets no more of the checks for being cheap."""
    offers = [offer("cheap-unstaked", price=0.01, rel=0.9),
              offer("staked", price=5.0, rel=0.9, stake=3_000_000),
              offer("staked-unreliable", price=5.0, rel=0.3, stake=3_000_000),
              offer("excluded", price=5.0, rel=0.9, stake=10**9)]
    book = Book(offers, NOON)
    job = need(exclude=frozenset({"excluded"}))
    picks = Counter(offers[book.best(dataclasses.replace(job, draw=k / 10_000))].provider_id
                    for k in range(10_000))
    weights = {"cheap-unstaked": 1 * 0.9, "staked": 3_000_001 * 0.9,
               "staked-unreliable": 3_000_001 * 0.3}
    total = sum(weights.values())
    for pid, w in weights.items():
        assert abs(picks[pid] / 10_000 - w / total) < 0.002, picks
    assert "excluded" not in picks
    assert offers[book.best(job)].provider_id == "cheap-unstaked"   # a job: the cheapest
