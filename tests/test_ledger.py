"""The ledger on a real SQLite file: the job and lease state machine driven at random
(hypothesis), with broker crashes mid-transaction; and its unit rules, on SQLite and on
PostgreSQL (``store_location``)."""

from __future__ import annotations

import sqlite3
from dataclasses import asdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumarket.broker.jobs import endings
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs.job import LeaseTerms
from gpumarket.broker.market.admission import Needs, NewJob
from gpumarket.broker.money import ledger
from gpumarket.broker.store.schema import migrations
from gpumarket.broker.store import postgres
from gpumarket.broker.store.store import connect, is_postgres
from gpumarket.proto.errors import GpumarketError, InsufficientFunds
from gpumarket.proto.v1 import types_pb2 as pb

CLIENTS = ("ca", "cb")
PROVIDERS = ("pa", "pb", "pc")
PRICES = {"pa": 1.0, "pb": 1.7, "pc": 0.3}
STEPS = 40
EVERY = 10


class Crash(Exception):
    """The broker dies inside a transaction: nothing of it is committed."""


def open_db(where):
    """The broker's database at ``where``: a SQLite file's path, or a PostgreSQL URL."""
    if is_postgres(str(where)):
        db = postgres.connect(where)
        postgres.migrate(db, migrations)
        return db
    db = connect(where)
    migrations.apply(db)
    return db


def psycopg_error():
    import psycopg

    return psycopg.Error


def sign(lease: pb.Lease) -> pb.Envelope:
    return pb.Envelope(payload=lease.SerializeToString())


def new_job(job_id: str, client: str, hold: int, enforce: bool, price: float = 2.0,
            gpus: int = 1) -> NewJob:
    needs = Needs(kind=pb.JOB_KIND_TRAINING, gpus=gpus, min_memory_bytes=0,
                  accelerator=pb.ACCELERATOR_UNSPECIFIED, max_price_per_gpu_hour=price)
    return NewJob(id=job_id, client_id=client, name=job_id,
                  spec=pb.Envelope().SerializeToString(), spec_sha256="0" * 64, needs=needs,
                  expires_at_ms=10**13, max_attempts=100, nonce=job_id.encode().hex(),
                  hold=hold, hold_basis="test", fee_ppm=50_000, enforce_funds=enforce)


def artifact(db, provider: str, step: int, now: int) -> pb.ArtifactRef:
    """A checkpoint blob this provider uploaded intact."""
    sha = f"{step:08x}{provider}".ljust(64, "0")
    db.execute("INSERT INTO artifacts (sha256, size_bytes, created_at_ms)"
               " VALUES (?, ?, ?) ON CONFLICT DO NOTHING", [sha, 10, now])
    db.execute("INSERT INTO artifact_owners (sha256, owner_id, size_bytes, created_at_ms)"
               " VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING", [sha, provider, 10, now])
    return pb.ArtifactRef(name="ckpt.tar", sha256=sha, size_bytes=10)


def running(w, job_id: str = "j", hold: int = 500_000, *, credit: int = 10**6,
            started_ms: int = 0, price: float = 1.0, job: NewJob | None = None) -> None:
    """Client "ca" credited, job ``job_id`` holding ``hold`` and running on "pa" since
    ``started_ms``."""
    w.write(ledger.credit, "ca", credit, "client", "", "op", f"k-{job_id}", 1)
    w.write(jobs.submit, job or new_job(job_id, "ca", hold, True, price=max(price, 1.0)), 2)
    w.write(jobs.create_lease, LeaseTerms(job_id, "pa", (0,), price, 60_000, EVERY), 3, sign)
    w.write(jobs.mark_started, job_id, 1, "pa", started_ms)


class World:
    """The broker's store and a clock; each call is one transaction, as Store.write runs
    it, optionally crashing before COMMIT."""

    def __init__(self, path):
        self.path = path
        self.db = open_db(path)
        self.now = 1_000_000
        self.jobs: list[str] = []

    def write(self, fn, *args, crash: bool = False):
        self.db.conn.execute("BEGIN" if is_postgres(str(self.path)) else "BEGIN IMMEDIATE")
        try:
            out = fn(self.db, *args)
            if crash:
                raise Crash()
        except BaseException:
            self.db.conn.execute("ROLLBACK")
            raise
        self.db.conn.execute("COMMIT")
        return out

    def restart(self):
        self.db.conn.close()
        self.db = open_db(self.path)

    def job(self, job_id):
        return jobs.job_row(self.db, job_id)

    def active_lease(self, job_id):
        row = self.db.execute("SELECT id, epoch, provider_id FROM leases WHERE job_id = ?"
                              " AND state = 'active'", [job_id]).fetchone()
        return row


def apply(w: World, op: tuple, crash: bool) -> None:
    """One random operation; those that do not apply now raise GpumarketError."""
    name, a, b = op
    w.now += 1 + b * 997
    job_id = w.jobs[a % len(w.jobs)] if w.jobs else None
    if name == "credit":
        w.write(ledger.credit, CLIENTS[a % 2], (b + 1) * 10_000, "client", "", "op",
                f"k{w.now}", w.now, crash=crash)
    elif name == "submit":
        new = f"j{len(w.jobs)}"
        w.write(jobs.submit, new_job(new, CLIENTS[a % 2], (b + 1) * 3_000, a % 3 != 0),
                w.now, crash=crash)
        w.jobs.append(new)
    elif job_id is None:
        return
    elif name == "lease":
        p = PROVIDERS[b % 3]
        w.write(jobs.create_lease, LeaseTerms(job_id, p, (0,), PRICES[p], 60_000, EVERY), w.now,
                sign, crash=crash)
    elif name in ("start", "checkpoint", "succeed", "fail", "lose", "exhaust"):
        lease = w.active_lease(job_id)
        if lease is None:
            return
        lease_id, epoch, p = lease
        started = w.db.execute("SELECT started_at_ms FROM leases WHERE id = ?",
                               [lease_id]).fetchone()[0]
        if name in ("checkpoint", "succeed") and started is None:
            w.write(jobs.mark_started, job_id, epoch, p, w.now)   # a provider reports it first
        if name == "start":
            w.write(jobs.mark_started, job_id, epoch, p, w.now, crash=crash)
        elif name == "checkpoint":
            job = w.job(job_id)
            step = min(STEPS, job["checkpoint_step"] + EVERY * (1 + b % 2))
            w.write(jobs.record_progress, job_id, epoch, p, pb.Progress(step=step, total=STEPS),
                    w.now)
            ref = w.write(artifact, p, step, w.now)
            w.write(jobs.record_checkpoint, job_id, epoch, p, step, ref, 0.1, w.now,
                    crash=crash)
        elif name == "succeed":
            receipt = pb.Envelope(payload=pb.Receipt(job_id=job_id).SerializeToString())
            w.write(jobs.succeed, job_id, epoch, p, receipt.SerializeToString(), w.now,
                    crash=crash)
        elif name == "fail":
            w.write(endings.fail, job_id, epoch, p, "boom", w.now, crash=crash)
        elif name == "exhaust":   # the broker's check of running leases against their hold
            w.now += b * 3_600_000
            w.write(jobs.exhaust, lease_id, w.now, crash=crash)
        else:
            w.write(endings.lose_lease, lease_id, "missed heartbeats", w.now, crash=crash)
    elif name == "cancel":
        w.write(endings.cancel, job_id, w.job(job_id)["client_id"], w.now, crash=crash)
    elif name == "topup":
        w.write(jobs.top_up, job_id, w.job(job_id)["client_id"], (b + 1) * 2_000, w.now,
                crash=crash)
    elif name == "dispute":
        seq = w.db.execute("SELECT seq FROM ledger_postings WHERE type = 'settle' AND NOT"
                           " EXISTS (SELECT 1 FROM ledger_postings d WHERE d.key ="
                           " 'dispute:' || ledger_postings.seq) ORDER BY seq LIMIT 1 OFFSET ?",
                           [b]).fetchone()
        if seq is not None:
            w.write(ledger.dispute, seq[0], w.now, crash=crash)
    elif name == "resolve":
        seq = w.db.execute("SELECT substr(key, 9) FROM ledger_postings WHERE type = 'dispute'"
                           " AND NOT EXISTS (SELECT 1 FROM ledger_postings r WHERE r.key ="
                           " 'resolve:' || substr(ledger_postings.key, 9)) LIMIT 1").fetchone()
        if seq is not None:
            w.write(ledger.resolve, int(seq[0]), a % 2 == 0, w.now, crash=crash)
    elif name == "restart":
        w.restart()


def check(w: World) -> None:
    """The ledger's invariants after any step."""
    db = w.db
    assert ledger.audit(db) == []
    total = db.execute("SELECT coalesce(sum(amount), 0) FROM ledger_entries").fetchone()[0]
    assert total == 0
    for job_id in w.jobs:
        job = w.job(job_id)
        settles = db.execute(
            "SELECT p.lease_id, p.step_from, p.step_to, p.seconds, -e.amount, p.key"
            " FROM ledger_postings p JOIN ledger_entries e ON e.posting_seq = p.seq"
            " AND e.account = ? WHERE p.type = 'settle' ORDER BY p.seq",
            [ledger.escrow(job_id)]).fetchall()
        # Each step of progress is paid once: the settled ranges chain from 0 without a gap
        # or an overlap, and end at the latest checkpoint (or the end, once succeeded).
        at = 0
        for _, step_from, step_to, _, _, _ in settles:
            assert step_from == at, settles
            assert step_to >= step_from
            at = step_to
        # (A segment that cost under one unit moves nothing: the next settlement covers its
        # steps, so the chain may end before the last checkpoint only by such a segment.)
        if job["state"] == jobs.SUCCEEDED:
            total = max(job["progress_step"], job["progress_total"])
            assert at == total or (at <= total and not any(
                s[5].endswith(":final") for s in settles))
        else:
            assert at <= job["checkpoint_step"]
        # Each segment costs the lease's price x devices x its time (capped by the hold
        # where funds are enforced), and the job's charge is their sum.
        money = ledger.job_money(db, job_id)
        reversed_ = -db.execute(
            "SELECT coalesce(sum(e.amount), 0) FROM ledger_entries e JOIN ledger_postings p"
            " ON p.seq = e.posting_seq WHERE p.type = 'reverse' AND p.job_id = ?"
            " AND e.account = ?", [job_id, ledger.escrow(job_id)]).fetchone()[0]
        assert money["charged"] == sum(s[4] for s in settles) + reversed_
        for lease_id, _, _, seconds, paid, key in settles:
            price = db.execute("SELECT price_per_gpu_hour FROM leases WHERE id = ?",
                               [lease_id]).fetchone()[0]
            # ``seconds`` is the time the amount pays for (what is left of a unit carries on)
            full = ledger.units(price) * round(seconds * 1000) // ledger.MS_PER_HOUR
            assert full <= paid <= full + 1 or (job["enforce_funds"] and paid < full), key
        if job["state"] in (jobs.SUCCEEDED, jobs.FAILED, jobs.CANCELLED):
            assert money["remaining"] == 0          # released
        elif job["enforce_funds"]:
            assert money["remaining"] >= 0
    # Per client: what it was given = available + held + spent (nothing is created or lost).
    for c in CLIENTS:
        s = ledger.summary(db, c)
        assert s["available"] + s["held"] + s["spent"] == s["credited"]
    # A lease is never paid for more time than it ran: its segments add up to at most the
    # time from its start to its last settlement.
    for lease_id, paid_s, last in db.execute(
            "SELECT lease_id, sum(seconds), max(at_ms) FROM ledger_postings"
            " WHERE type = 'settle' GROUP BY lease_id").fetchall():
        started = db.execute("SELECT started_at_ms FROM leases WHERE id = ?",
                             [lease_id]).fetchone()[0]
        assert round(paid_s * 1000) <= last - started + 1, lease_id


OPS = st.tuples(st.sampled_from(["credit", "submit", "lease", "start", "checkpoint",
                                 "checkpoint", "succeed", "fail", "lose", "cancel", "topup",
                                 "dispute", "resolve", "restart", "exhaust"]),
                st.integers(0, 5), st.integers(0, 4))


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(OPS, st.booleans()), min_size=5, max_size=60))
def test_random_histories_keep_the_books_balanced(tmp_path_factory, history):
    w = World(tmp_path_factory.mktemp("ledger") / "broker.db")
    for op, crash in history:
        before = w.db.execute("SELECT count(*) FROM ledger_postings").fetchone()[0]
        try:
            apply(w, op, crash)
        except Crash:
            # Nothing of the crashed transaction is there; the event is retried (the
            # provider reports again, the client calls again) and lands once.
            assert w.db.execute("SELECT count(*) FROM ledger_postings").fetchone()[0] == before
            w.restart()
            try:
                apply(w, op, False)
            except GpumarketError:
                pass
        except GpumarketError:
            pass
        check(w)
    w.db.conn.close()


def test_a_checkpoint_reported_twice_is_settled_once(store_location):
    w = World(store_location)
    running(w, started_ms=1_000)
    ref = w.write(artifact, "pa", 10, 1_000)
    assert w.write(jobs.record_checkpoint, "j", 1, "pa", 10, ref, 0.1, 361_000)
    assert not w.write(jobs.record_checkpoint, "j", 1, "pa", 10, ref, 0.1, 400_000)
    settles = w.db.execute("SELECT step_from, step_to, seconds FROM ledger_postings"
                           " WHERE type = 'settle'").fetchall()
    assert settles == [(0, 10, 360.0)]
    # 1 credit/h x 360 s = 0.1 credit, 5 % of it the market's fee.
    assert ledger.balance(w.db, ledger.provider("pa")) == 95_000
    assert ledger.balance(w.db, "fee") == 5_000
    assert ledger.balance(w.db, ledger.escrow("j")) == 400_000


def test_a_hold_the_client_cannot_cover_queues_nothing(store_location):
    w = World(store_location)
    w.write(ledger.credit, "ca", 250_000, "client", "", "op", "k1", 1)
    with pytest.raises(InsufficientFunds, match=r"holds 0\.30 credits .* available balance"
                       r" is 0\.25, 0\.05 short"):
        w.write(jobs.submit, new_job("j", "ca", 300_000, True), 2)
    assert w.db.execute("SELECT count(*) FROM jobs").fetchone()[0] == 0
    assert w.db.execute("SELECT count(*) FROM events").fetchone()[0] == 0
    assert ledger.balance(w.db, ledger.client("ca")) == 250_000
    # A broker that does not enforce funds records the usage: the balance goes below zero.
    w.write(jobs.submit, new_job("j", "ca", 300_000, False), 3)
    assert ledger.balance(w.db, ledger.client("ca")) == -50_000
    assert ledger.audit(w.db) == []


def test_a_hold_posted_unread_never_adds_to_a_posting_of_its_key(store_location):
    """A new job's hold is posted without reading its key back (ledger.post's new_key: the
    job did not exist, so neither did its hold): were a posting of that key there all the
    same, the submission fails whole, and nothing is added to that posting."""
    w = World(store_location)
    w.write(ledger.credit, "ca", 10**6, "client", "", "op", "k1", 1)
    w.write(lambda db: ledger.post(db, "hold:j", "hold", {"deposits": -5, "fee": 5}, 1))
    refused = psycopg_error() if is_postgres(str(store_location)) else sqlite3.IntegrityError
    with pytest.raises(refused):
        w.write(jobs.submit, new_job("j", "ca", 300_000, True), 2)
    assert w.db.execute("SELECT count(*) FROM jobs").fetchone()[0] == 0
    assert ledger.balance(w.db, ledger.escrow("j")) == 0
    assert ledger.balance(w.db, "fee") == 5
    assert ledger.audit(w.db) == []


def test_a_spent_hold_pauses_at_a_checkpoint_and_a_top_up_resumes(store_location):
    w = World(store_location)
    running(w, hold=150_000)            # 0.15 credit at 1 credit/h: 540 s of one device
    w.write(jobs.record_progress, "j", 1, "pa", pb.Progress(step=10, total=40), 300_000)
    ref = w.write(artifact, "pa", 10, 0)
    w.write(jobs.record_checkpoint, "j", 1, "pa", 10, ref, 0.1, 300_000)   # 300 s: 0.0833
    job = w.job("j")
    assert job["state"] == jobs.PAUSED and "topup j" in job["queue_reason"]
    lease = w.db.execute("SELECT state FROM leases WHERE id = 'j.1'").fetchone()
    assert lease == ("paused",)
    assert w.write(jobs.top_up, "j", "ca", 500_000, 400_000) == jobs.QUEUED
    w.write(jobs.create_lease, LeaseTerms("j", "pb", (0,), 1.0, 60_000, EVERY), 400_001, sign)
    assert w.db.execute("SELECT start_step FROM leases WHERE id = 'j.2'").fetchone() == (10,)
    assert w.job("j")["attempt"] == 1        # a pause is not a failed attempt
    assert ledger.audit(w.db) == []


def test_postings_are_append_only(store_location):
    w = World(store_location)
    pg = is_postgres(store_location)
    refused = psycopg_error() if pg else sqlite3.IntegrityError
    w.write(ledger.credit, "ca", 100, "client", "", "op", "k1", 1)
    for sql in ("UPDATE ledger_entries SET amount = 1000", "DELETE FROM ledger_postings",
                "UPDATE ledger_postings SET memo = 'x'", "DELETE FROM ledger_entries"):
        with pytest.raises(refused, match="append-only"):
            w.db.execute(sql)
    # Past the triggers (by hand, on the file), tampering shows in the audit.
    w.db.execute("DROP TRIGGER ledger_entries_append_only_update"
                 + (" ON ledger_entries" if pg else ""))
    w.db.execute("UPDATE ledger_entries SET amount = 1000 WHERE account = 'client:ca'")
    assert ledger.audit(w.db) == [
        "posting 1 sums to 900, not 0",
        "client:ca: running balance 100 at posting 1, but its entries sum to 1000",
        "posting 1: its entries differ from its record"]


def test_a_credit_order_applies_once(store_location):
    w = World(store_location)
    first = w.write(ledger.credit, "ca", 100, "client", "memo", "op", "nonce1", 1)
    again = w.write(ledger.credit, "ca", 100, "client", "memo", "op", "nonce1", 2)
    assert first[0] is not None and again == (None, 100)
    row = w.db.execute("SELECT memo, actor FROM ledger_postings").fetchall()
    assert row == [("memo", "op")]


def test_a_failed_check_returns_the_pay_to_the_job(store_location):
    w = World(store_location)
    running(w)
    ref = w.write(artifact, "pa", 10, 0)
    w.write(jobs.record_checkpoint, "j", 1, "pa", 10, ref, 0.1, 360_000)
    seq = w.db.execute("SELECT seq FROM ledger_postings WHERE type = 'settle'").fetchone()[0]
    w.write(ledger.dispute, seq, 400_000)
    assert ledger.balance(w.db, ledger.provider("pa")) == 0
    assert ledger.job_money(w.db, "j")["disputed"] == 100_000
    w.write(ledger.resolve, seq, False, 500_000)
    assert ledger.balance(w.db, ledger.escrow("j")) == 500_000     # as if never paid
    assert ledger.job_money(w.db, "j")["charged"] == 0
    assert ledger.audit(w.db) == []
    lines = ledger.lines(w.db, "pa")
    assert [(x.type, x.account, x.amount) for x in lines] == [
        ("reverse", "disputed", -100_000), ("dispute", "disputed", 100_000),
        ("dispute", "earned", -95_000), ("settle", "earned", 95_000)]
    # each is what GetAccount sends, field for field
    assert [pb.LedgerLine(**asdict(x)).memo for x in lines] == [x.memo for x in lines]


def test_a_job_asking_for_a_stake_goes_only_to_staked_providers_and_a_slash_pays_the_client(
        store_location):
    from gpumarket.broker.market.matcher import Book, JobNeeds, OfferView, explain

    cpu, train = pb.ACCELERATOR_CPU, pb.JOB_KIND_TRAINING
    staked = OfferView("staked", 1.0, frozenset({train}), (0,), cpu, 2**30, stake=5_000_000)
    bare = OfferView("bare", 0.5, frozenset({train}), (0,), cpu, 2**30)
    job = JobNeeds("j", train, 1, 0, pb.ACCELERATOR_UNSPECIFIED, 2.0, min_stake=1_000_000)
    placement, _ = Book([staked, bare]).place(job)
    assert placement.provider_id == "staked"     # the cheaper one has no stake
    _, excluded = Book([bare]).place(job)
    assert dict(excluded) == {"stake": 1} and "staked less" in explain(excluded, 1)

    w = World(store_location)
    w.write(ledger.credit, "staked", 5_000_000, "stake", "bond", "op", "s1", 1)
    assert w.write(ledger.slash, "staked", "ca", "j", 2_000_000, 2) == 2_000_000
    assert ledger.balance(w.db, ledger.stake("staked")) == 3_000_000
    assert ledger.balance(w.db, ledger.client("ca")) == 2_000_000
    assert ledger.audit(w.db) == []


def test_a_running_lease_stops_where_its_hold_ends_and_a_token_top_up_does_not_resume_it(
        store_location):
    """A tiny hold (a budget of one unit, a job that never checkpoints) buys only what it
    covers: the lease is stopped and paid the hold when its cost reaches it, and a top-up
    resumes the job only once the hold covers a minute of the lease."""
    w = World(store_location)
    w.write(ledger.credit, "ca", 10**6, "client", "", "op", "k1", 1)
    w.write(jobs.submit, new_job("j", "ca", 1, True), 2)
    w.write(jobs.create_lease, LeaseTerms("j", "pa", (0,), 1.0, 60_000, EVERY), 3, sign)
    assert w.write(jobs.exhaust, "j.1", 3_600_000) is None     # not started: costs nothing
    w.write(jobs.mark_started, "j", 1, "pa", 3_600_000)
    assert w.write(jobs.exhaust, "j.1", 3_600_001) is None     # 1 ms < 1 unit: still covered
    ended = w.write(jobs.exhaust, "j.1", 7_200_000)            # an hour later
    assert ended == jobs.EndedLease("j", 1, "pa")
    assert w.job("j")["state"] == jobs.PAUSED
    assert ledger.balance(w.db, ledger.provider("pa")) == 1    # the hold, and no more
    assert w.write(jobs.top_up, "j", "ca", 1, 7_300_000) == jobs.PAUSED
    assert "short of what it needs" in w.job("j")["queue_reason"]
    assert w.write(jobs.top_up, "j", "ca", 16_666, 7_400_000) == jobs.QUEUED   # a minute
    assert ledger.audit(w.db) == []


def test_a_cancelled_job_pays_its_running_lease_and_nothing_before_it_started(store_location):
    w = World(store_location)
    w.write(ledger.credit, "ca", 10**7, "client", "", "op", "k1", 1)
    w.write(jobs.submit, new_job("c", "ca", 2_000_000, True), 2)
    w.write(jobs.create_lease, LeaseTerms("c", "pa", (0,), 1.0, 60_000, EVERY), 10, sign)
    w.write(jobs.mark_started, "c", 1, "pa", 3_600_010)   # an hour after the lease
    w.write(endings.cancel, "c", "ca", 5_400_010)
    # Half an hour of running at 1 credit/h is paid; the hour before "started" is not.
    assert ledger.job_money(w.db, "c") == {"hold": 2_000_000, "charged": 500_000,
                                           "remaining": 0, "disputed": 0}
    assert ledger.balance(w.db, ledger.provider("pa")) == 475_000
    assert ledger.audit(w.db) == []


def test_a_failed_attempt_is_not_paid_past_its_last_checkpoint(store_location):
    """A provider's report that the job failed ends its lease unpaid since the last
    settlement (the client is not charged for it); what its checkpoint settled stays
    settled, and the next lease resumes from there."""
    w = World(store_location)
    w.write(ledger.credit, "ca", 10**7, "client", "", "op", "k1", 1)
    w.write(jobs.submit, new_job("f", "ca", 2_000_000, True), 2)
    w.write(jobs.create_lease, LeaseTerms("f", "pa", (0,), 1.0, 60_000, EVERY), 10, sign)
    w.write(jobs.mark_started, "f", 1, "pa", 3_600_010)
    w.write(jobs.record_progress, "f", 1, "pa", pb.Progress(step=10, total=STEPS), 5_400_010)
    w.write(jobs.record_checkpoint, "f", 1, "pa", 10, w.write(artifact, "pa", 10, 5_400_010),
            0.1, 5_400_010)
    w.write(endings.fail, "f", 1, "pa", "CUDA error: an illegal memory access", 7_200_010)
    job = w.job("f")
    assert (job["state"], job["attempt"], job["checkpoint_step"]) == (jobs.QUEUED, 2, 10)
    assert ledger.job_money(w.db, "f")["charged"] == 500_000     # the checkpointed half hour
    assert ledger.balance(w.db, ledger.provider("pa")) == 475_000
    assert w.db.execute("SELECT state FROM leases WHERE id = 'f.1'").fetchone()[0] == "failed"
    assert ledger.audit(w.db) == []


def test_an_offer_with_absurd_figures_cannot_inflate_holds():
    from gpumarket.broker.market.calibration import Model
    from gpumarket.broker.market.matcher import Estimate, OfferView
    from gpumarket.broker.money import credit_holds

    needs = Needs(kind=pb.JOB_KIND_TRAINING, gpus=1, min_memory_bytes=0,
                  accelerator=pb.ACCELERATOR_UNSPECIFIED, max_price_per_gpu_hour=2.0,
                  work_flops=1e13)
    liar = OfferView("liar", 0.0, frozenset({pb.JOB_KIND_TRAINING}), (0,), pb.ACCELERATOR_CPU,
                     2**30, claimed_flops=1e-6)
    raw = credit_holds.raw_seconds(needs.work_flops, liar, 1)
    assert raw == 1e4            # counted at 1 GFLOP/s, not at the 1e-6 it claims
    slow = Model(10**9, 10**9, 3, "its own stalling")
    timed = [credit_holds.Timed(Estimate("liar", 0.0, 1, 1, 0, 1, 1), raw, slow.seconds(raw),
                         slow.basis)]
    held, basis = credit_holds.amount(needs, 1, timed, 0.0)
    assert held == ledger.units(2.0 * 7 * 24)       # capped at seven days of max_price
    assert "at most 7 days" in basis


def test_a_lease_running_past_its_max_runtime_is_taken_back_unpaid_since_its_checkpoint(
        store_location):
    """A provider that stalls past the job's max_runtime is not waited for: the broker takes
    the lease back (lost), and its time since its last checkpoint is never paid."""
    from gpumarket.broker.jobs import views

    w = World(store_location)
    job = new_job("j", "ca", 5_000_000, True)
    running(w, credit=10**7, job=NewJob(**{**job.__dict__, "needs": Needs(
        **{**job.needs.__dict__, "max_runtime_s": 600})}))
    ref = w.write(artifact, "pa", 10, 0)
    w.write(jobs.record_checkpoint, "j", 1, "pa", 10, ref, 0.1, 300_000)     # paid: 300 s
    assert views.leases_past_runtime(w.db, 660_000, 60_000) == []
    assert views.leases_past_runtime(w.db, 660_001, 60_000) == [("j.1", 600)]
    assert w.write(endings.lose_lease, "j.1", "ran past the job's max_runtime of 600s", 3_600_000)
    assert w.job("j")["state"] == jobs.QUEUED
    assert ledger.job_money(w.db, "j")["charged"] == 83_333          # the 300 s only


def test_the_parts_of_a_split_job_draw_on_one_hold(store_location):
    from gpumarket.broker.jobs import views

    w = World(store_location)
    w.write(ledger.credit, "ca", 10**6, "client", "", "op", "k1", 1)
    w.write(jobs.submit, NewJob(**{**new_job("j", "ca", 100_000, True).__dict__,
                                   "part_sizes": (5, 5)}), 2)
    for part, p in (("j-1", "pa"), ("j-2", "pb")):
        w.write(jobs.create_lease, LeaseTerms(part, p, (0,), 1.0, 60_000, EVERY), 3, sign)
        w.write(jobs.mark_started, part, 1, p, 0)
    # 100,000 units are 360 s of one device at 1 credit/h: two parts spend it in 180 s.
    assert views.leases_over_hold(w.db, 179_000) == []
    assert sorted(views.leases_over_hold(w.db, 180_000)) == ["j-1.1", "j-2.1"]
    assert w.write(jobs.exhaust, "j-1.1", 180_000) is not None
    assert w.write(jobs.exhaust, "j-2.1", 180_000) is not None
    paid = ledger.balance(w.db, ledger.provider("pa")) + ledger.balance(w.db, ledger.provider("pb"))
    assert paid + ledger.balance(w.db, "fee") == 100_000          # the hold, and no more
    assert w.job("j")["state"] == jobs.PAUSED
    # A top-up resumes only the parts it covers together (10 s each: 2,778 units).
    w.write(jobs.top_up, "j", "ca", 3_000, 200_000)
    assert sorted(p["state"] for p in jobs.parts_of(w.db, "j")) == [jobs.QUEUED, jobs.PAUSED]
    assert ledger.audit(w.db) == []


def test_fractions_of_a_unit_carry_to_the_next_settlement_and_a_restart_keeps_the_clock(
        store_location):
    w = World(store_location)
    running(w, price=0.05)                                      # 1 unit = 72 ms
    for step in range(1, 101):                           # a checkpoint every 100 ms, 10 s
        if step == 50:
            w.write(jobs.mark_started, "j", 1, "pa", 5_000)   # a re-attached job reports again
        ref = w.write(artifact, "pa", step, 0)
        w.write(jobs.record_checkpoint, "j", 1, "pa", step, ref, 0.0, step * 100)
    assert ledger.job_money(w.db, "j")["charged"] == 10_000 * 50_000 // 3_600_000   # 138
    assert w.db.execute("SELECT started_at_ms FROM leases").fetchone() == (0,)


def test_budgets_too_small_to_pay_for_anything_are_refused_and_never_leased(store_location):
    from gpumarket.broker.money import credit_holds
    from gpumarket.proto.errors import InvalidArgument

    needs = Needs(kind=pb.JOB_KIND_TRAINING, gpus=2, min_memory_bytes=0,
                  accelerator=pb.ACCELERATOR_UNSPECIFIED, max_price_per_gpu_hour=1.8)
    with pytest.raises(InvalidArgument, match=r"budget: at least 0\.01 credits \(10 s of"
                       r" max_price x 2 devices\)"):
        credit_holds.amount(needs, 1, [], 0.0000004)
    assert credit_holds.amount(needs, 1, [], 0.01) == (10_000, "the job's budget")
    w = World(store_location)
    w.write(ledger.credit, "ca", 10**6, "client", "", "op", "k1", 1)
    w.write(jobs.submit, new_job("j", "ca", 2_777, True), 2)
    left = ledger.balance(w.db, ledger.escrow("j"))
    assert left == 2_777
    assert not credit_holds.covers_lease(left, 1.0, 1)          # 10 s at 1 credit/h is 2,778
    assert credit_holds.covers_lease(left, 0.9, 1)


def test_a_hold_covers_a_lease_while_it_pays_its_first_ten_seconds():
    """credit_holds.covers_lease: the one rule placement's plan applies before it leases a
    job (tests/test_placement_plan.py sees the plan keep to it)."""
    from gpumarket.broker.money.credit_holds import RESUME_FLOOR_S, covers_lease, floor_units

    assert RESUME_FLOOR_S == 10
    assert floor_units(1.0, 1) == 2_778                  # 10 s of 1,000,000 units/h, rounded up
    assert floor_units(1.0, 4) == 11_112 and floor_units(0.0, 2) == 1
    assert covers_lease(2_778, 1.0, 1) and not covers_lease(2_777, 1.0, 1)
    assert covers_lease(11_112, 1.0, 4) and not covers_lease(11_111, 1.0, 4)
    assert not covers_lease(0, 0.0, 1)                   # even a free lease needs a unit left
    assert covers_lease(None, 1e6, 8)                    # a job that does not enforce funds


def test_a_paused_job_whose_spec_expired_fails_and_gives_its_hold_back(store_location):
    w = World(store_location)
    running(w, job=NewJob(**{**new_job("j", "ca", 100_000, True).__dict__,
                             "expires_at_ms": 10**6}))
    w.write(jobs.exhaust, "j.1", 400_000)
    assert w.job("j")["state"] == jobs.PAUSED
    with pytest.raises(GpumarketError, match="expired"):
        w.write(jobs.top_up, "j", "ca", 500_000, 10**6)
    assert w.write(endings.expire_queued, 10**6) == ["j"]
    assert w.job("j")["state"] == jobs.FAILED
    assert ledger.balance(w.db, ledger.client("ca")) == 10**6 - 100_000   # the hold was spent
    assert ledger.audit(w.db) == []
