"""Tiers and preemption through a checkpoint, as plain code and on a real SQLite file: the
price a tier pays, which leases a higher tier may take, PREEMPTED (neither lost nor failed,
no attempt used), the money of a preemption, and the attacks on it (docs/broker.md,
Preemption; docs/ledger.md)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest
from gpumarket import kinds
from gpumarket.broker.jobs import preemption as rows
from gpumarket.broker.jobs import endings
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs.job import LeaseTerms
from gpumarket.broker.jobs import views
from gpumarket.broker.market import matcher, preemption
from gpumarket.broker.market.matcher import Book, JobNeeds, OfferView
from gpumarket.broker.market.offers import interruptible_price, offer_price
from gpumarket.broker.money import ledger
from gpumarket.broker.store.store import Store
from gpumarket.kinds.base import Kind
from gpumarket.proto.errors import FailedPrecondition, InvalidArgument
from gpumarket.proto.jobspec import check_common
from gpumarket.proto.money import offer_prices
from gpumarket.proto.v1 import types_pb2 as pb

from tests.test_ledger import World, artifact, new_job, sign

TRAIN = pb.JOB_KIND_TRAINING
ANY = pb.ACCELERATOR_UNSPECIFIED


def offer(pid: str = "p1", price: float = 1.0, interruptible: float | None = 0.4,
          devices: int = 1, busy: frozenset[int] = frozenset()) -> OfferView:
    return OfferView(pid, price, frozenset({TRAIN}), tuple(range(devices)), pb.ACCELERATOR_CPU,
                     2**34, flops=1e12, reliability=0.9, busy=busy,
                     interruptible_price_per_gpu_hour=interruptible)


def needs(job_id: str = "s", tier: str = "standard", max_price: float = 5.0,
          gpus: int = 1) -> JobNeeds:
    return JobNeeds(job_id=job_id, kind=TRAIN, gpus=gpus, min_memory_bytes=0, accelerator=ANY,
                    max_price_per_gpu_hour=max_price, work_flops=1e15, tier=tier)


# -- prices ---------------------------------------------------------------------------------

def test_a_job_pays_its_tiers_price_and_max_price_is_compared_with_that():
    book = Book([offer("p1", 1.0, 0.4)])
    cheap = needs("i", "interruptible", max_price=0.5)
    placed, _ = book.place(cheap)
    assert placed.price_per_gpu_hour == pytest.approx(0.4)
    assert matcher.expected(cheap, book.offers[0]).price_per_gpu_hour == pytest.approx(0.4)
    # The same max_price at the standard tier: the offer asks more than it.
    book = Book([offer("p1", 1.0, 0.4)])
    placed, excluded = book.place(needs("s", "standard", max_price=0.5))
    assert placed is None and excluded == {"price": 1}
    assert matcher.exclusion(needs("s", max_price=0.5), book.offers[0]) == "price"
    # Serving pays the standard price.
    placed, _ = Book([offer("p1", 1.0, 0.4)]).place(needs("r", "serving"))
    assert placed.price_per_gpu_hour == 1.0


def test_an_offers_tier_prices_as_signed():
    o = pb.Offer(price_per_gpu_hour=1.0, interruptible_price_per_gpu_hour=0.4,
                 devices=[pb.Device(index=0), pb.Device(index=1, price_per_hour=2.0)])
    # A device's own price is discounted by the offer's interruptible share.
    assert offer_prices(o) == (2.0, pytest.approx(0.8))
    assert (offer_price(o), interruptible_price(o)) == (2.0, pytest.approx(0.8))
    # An older provider (no interruptible price) sells interruptible at its standard price;
    # one asking more than standard for it is held to standard.
    assert offer_prices(pb.Offer(price_per_gpu_hour=1.0)) == (1.0, 1.0)
    assert offer_prices(pb.Offer(price_per_gpu_hour=1.0,
                                 interruptible_price_per_gpu_hour=3.0)) == (1.0, 1.0)
    assert offer("p", 1.0, 3.0).price("interruptible") == 1.0


# -- who may take which device ----------------------------------------------------------------

def held(lease_id: str, provider: str = "p1", devices=(0,), unsaved_ms: int = 0,
         preempt_for: str = "") -> rows.Interruptible:
    return rows.Interruptible(lease_id, lease_id.split(".")[0], 1, provider, tuple(devices),
                              unsaved_ms, preempt_for)


def test_a_device_an_interruptible_lease_holds_goes_only_to_a_higher_tier():
    book = Book([offer("p1", busy=frozenset({0}))])
    leases = [held("a.1")]
    assert preemption.choose(book, needs("s", "standard"), leases) == leases
    assert preemption.choose(book, needs("r", "serving"), leases) == leases
    assert preemption.choose(book, needs("i", "interruptible"), leases) == []
    # Not for a job the offer would not take anyway (its price), nor twice.
    assert preemption.choose(book, needs("s", max_price=0.5), leases) == []
    assert preemption.choose(book, needs("s"), [held("a.1", preempt_for="x")]) == []


def test_the_fewest_leases_losing_the_least_work_yield():
    book = Book([offer("p1", devices=2, busy=frozenset({0, 1})),
                 offer("p2", devices=2, busy=frozenset({0, 1}))])
    leases = [held("a.1", "p1", (0,), 5_000), held("b.1", "p1", (1,), 1_000),
              held("c.1", "p2", (0, 1), 9_000)]
    assert preemption.choose(book, needs("s"), leases) == [leases[1]]
    # Two devices: one lease of two devices beats two of one.
    assert preemption.choose(book, needs("s", gpus=2), leases) == [leases[2]]


def sliced(pid: str = "p1", busy=frozenset({1, 2})) -> list[OfferView]:
    """A provider offering card 0 whole and as two slices (1 and 2): its two views, as
    offers.offer_views makes them."""
    cards = ((0, None), (1, 0), (2, 0))
    whole = dataclasses.replace(offer(pid), cards=cards, busy=frozenset(busy))
    half = dataclasses.replace(whole, device_indices=(1, 2), price_per_gpu_hour=0.5,
                               interruptible_price_per_gpu_hour=0.2,
                               device_memory_bytes=2**33, flops=5e11, slices=True)
    return [whole, half]


def test_a_whole_card_frees_every_slice_lease_of_it_in_one_pass():
    """Fixed: preemption read the whole-device view's free count, so a whole-card job
    waiting on a card two slice leases hold freed one of them per pass (the card stayed
    busy through the other)."""
    leases = [held("a.1", devices=(1,), unsaved_ms=5_000),
              held("b.1", devices=(2,), unsaved_ms=1_000)]
    whole = dataclasses.replace(needs("s"), min_memory_bytes=2**34)   # more than a slice
    chosen = preemption.choose(Book(sliced()), whole, leases)
    assert sorted(x.lease_id for x in chosen) == ["a.1", "b.1"]
    # A slice is enough: one slice lease yields, the one losing the least work.
    assert preemption.choose(Book(sliced()), needs("s"), leases) == [leases[1]]
    # A slice job where the card is leased whole: that lease yields.
    card = [held("c.1", devices=(0,), unsaved_ms=9_000)]
    assert preemption.choose(Book(sliced(busy={0})), needs("s"), card) == card
    # One slice held by a standard lease (not in the list): the card cannot be freed, the
    # other slice can.
    only = [leases[0]]
    assert preemption.choose(Book(sliced()), whole, only) == []
    assert preemption.choose(Book(sliced()), needs("s"), only) == only


# -- PREEMPTED on the broker's store -----------------------------------------------------------

@pytest.fixture
def w(tmp_path):
    world = World(tmp_path / "broker.db")
    world.write(ledger.credit, "ca", 10**8, "client", "", "op", "k", 1)
    return world


def submit(w: World, job_id: str, tier: str, max_attempts: int = 5) -> None:
    job = new_job(job_id, "ca", 20_000_000, True)
    job = dataclasses.replace(job, needs=dataclasses.replace(job.needs, tier=tier),
                              max_attempts=max_attempts)
    w.write(jobs.submit, job, w.now)


def run_on(w: World, job_id: str, provider: str, price: float) -> int:
    w.now += 1000
    w.write(jobs.create_lease, LeaseTerms(job_id, provider, (0,), price, 60_000, 10), w.now, sign)
    epoch = w.job(job_id)["epoch"]
    w.write(jobs.mark_started, job_id, epoch, provider, w.now)
    return epoch


def checkpoint(w: World, job_id: str, provider: str, step: int) -> None:
    ref = artifact(w.db, provider, step, w.now)
    w.write(jobs.record_checkpoint, job_id, w.job(job_id)["epoch"], provider, step, ref, 0.1,
            w.now)


def preempt(w: World, job_id: str, for_job: str = "s") -> jobs.EndedLease | None:
    return w.write(rows.preempt, w.job(job_id)["lease_id"], for_job, "standard", 60, w.now)


def test_preempted_is_neither_lost_nor_failed_nor_an_attempt(w):
    submit(w, "i", "interruptible", max_attempts=1)
    for round_ in range(3):     # preempted again and again: never out of attempts
        epoch = run_on(w, "i", "p1", 0.4)
        w.now += 60_000
        assert preempt(w, "i") == jobs.EndedLease("i", epoch, "p1")
        assert preempt(w, "i") is None                  # asked once
        w.write(rows.release, "i", epoch, "p1", "preempted by a standard job", w.now)
        job = w.job("i")
        assert (job["state"], job["attempt"]) == (pb.JOB_STATE_QUEUED, 1)
    states = [r[0] for r in w.db.execute("SELECT state FROM leases WHERE job_id = 'i'")]
    assert states == ["preempted"] * 3
    history = views.provider_history(w.db, "p1", w.now)
    assert (history.leases_lost, history.leases_failed) == (0, 0)
    assert views.previous_providers(w.db, "i") == set()    # nothing to avoid p1 for
    job = views.get_job(w.db, "i")
    assert [a.outcome for a in job.attempts] == ["preempted"] * 3


def test_a_standard_lease_is_never_preempted(w):
    submit(w, "s", "standard")
    run_on(w, "s", "p1", 1.0)
    assert rows.interruptible_leases(w.db, w.now) == []
    with pytest.raises(FailedPrecondition, match="not interruptible"):
        preempt(w, "s", "other")


def test_a_provider_cannot_pass_its_own_release_or_failure_off_as_a_preemption(w):
    """Only the broker marks a preemption: a release it did not ask for stays ``released``
    (the provider's record), a failure ``failed``."""
    submit(w, "i", "interruptible")
    epoch = run_on(w, "i", "p1", 0.4)
    w.write(rows.release, "i", epoch, "p1", "preempted", w.now)
    epoch = run_on(w, "i", "p2", 0.4)
    w.write(lambda db: endings.fail(db, "i", epoch, "p2", "preempted", w.now))
    assert [r[0] for r in w.db.execute("SELECT state FROM leases ORDER BY epoch")] == \
        ["released", "failed"]
    assert w.job("i")["attempt"] == 3


def test_the_preempted_job_pays_to_its_checkpoint_and_nothing_for_the_lost_interval(w):
    submit(w, "i", "interruptible")
    epoch = run_on(w, "i", "p1", 0.4)
    w.now += 3_600_000                       # an hour to its checkpoint at step 10
    checkpoint(w, "i", "p1", 10)
    paid = ledger.job_money(w.db, "i")["charged"]
    assert paid == ledger.units(0.4)         # an hour at the interruptible price
    w.now += 10_000
    preempt(w, "i")
    w.now += 20 * 60_000                     # 20 minutes more before it stopped: lost work
    w.write(rows.release, "i", epoch, "p1", "preempted by a standard job", w.now)
    assert ledger.job_money(w.db, "i")["charged"] == paid
    earned = ledger.balance(w.db, ledger.provider("p1"))
    assert earned == paid - paid * 50_000 // 1_000_000     # the hour, less the market's fee
    # It resumes from step 10 on another provider; its next lease pays from its start.
    assert w.job("i")["checkpoint_step"] == 10
    run_on(w, "i", "p2", 0.4)
    w.now += 1_800_000
    checkpoint(w, "i", "p2", 20)
    assert ledger.job_money(w.db, "i")["charged"] == paid + ledger.units(0.2)
    assert ledger.audit(w.db) == []


def test_a_lease_that_does_not_yield_in_its_grace_ends_preempted_all_the_same(tmp_path):
    """A job ignoring the request (or its provider ignoring the broker) keeps the device no
    longer than the grace period and the lease timeout: a client cannot buy the
    interruptible price and keep the device."""
    store = Store(tmp_path / "broker.db")
    store.open()
    sent = []
    state = SimpleNamespace(
        store=store, config=SimpleNamespace(preempt_grace_s=60.0, lease_timeout_s=15.0),
        stop_lease=lambda *a: sent.append(a))

    async def scenario():
        await store.write(ledger.credit, "ca", 10**8, "client", "", "op", "k", 1)
        job = new_job("i", "ca", 20_000_000, True)
        await store.write(jobs.submit, dataclasses.replace(
            job, needs=dataclasses.replace(job.needs, tier="interruptible")), 1)
        await store.write(jobs.create_lease, LeaseTerms("i", "p1", (0,), 0.4, 60_000, 10), 2, sign)
        from gpumarket.proto.jobspec import now_ms
        at = now_ms()
        await store.write(rows.preempt, "i.1", "s", "standard", 60, at - 70_000)
        assert not await preemption.end_overdue(state)       # 70 s: within 60 + 15
        await store.write(lambda db: db.execute(
            "UPDATE leases SET preempt_at_ms = ? WHERE id = 'i.1'", [at - 80_000]))
        assert await preemption.end_overdue(state)
        assert sent == [("i", 1, "p1", "preempted: did not stop within its grace period")]
        lease = await store.read(jobs.lease_row, "i.1")
        assert lease["state"] == "preempted"

    try:
        asyncio.run(scenario())
    finally:
        store.close()


class Session:
    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


@pytest.fixture
def preempting(tmp_path):
    """(the broker's state as the preemption pass reads it, the one provider session that
    stands for every provider: ``.sent``, what it was told): a fresh store in which the
    client "ca" is funded, a preempt grace of 30 s."""
    store = Store(tmp_path / "broker.db")
    store.open()
    session = Session()
    state = SimpleNamespace(store=store, config=SimpleNamespace(preempt_grace_s=30.0),
                            sessions=SimpleNamespace(get=lambda pid: session))
    try:
        asyncio.run(store.write(ledger.credit, "ca", 10**8, "client", "", "op", "k", 1))
        yield state, session
    finally:
        store.close()


def test_the_scheduler_preempts_for_a_waiting_standard_job_once(preempting):
    state, session = preempting
    store = state.store

    async def scenario():
        for job_id, tier in (("i", "interruptible"), ("s", "standard"), ("t", "standard")):
            job = new_job(job_id, "ca", 20_000_000, True)
            await store.write(jobs.submit, dataclasses.replace(
                job, needs=dataclasses.replace(job.needs, tier=tier)), 1)
        await store.write(jobs.create_lease, LeaseTerms("t", "p2", (0,), 1.0, 60_000, 10), 2, sign)
        await store.write(jobs.create_lease, LeaseTerms("i", "p1", (0,), 0.4, 60_000, 10), 2, sign)
        book = Book([offer("p1", busy=frozenset({0})), offer("p2", busy=frozenset({0}))])
        waiting = [needs("s", "standard"), needs("x", "interruptible")]
        assert await preemption.preempt_for_waiting(state, book, waiting) == 1
        (message,) = session.sent
        assert (message.preempt_lease.job_id, message.preempt_lease.epoch,
                message.preempt_lease.grace_s) == ("i", 1, 30)
        # The next pass: a lease yields to it already; nothing more is preempted (p2's
        # lease is standard).
        assert await preemption.preempt_for_waiting(state, book, waiting) == 0
        assert await preemption.preempt_for_waiting(
            state, book, [needs("u", "standard")]) == 0
        events = await store.read(views.events_after, "i", 0)
        assert events[-1].type == "preempting"

    asyncio.run(scenario())


def test_a_replica_preempts_a_second_lease_and_takes_the_first_to_yield(preempting,
                                                                         monkeypatch):
    """A replica under a spike waits for the first of two interruptible leases to yield,
    not for the slower (bench/tiers.py: its long waits were one job's big checkpoint on a
    slow uplink, or a job letting its grace run out); a standard job preempts one. (On by
    default; set here so that the test holds whatever the default: docs/tiers.md.)"""
    from gpumarket.broker.market import preemption as market_preemption

    monkeypatch.setattr(market_preemption, "SERVING_BACKUP", True)
    state, session = preempting
    store = state.store

    async def scenario():
        # r queued: the leases it preempts are its own while it waits (a standard job may
        # take a lease left yielding to a job no longer queued: test_tiers_churn.py).
        for job_id, tier in (("i1", "interruptible"), ("i2", "interruptible"),
                             ("i3", "interruptible"), ("r", "serving")):
            job = new_job(job_id, "ca", 20_000_000, True)
            await store.write(jobs.submit, dataclasses.replace(
                job, needs=dataclasses.replace(job.needs, tier=tier)), 1)
        for job_id, provider in (("i1", "p1"), ("i2", "p2"), ("i3", "p3")):
            await store.write(jobs.create_lease, LeaseTerms(job_id, provider, (0,), 0.4,
                                                            60_000, 10), 2, sign)
        book = Book([offer(p, busy=frozenset({0})) for p in ("p1", "p2", "p3")])
        assert await preemption.preempt_for_waiting(state, book, [needs("r", "serving")]) == 2
        assert await preemption.preempt_for_waiting(state, book, [needs("s", "standard")]) == 1
        assert len(session.sent) == 3

    asyncio.run(scenario())


# -- what a spec may say -----------------------------------------------------------------------

def spec(**fields) -> pb.JobSpec:
    base = {"kind": TRAIN, "nonce": b"\0" * 16, "resources": pb.Resources(gpus=1),
            "max_price_per_gpu_hour": 1.0, "created_at_ms": 1, "expires_at_ms": 2}
    return pb.JobSpec(**{**base, **fields})


def test_a_client_cannot_buy_the_interruptible_price_with_standard_protection():
    # Without checkpoints, interruptible means restarts: the spec must say it accepts them.
    plain = Kind("nockpt", 100, (), "x")
    with pytest.raises(InvalidArgument, match="cannot checkpoint.*preemptible = true"):
        kinds.check_tier(spec(tier=pb.TIER_INTERRUPTIBLE), plain)
    kinds.check_tier(spec(tier=pb.TIER_INTERRUPTIBLE, preemptible=True), plain)
    kinds.check_tier(spec(tier=pb.TIER_INTERRUPTIBLE), kinds.get(TRAIN))   # it checkpoints
    # preemptible on a standard job, the serving tier on a job, another tier on an
    # endpoint, a tier that does not exist: refused.
    with pytest.raises(InvalidArgument, match="preemptible"):
        check_common(spec(preemptible=True))
    with pytest.raises(InvalidArgument, match="serving is the tier of endpoints"):
        kinds.check_tier(spec(tier=pb.TIER_SERVING), kinds.get(TRAIN))
    with pytest.raises(InvalidArgument, match="always of the serving tier"):
        kinds.check_tier(spec(tier=pb.TIER_INTERRUPTIBLE), kinds.get(pb.JOB_KIND_ENDPOINT))
    with pytest.raises(InvalidArgument, match="tier: unknown"):
        check_common(spec(tier=7))


def test_a_job_file_says_its_tier(tmp_path):
    from gpumarket.client import jobfile
    from gpumarket.proto.errors import JobFileError

    from tests.helpers import training_job

    job = jobfile.load(training_job(tmp_path / "a.toml", extra='tier = "interruptible"'))
    assert (job.tier, job.preemptible) == (pb.TIER_INTERRUPTIBLE, False)
    assert jobfile.load(training_job(tmp_path / "b.toml")).tier == pb.TIER_UNSPECIFIED
    for extra, said in (('tier = "spot"', "field 'tier' must be"),
                        ('tier = "serving"', "field 'tier' must be"),
                        ("preemptible = true", "'preemptible' is for tier")):
        with pytest.raises(JobFileError, match=said):
            jobfile.load(training_job(tmp_path / "c.toml", extra=extra))


class Process:
    def __init__(self):
        self.asked, self.stopped, self.running = 0, [], True

    def request_drain(self):
        self.asked += 1

    def alive(self):
        return self.running

    async def stop(self, reason):
        self.stopped.append(reason)
        self.running = False


def test_a_preempted_job_is_asked_to_checkpoint_and_stopped_when_its_grace_is_over():
    """The provider's side: the drain request (the runners' and task.should_stop's), then,
    if the job has not stopped within the grace period, a stop; released either way."""
    from gpumarket.provider.attempt import Attempt

    async def scenario(stops: bool):
        a = SimpleNamespace(preempted="", process=Process(), cancelled=False, _grace=None,
                            _grace_stop=None, key=("j", 1))
        a._grace_over = lambda: Attempt._grace_over(a)
        Attempt.request_preempt(a, 0.2, "preempted by a standard job")
        Attempt.request_preempt(a, 0.2, "again")          # asked once
        assert a.process.asked == 1 and a.preempted == "preempted by a standard job"
        assert Attempt.release_reason.fget(a) == "preempted by a standard job"
        if stops:
            a.process.running = False                     # it checkpointed and exited
        await asyncio.sleep(0.5)
        if a._grace_stop is not None:
            await a._grace_stop
        return a.process.stopped

    assert asyncio.run(scenario(stops=True)) == []
    assert asyncio.run(scenario(stops=False)) == ["preempted: its grace period is over"]
