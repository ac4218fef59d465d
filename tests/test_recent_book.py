"""The Book the submissions size their holds from (scheduler.recent_book, issue 36): built
once for submissions in a row, built again once an offer came, went or changed, or once the
last is older than the bound — and a placement pass always builds its own."""

from __future__ import annotations

import asyncio

from gpumarket.broker.api.sessions import Sessions
from gpumarket.broker.jobs import views
from gpumarket.broker.money import credit_holds
from gpumarket.broker.jobs import submit
from gpumarket.broker.market import scheduler
from gpumarket.broker.market.admission import Needs
from gpumarket.broker.market.reliability import ProviderHistory
from gpumarket.proto.v1 import types_pb2 as pb


class Store:
    """What offer_book reads, empty; counts the Books built (one stakes read each)."""

    def __init__(self) -> None:
        self.builds = 0

    async def read(self, fn, *args):
        if fn is views.stakes:
            self.builds += 1
        if fn is credit_holds.timed:            # the offers a hold is sized from
            return []
        if fn is views.histories:               # a new provider's record
            return {p: ProviderHistory(0.0, 0, 0) for p in args[0]}
        return {}


class State:
    def __init__(self) -> None:
        self.sessions = Sessions()
        self.store = Store()

    async def busy_devices(self) -> dict:
        return {}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def offer(provider_id: str, price: float = 1.0) -> pb.Offer:
    device = pb.Device(index=0, name="test CPU", accelerator=pb.ACCELERATOR_CPU,
                       memory_bytes=16 << 30, cpu_cores=8,
                       benchmark=pb.Benchmark(matmul_flops=1e11, matmul_dtype="fp32"))
    return pb.Offer(provider_id=provider_id, devices=[device], price_per_gpu_hour=price,
                    kinds=[pb.JOB_KIND_TRAINING], engines=["transformers"])


def connect(state: State, provider_id: str):
    session = state.sessions.open(provider_id)
    session.offer = offer(provider_id)
    return session


def recent(state: State, clock: Clock):
    return asyncio.run(scheduler.recent_book(state, 1.0, clock))


def test_submissions_in_a_row_share_one_book():
    state, clock = State(), Clock()
    for p in ("a", "b"):
        connect(state, p)
    first = recent(state, clock)
    clock.t += 0.5
    assert recent(state, clock) is first
    assert state.store.builds == 1
    assert sorted(first.index) == ["a", "b"]


def test_two_submissions_holds_build_one_book():
    state = State()
    connect(state, "a")
    needs = Needs(kind=pb.JOB_KIND_TRAINING, gpus=1, min_memory_bytes=0,
                  accelerator=pb.ACCELERATOR_UNSPECIFIED, max_price_per_gpu_hour=1.0)

    async def two() -> None:
        for _ in range(2):
            await submit.hold(state, needs, "c", 1, 0.0)

    asyncio.run(two())
    assert state.store.builds == 1


def test_a_session_opening_or_closing_builds_again():
    state, clock = State(), Clock()
    a = connect(state, "a")
    first = recent(state, clock)
    connect(state, "b")                         # a session opened
    second = recent(state, clock)
    assert second is not first and sorted(second.index) == ["a", "b"]
    state.sessions.close(a)                     # one closed
    third = recent(state, clock)
    assert third is not second and sorted(third.index) == ["b"]
    assert state.store.builds == 3


def test_an_offer_replaced_or_drained_builds_again():
    state, clock = State(), Clock()
    a = connect(state, "a")
    first = recent(state, clock)
    a.offer = offer("a", price=2.0)             # advertised again, another price
    second = recent(state, clock)
    assert second is not first and second.offers[0].price_per_gpu_hour == 2.0
    a.offer = None                              # draining
    assert recent(state, clock).offers == []
    assert state.store.builds == 3


def test_a_book_past_the_bound_is_not_reused():
    state, clock = State(), Clock()
    connect(state, "a")
    first = recent(state, clock)
    clock.t += 0.999
    assert recent(state, clock) is first
    clock.t += 0.002                            # 1.001 s after it was built
    assert recent(state, clock) is not first
    assert state.store.builds == 2


def test_a_placement_pass_builds_its_own_and_leaves_it_for_the_submissions():
    state, clock = State(), Clock()
    connect(state, "a")
    first = recent(state, clock)
    placed = asyncio.run(scheduler.offer_book(state, clock))   # what place_queued calls
    assert placed is not first and state.store.builds == 2
    assert recent(state, clock) is placed
