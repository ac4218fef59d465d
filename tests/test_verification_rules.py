"""The rules of spot checks on a real SQLite file, through the same transactions the broker
runs (jobs, verification, ledger): who is paid, who is found wrong, where a job resumes."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from gpumarket.broker.checks import disputes
from gpumarket.broker.checks import verification
from gpumarket.broker.jobs import endings
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs import views
from gpumarket.broker.jobs.job import LeaseTerms
from gpumarket.broker.money import ledger
from gpumarket.proto.v1 import types_pb2 as pb
from tests.test_ledger import World, artifact, new_job, sign

CHECK = verification.Policy(enabled=True, others_online=frozenset({pb.ACCELERATOR_CPU}),
                            draw=0.0, ban_after=2)
NO_CHECK = verification.OFF


def receipt(job_id: str, provider: str, names: list[str], w: World) -> bytes:
    outs = [artifact(w.db, provider, 1000 + i, w.now) for i, _ in enumerate(names)]
    for ref, name in zip(outs, names):
        ref.name = name
    r = pb.Receipt(job_id=job_id, provider_id=provider, outputs=outs)
    return pb.Envelope(payload=r.SerializeToString()).SerializeToString()


@pytest.fixture
def w(tmp_path):
    world = World(tmp_path / "broker.db")
    for p in ("liar", "h1", "h2", "h3"):
        world.db["providers"].insert({"id": p, "public_key": b"", "first_seen_ms": 0,
                                      "last_seen_ms": 0, "online": 1})
    world.write(ledger.credit, "ca", 10**7, "client", "", "op", "k", 1)
    return world


def start(w: World, job_id: str, provider: str, price: float = 1.0) -> int:
    """Lease the queued job (or check) to ``provider`` and start it; return the epoch."""
    w.now += 1000
    w.write(jobs.create_lease, LeaseTerms(job_id, provider, (0,), price, 60_000, 10), w.now, sign)
    epoch = w.job(job_id)["epoch"]
    w.write(jobs.mark_started, job_id, epoch, provider, w.now)
    return epoch


def checkpoint(w: World, job_id: str, provider: str, step: int, policy=NO_CHECK):
    w.now += 60_000
    ref = artifact(w.db, provider, step, w.now)
    w.write(jobs.record_checkpoint, job_id, w.job(job_id)["epoch"], provider, step, ref, 0.1,
            w.now, policy)


def replay(w: World, check_id: str, checker: str) -> None:
    """The checker runs the check's job and returns the state at its end."""
    start(w, check_id, checker)
    w.now += 30_000
    w.write(jobs.succeed, check_id, w.job(check_id)["epoch"], checker,
            receipt(check_id, checker, ["model.safetensors", "state.safetensors",
                                        "state.json"], w), w.now)


def disagree(w: World, job_id: str, first: str, checker: str, tie_breaker: str,
             agrees: bool, agrees_first: bool, excluded: set[str] | None = None):
    """``checker`` replays the check ``first`` and disagrees; ``tie_breaker`` replays the
    tie-break and agrees with the checked result (``agrees``), the first checker's
    (``agrees_first``), or neither. Returns the tie-break's Outcome."""
    replay(w, first, checker)
    w.write(disputes.conclude, first, False, False, "differs", w.now)
    tiebreak = [c for c, row in checks(w, job_id).items() if row["first_check"] == first][0]
    if excluded is not None:
        assert verification.excluded(w.db, tiebreak) == excluded
    replay(w, tiebreak, tie_breaker)
    return w.write(disputes.conclude, tiebreak, agrees, agrees_first, "tie-break", w.now)


def checks(w: World, job_id: str) -> dict[str, dict]:
    cur = w.db.execute("SELECT * FROM checks WHERE job_id = ? ORDER BY created_at_ms, id",
                       [job_id])
    cols = [d[0] for d in cur.description]
    return {r[0]: dict(zip(cols, r)) for r in cur.fetchall()}


def test_the_rate_falls_with_a_record_and_never_below_the_floor():
    rates = [verification.rate(n) for n in range(1000)]
    assert rates[0] == rates[verification.WARMUP - 1] == 1.0 > rates[verification.WARMUP]
    assert all(a >= b for a, b in zip(rates, rates[1:]))
    assert rates[-1] == verification.FLOOR


def _strings(message) -> list[str]:
    """Every string and the name of every ArtifactRef in a message, its sub-messages too."""
    out = []
    for field, value in message.ListFields():
        single = isinstance(value, (str, bytes)) or hasattr(value, "ListFields") or \
            not hasattr(value, "__iter__")
        values = [value] if single else value
        for v in values:
            if isinstance(v, str):
                out.append(v)
            elif hasattr(v, "ListFields"):
                out += _strings(v)
    return out


def test_a_check_lease_says_neither_which_job_nor_whose_work_it_replays(w):
    """A Sybil checker must not recognise its partner's work (to pass it) or an honest
    provider's (to frame it) by what its lease says: the lease as the checker gets it names
    neither the checked job, nor the checked provider, nor an artifact that maps back to
    them; what it replays from (the checkpoint) comes as a content-addressed ref that this
    lease's provider alone may read."""
    job_id, honest = "5ac1e0d9b2f47a36", "honest-provider-key-9e2d"
    w.db["providers"].insert({"id": honest, "public_key": b"", "first_seen_ms": 0,
                              "last_seen_ms": 0, "online": 1})
    w.write(jobs.submit, new_job(job_id, "ca", 500_000, True), w.now)
    start(w, job_id, honest)
    sha = {}
    for step, policy in ((10, NO_CHECK), (20, CHECK)):
        w.now += 60_000
        sha[step] = hashlib.sha256(b"checkpoint %d" % step).hexdigest()
        w.db.execute("INSERT INTO artifacts (sha256, size_bytes, created_at_ms) VALUES (?, ?,"
                     " ?)", [sha[step], 10, w.now])
        w.db.execute("INSERT INTO artifact_owners (sha256, owner_id, size_bytes, created_at_ms)"
                     " VALUES (?, ?, ?, ?)", [sha[step], honest, 10, w.now])
        ref = pb.ArtifactRef(name="checkpoint.tar", sha256=sha[step], size_bytes=10)
        w.write(jobs.record_checkpoint, job_id, w.job(job_id)["epoch"], honest, step, ref,
                0.1, w.now, policy)
    (check_id,) = checks(w, job_id)
    start(w, check_id, "h2")
    envelope = w.db.execute("SELECT envelope FROM leases WHERE job_id = ?",
                            [check_id]).fetchone()[0]
    lease = pb.Lease.FromString(pb.Envelope.FromString(envelope).payload)
    assert lease.HasField("check")      # it is a check: replay steps 10 to 20
    assert (lease.check.step_from, lease.check.step_to) == (10, 20)
    assert lease.resume_from.sha256 == sha[10]
    said = _strings(lease)
    assert said and not [s for s in said if job_id in s or honest in s]
    # nor anywhere in its bytes but the client's signed spec, which it must run
    lease.ClearField("job_spec")
    data = lease.SerializeToString()
    assert job_id.encode() not in data and honest.encode() not in data
    # the checkpoint it resumes from is readable by this lease's provider
    assert views.may_read(w.db, "h2", sha[10]) and not views.may_read(w.db, "h3", sha[10])


def test_a_passed_check_pays_the_held_segment_on(w):
    w.write(jobs.submit, new_job("j", "ca", 500_000, True), w.now)
    start(w, "j", "h1")
    checkpoint(w, "j", "h1", 10, CHECK)
    (check_id,) = checks(w, "j")
    held = ledger.balance(w.db, ledger.disputed("j", "h1"))
    assert held > 0 and ledger.balance(w.db, ledger.provider("h1")) == 0
    # The check never goes to the provider it checks.
    assert verification.excluded(w.db, check_id) == {"h1"}
    lease = verification.scope_of(w.db, check_id)
    assert (lease.step_from, lease.step_to) == (0, 10)
    replay(w, check_id, "h2")
    w.write(disputes.conclude, check_id, True, False, "identical", w.now)
    assert checks(w, "j")[check_id]["state"] == "passed"
    assert ledger.balance(w.db, ledger.disputed("j", "h1")) == 0
    assert ledger.balance(w.db, ledger.provider("h1")) > 0
    assert ledger.balance(w.db, ledger.provider("h2")) > 0     # the checker is paid
    assert verification.record(w.db, "h1") == (1, 1, 0)
    assert verification.summary(w.db, "j") == "verified"
    assert ledger.audit(w.db) == []


def test_a_liar_is_found_by_a_tie_break_unpaid_rewound_past_and_banned_at_the_second(w):
    w.write(jobs.submit, new_job("j", "ca", 500_000, True), w.now)
    start(w, "j", "h1")
    checkpoint(w, "j", "h1", 10)                    # honest, unchecked
    w.write(endings.lose_lease, w.job("j")["lease_id"], "gone", w.now)
    start(w, "j", "liar")                           # resumes from h1's step 10
    checkpoint(w, "j", "liar", 20, CHECK)
    checkpoint(w, "j", "liar", 30)                  # built on its own wrong state
    (first,) = checks(w, "j")
    out = disagree(w, "j", first, "h2", "h3", False, True, excluded={"liar", "h2"})
    tiebreak = [c for c in checks(w, "j") if c != first][0]

    c = checks(w, "j")
    assert c[first]["state"] == c[tiebreak]["state"] == "failed"
    assert c[tiebreak]["liar"] == "liar"
    # Nothing it did on the job is paid; the client gets the segments back in the hold.
    assert ledger.balance(w.db, ledger.provider("liar")) == 0
    assert ledger.balance(w.db, ledger.disputed("j", "liar")) == 0
    # The job resumes from the last checkpoint no liar had a hand in: h1's step 10.
    job = w.job("j")
    assert job["state"] == jobs.QUEUED and job["checkpoint_step"] == 10
    assert ("j", 2, "liar") in out.stop            # its running lease is taken back
    assert "liar" in verification.excluded(w.db, "j")
    assert verification.summary(w.db, "j") == "disputed -> re-run"
    assert verification.rate(verification.record(w.db, "liar")[0]) == 1.0
    assert not out.banned
    assert ledger.audit(w.db) == []

    # A second job, a second failure: banned.
    w.write(jobs.submit, new_job("k", "ca", 500_000, True), w.now)
    start(w, "k", "liar")
    checkpoint(w, "k", "liar", 10, CHECK)
    (first,) = checks(w, "k")
    out = disagree(w, "k", first, "h1", "h2", False, True)
    assert out.banned == ("liar",)
    assert w.db.execute("SELECT banned FROM providers WHERE id = 'liar'").fetchone()[0] == 1


def test_a_checker_that_lies_is_found_wrong_and_the_checked_provider_is_paid(w):
    w.write(ledger.credit, "liar", 10**6, "stake", "", "op", "stake-liar", 1)
    w.write(jobs.submit, new_job("j", "ca", 500_000, True), w.now)
    start(w, "j", "h1")
    checkpoint(w, "j", "h1", 10, CHECK)
    (first,) = checks(w, "j")
    client_before = ledger.balance(w.db, ledger.client("ca"))
    disagree(w, "j", first, "liar", "h2", True, False, excluded={"h1", "liar"})
    c = checks(w, "j")
    assert c[first]["liar"] == "liar" and c[first]["state"] == "passed"
    paid = ledger.balance(w.db, ledger.provider("h1"))
    assert paid > 0                                                   # paid on
    assert ledger.balance(w.db, ledger.provider("liar")) == 0        # its replay is not paid
    # ... and its stake pays the client up to the pay it disputed: it loses more than its
    # replay would have earned.
    assert ledger.balance(w.db, ledger.stake("liar")) == 10**6 - paid
    assert ledger.balance(w.db, ledger.client("ca")) == client_before + paid
    assert w.job("j")["checkpoint_step"] == 10 and w.job("j")["state"] == jobs.RUNNING
    assert verification.record(w.db, "liar")[2] == 1
    assert verification.record(w.db, "h1")[:2] == (1, 1)
    assert ledger.audit(w.db) == []


def test_a_provider_found_wrong_on_a_job_checks_none_of_its_later_work(w):
    """Fixed: a provider a check found wrong on a job — its work, or its replay as a
    checker — could still be drawn to check the job's later segments, run by others
    (docs/verification.md, Who checks)."""
    w.write(jobs.submit, new_job("j", "ca", 500_000, True), w.now)
    start(w, "j", "liar")
    checkpoint(w, "j", "liar", 10, CHECK)
    (first,) = checks(w, "j")
    disagree(w, "j", first, "h1", "h2", False, True)      # liar's work found wrong: re-run
    start(w, "j", "h1")
    checkpoint(w, "j", "h1", 10, CHECK)
    (second,) = [c for c, row in checks(w, "j").items() if row["provider_id"] == "h1"]
    assert verification.excluded(w.db, second) == {"h1", "liar"}
    disagree(w, "j", second, "h3", "h2", True, False)     # h3's replay found wrong
    checkpoint(w, "j", "h1", 20, CHECK)
    (third,) = [c for c, row in checks(w, "j").items() if row["step_to"] == 20]
    assert verification.excluded(w.db, third) == {"h1", "liar", "h3"}


def test_a_finished_job_waits_for_its_checks_and_one_nobody_takes_is_skipped(w):
    w.write(jobs.submit, new_job("j", "ca", 500_000, True), w.now)
    start(w, "j", "h1")
    checkpoint(w, "j", "h1", 10, CHECK)
    w.now += 1000
    w.write(jobs.succeed, "j", w.job("j")["epoch"], "h1",
            receipt("j", "h1", ["model.safetensors", "loss.jsonl", "metrics.json"], w), w.now,
            CHECK)
    assert w.job("j")["state"] == jobs.VERIFYING
    pending = list(checks(w, "j"))
    assert len(pending) == 2                        # steps 0-10, and 10 to the end
    assert disputes.waiting_too_long(w.db, w.now + 1) == pending
    for check_id in pending:
        w.write(disputes.skip, check_id, "no other provider took it", w.now)
    job = w.job("j")
    assert job["state"] == jobs.SUCCEEDED
    assert ledger.balance(w.db, ledger.escrow("j")) == 0             # released
    assert ledger.balance(w.db, ledger.disputed("j", "h1")) == 0     # and h1 paid
    assert verification.summary(w.db, "j") == "unverified"
    assert ledger.audit(w.db) == []


def test_no_check_without_another_provider_and_none_when_off(w):
    w.write(jobs.submit, new_job("j", "ca", 500_000, True), w.now)
    start(w, "j", "h1")
    alone = verification.Policy(enabled=True, others_online=frozenset(), draw=0.0)
    checkpoint(w, "j", "h1", 10, alone)
    checkpoint(w, "j", "h1", 20, verification.OFF)
    assert not checks(w, "j")
    events = [r[0] for r in w.db.execute("SELECT message FROM events WHERE job_id = 'j'")]
    assert any("no other provider of its device class online" in e for e in events)


def test_a_cancelled_job_ends_its_checks_and_pays_the_checked_provider(w):
    w.write(jobs.submit, new_job("j", "ca", 500_000, True), w.now)
    start(w, "j", "h1")
    checkpoint(w, "j", "h1", 10, CHECK)
    (check_id,) = checks(w, "j")
    start(w, check_id, "h2")
    w.write(endings.cancel, "j", "ca", w.now)
    assert checks(w, "j")[check_id]["state"] == "cancelled"
    assert w.job(check_id)["state"] == jobs.CANCELLED
    assert ledger.balance(w.db, ledger.disputed("j", "h1")) == 0
    assert ledger.balance(w.db, ledger.escrow("j")) == 0
    assert ledger.audit(w.db) == []
    # A client cannot cancel or top up a check row by its id.
    with pytest.raises(Exception, match="no job"):
        w.write(endings.cancel, check_id, "ca", w.now)


def test_failing_the_job_does_not_escape_a_pending_check(w):
    w.write(jobs.submit, new_job("j", "ca", 500_000, True), w.now)
    start(w, "j", "liar")
    checkpoint(w, "j", "liar", 10, CHECK)
    checkpoint(w, "j", "liar", 20, CHECK)
    w.write(endings.fail, "j", w.job("j")["epoch"], "liar", "out of memory", w.now)
    assert w.job("j")["state"] == jobs.QUEUED          # its word alone: tried elsewhere
    assert "cancelled" not in {c["state"] for c in checks(w, "j").values()}
    start(w, "j", "h2")
    w.write(endings.fail, "j", w.job("j")["epoch"], "h2", "out of memory", w.now)
    assert w.job("j")["state"] == jobs.FAILED         # two providers agree
    assert {c["state"] for c in checks(w, "j").values()} == {"cancelled"}
    # The work under check is not paid; the client has its hold back.
    assert ledger.balance(w.db, ledger.provider("liar")) == 0
    assert ledger.balance(w.db, ledger.disputed("j", "liar")) == 0
    assert ledger.balance(w.db, ledger.escrow("j")) == 0
    assert ledger.balance(w.db, ledger.client("ca")) == 10**7
    assert ledger.audit(w.db) == []


def test_pay_a_passed_check_let_through_is_taken_back_when_the_provider_is_caught(w):
    w.write(jobs.submit, new_job("j", "ca", 500_000, True), w.now)
    start(w, "j", "liar")
    checkpoint(w, "j", "liar", 10, CHECK)
    (first,) = checks(w, "j")
    replay(w, first, "h1")
    w.write(disputes.conclude, first, True, False, "identical", w.now)
    assert ledger.balance(w.db, ledger.provider("liar")) > 0      # 0-10 passed: paid
    checkpoint(w, "j", "liar", 20, CHECK)
    second = [c for c in checks(w, "j") if c != first][0]
    disagree(w, "j", second, "h1", "h2", False, True)
    # The job goes back to the start (the liar wrote every checkpoint): its pay for 0-10 too.
    assert w.job("j")["checkpoint_step"] == 0
    assert ledger.balance(w.db, ledger.provider("liar")) == 0
    assert verification.record(w.db, "liar") == (0, 1, 1)
    assert ledger.audit(w.db) == []


def settlement_of(w: World, check_id: str) -> tuple[int, str]:
    """The held settlement a check decides, and how its resolution was posted."""
    seq = w.db.execute("SELECT settle_seq FROM checks WHERE id = ?", [check_id]).fetchone()[0]
    row = w.db.execute("SELECT type, memo FROM ledger_postings WHERE key = ?",
                       [f"resolve:{seq}"]).fetchone()
    return seq, row


def test_an_inconclusive_tie_break_pays_no_one_for_the_disputed_work(w):
    """Issue 34: no two of three agree → the job finishes, but the disputed segment's held
    pay goes back to the client, neither replay that disagreed is paid, nobody is counted
    against, and the client reads "unverified", never "passed"."""
    w.write(jobs.submit, new_job("j", "ca", 500_000, True), w.now)
    start(w, "j", "h1")
    checkpoint(w, "j", "h1", 10, CHECK)
    w.write(jobs.succeed, "j", w.job("j")["epoch"], "h1",
            receipt("j", "h1", ["model.safetensors", "loss.jsonl"], w), w.now, NO_CHECK)
    assert w.job("j")["state"] == jobs.VERIFYING
    (first,) = checks(w, "j")
    paid_before = ledger.balance(w.db, ledger.provider("h1"))   # its last segment, unchecked
    disagree(w, "j", first, "h2", "h3", False, False)
    assert {c["state"] for c in checks(w, "j").values()} == {"inconclusive"}
    assert w.job("j")["state"] == jobs.SUCCEEDED
    assert ledger.balance(w.db, ledger.disputed("j", "h1")) == 0
    assert ledger.balance(w.db, ledger.provider("h1")) == paid_before   # 0-10 not paid
    _, (kind, memo) = settlement_of(w, first)
    assert kind == "reverse" and "unresolved" in memo and "passed" not in memo
    assert ledger.balance(w.db, ledger.provider("h2")) == 0      # the replays that disagreed
    assert ledger.balance(w.db, ledger.provider("h3")) == 0
    assert ledger.balance(w.db, ledger.escrow("j")) == 0          # the rest back to the client
    assert verification.record(w.db, "h1") == (0, 0, 0)           # counted against nobody
    assert verification.record(w.db, "h2") == (0, 0, 0)
    assert verification.summary(w.db, "j") == "unverified"
    said = [r[0] for r in w.db.execute("SELECT message FROM events WHERE job_id = 'j'")]
    assert any("work unverified" in m for m in said), said
    assert not any("passed" in m for m in said if "inconclusive" in m), said
    assert ledger.audit(w.db) == []


def test_a_tie_break_nobody_takes_leaves_the_work_unverified_and_unpaid(w):
    """A lone disagreeing checker and no third provider within check_wait: the held pay is
    not paid on (the lone-cheater case of issue 34 kept it), the checker's replay neither."""
    w.write(jobs.submit, new_job("j", "ca", 500_000, True), w.now)
    start(w, "j", "liar")
    checkpoint(w, "j", "liar", 10, CHECK)
    w.write(jobs.succeed, "j", w.job("j")["epoch"], "liar",
            receipt("j", "liar", ["model.safetensors", "loss.jsonl"], w), w.now, NO_CHECK)
    (first,) = checks(w, "j")
    paid_before = ledger.balance(w.db, ledger.provider("liar"))
    replay(w, first, "h1")
    w.write(disputes.conclude, first, False, False, "differs", w.now)
    (tiebreak,) = [c for c in checks(w, "j") if c != first]
    w.write(disputes.skip, tiebreak, "no other provider took it within 600s", w.now)
    assert w.job("j")["state"] == jobs.SUCCEEDED
    assert ledger.balance(w.db, ledger.provider("liar")) == paid_before
    _, (kind, memo) = settlement_of(w, first)
    assert kind == "reverse" and "passed" not in memo
    assert ledger.balance(w.db, ledger.provider("h1")) == 0
    assert verification.summary(w.db, "j") == "unverified"
    assert ledger.audit(w.db) == []


def test_a_tie_break_goes_only_to_the_trusted_checkers_and_every_check_is_drawn(w, tmp_path):
    """Issue 34: with `trusted_checkers`, only a referee the operator named may run a
    tie-break (two keys of one person cannot be checker and tie-breaker); every check's
    provider is drawn (matcher.Book.drawn), not the cheapest."""
    from gpumarket.broker.market import placement
    from gpumarket.broker.market.matcher import Book, JobNeeds, OfferView, Policy

    trusted = frozenset({"ref"})
    w.write(jobs.submit, new_job("j", "ca", 500_000, True), w.now)
    start(w, "j", "h1")
    checkpoint(w, "j", "h1", 10, CHECK)
    (first,) = checks(w, "j")
    replay(w, first, "h2")
    w.write(disputes.conclude, first, False, False, "differs", w.now)
    (tiebreak,) = [c for c in checks(w, "j") if c != first]
    cpu = pb.ACCELERATOR_CPU
    book = Book([OfferView(pid, 0.1 if pid == "h3" else 1.0, frozenset({pb.JOB_KIND_TRAINING}),
                           (0,), cpu, 1 << 34, 0.0, "cpu", 1e11, 0.9, 86400.0, Policy(),
                           frozenset(), 0) for pid in ("h1", "h2", "h3", "ref")])
    base = JobNeeds(tiebreak, pb.JOB_KIND_TRAINING, 1, 0, cpu, 10.0,
                    exclude=verification.excluded(w.db, tiebreak))
    needs = placement.check_needs(w.db, book, tiebreak, base, trusted)
    assert needs.exclude == {"h1", "h2", "h3"} and needs.draw is not None
    placed, _ = book.place(needs)
    assert placed.provider_id == "ref"
    # A first check is drawn among all that fit, referees or not.
    needs = placement.check_needs(w.db, book, first, dataclasses.replace(
        base, job_id=first, exclude=frozenset({"h1"})), trusted)
    assert needs.exclude == {"h1"} and 0 <= needs.draw < 1


def spent(w: World, client: str = "ca") -> int:
    s = ledger.summary(w.db, client)
    assert s["available"] + s["held"] + s["spent"] == s["credited"]      # nothing made or lost
    return s["spent"]


def run_checked_job(w: World, draw: float, checker_price: float = 1.0) -> str:
    """Job "j" on the new provider h1 (checked at rate 1): its first segment checked with
    ``draw`` (replayed by h2 at ``checker_price``, and passed), its last unchecked; the job
    ends. Returns the check's id."""
    w.write(jobs.submit, new_job("j", "ca", 2_000_000, True), w.now)
    start(w, "j", "h1")
    checkpoint(w, "j", "h1", 10, dataclasses.replace(CHECK, draw=draw))
    (check_id,) = checks(w, "j")
    start(w, check_id, "h2", checker_price)
    w.now += 30_000
    w.write(jobs.succeed, check_id, w.job(check_id)["epoch"], "h2",
            receipt(check_id, "h2", ["model.safetensors"], w), w.now)
    w.write(disputes.conclude, check_id, True, False, "identical", w.now)
    w.now += 1000
    w.write(jobs.succeed, "j", w.job("j")["epoch"], "h1",
            receipt("j", "h1", ["model.safetensors"], w), w.now, NO_CHECK)
    assert w.job("j")["state"] == jobs.SUCCEEDED
    return check_id


def work_cost(w: World, job_id: str, provider: str) -> int:
    """What job "j"'s hold paid for ``provider``'s leases of ``job_id`` ("j" or a check of
    it): their pay and the fee."""
    return -w.db.execute(
        "SELECT coalesce(sum(e.amount), 0) FROM ledger_entries e JOIN ledger_postings p"
        " ON p.seq = e.posting_seq WHERE p.type = 'settle' AND p.job_id = ? AND"
        " p.provider_id = ? AND e.account = ?", [job_id, provider,
                                                 ledger.escrow("j")]).fetchone()[0]


def test_a_new_providers_warm_up_checks_are_paid_by_it_not_by_its_client(w):
    """Issue 34: a new provider is checked at rate 1 and its clients paid every replay (in
    one run half their spend). Now a client pays for the checks its own share would have
    made (its verify, at least the floor rate an established provider has: the draw below
    it); a check above it is the provider's warm-up, advanced from the hold while it runs
    and charged back to the provider from its earnings when the job ends. The books
    balance throughout."""
    check_id = run_checked_job(w, draw=0.5)          # above the client's 5 %: warm-up
    assert checks(w, "j")[check_id]["paid_by"] == "h1"
    replay_cost = work_cost(w, check_id, "h2")
    own = work_cost(w, "j", "h1")
    assert replay_cost > 0 and own > replay_cost
    # The client paid for h1's work and nothing for the replay of it ...
    assert spent(w) == own
    assert ledger.job_money(w.db, "j")["charged"] == own
    # ... which h1 paid from its pay: h2 has its replay's pay, the market its fee on both.
    fee = 50_000
    assert ledger.balance(w.db, ledger.provider("h1")) == \
        own - own * fee // 10**6 - replay_cost == own - replay_cost - own * fee // 10**6
    assert ledger.balance(w.db, ledger.provider("h2")) == replay_cost - replay_cost * fee // 10**6
    memo = w.db.execute("SELECT memo FROM ledger_postings WHERE type = 'warmup'").fetchone()[0]
    assert check_id in memo
    assert ledger.audit(w.db) == []


def test_a_check_within_the_clients_share_is_the_clients_and_a_warm_up_never_overdraws(
        tmp_path):
    # The draw below the floor rate: a check the client pays for, as with any provider.
    w1 = World(tmp_path / "a.db")
    for p in ("h1", "h2"):
        w1.db["providers"].insert({"id": p, "public_key": b"", "first_seen_ms": 0,
                                   "last_seen_ms": 0, "online": 1})
    w1.write(ledger.credit, "ca", 10**7, "client", "", "op", "k", 1)
    check_id = run_checked_job(w1, draw=verification.FLOOR / 2)
    assert checks(w1, "j")[check_id]["paid_by"] is None
    assert spent(w1) == work_cost(w1, "j", "h1") + work_cost(w1, check_id, "h2")
    assert ledger.audit(w1.db) == []
    # A checker ten times dearer than the provider: the provider pays what it has (its
    # earnings go to zero, never below: no checker is paid with money nobody put in), the
    # hold the rest.
    w2 = World(tmp_path / "b.db")
    for p in ("h1", "h2"):
        w2.db["providers"].insert({"id": p, "public_key": b"", "first_seen_ms": 0,
                                   "last_seen_ms": 0, "online": 1})
    w2.write(ledger.credit, "ca", 10**7, "client", "", "op", "k", 1)
    check_id = run_checked_job(w2, draw=0.5, checker_price=20.0)
    own, replay_cost = work_cost(w2, "j", "h1"), work_cost(w2, check_id, "h2")
    assert replay_cost > own
    assert ledger.balance(w2.db, ledger.provider("h1")) == 0
    assert spent(w2) == own + replay_cost - (own - own * 50_000 // 10**6)
    assert ledger.audit(w2.db) == []


def test_work_no_check_can_replay_shows_no_check_rate(w):
    """A script job is never checked (docs/verification.md): its status says unverified and
    names no rate it would be "spot-checked at"; a training job on the same new provider
    does (rate 1)."""
    script = new_job("s", "ca", 500_000, True)
    script = dataclasses.replace(script, needs=dataclasses.replace(script.needs,
                                                                   kind=pb.JOB_KIND_SCRIPT))
    w.write(jobs.submit, script, w.now)
    start(w, "s", "h1")
    w.write(jobs.submit, new_job("j", "ca", 500_000, True), w.now)
    start(w, "j", "h1")
    assert verification.view(w.db, "s").rate == 0
    assert verification.view(w.db, "s").status == "unverified"
    assert verification.view(w.db, "j").rate == 1


def test_a_warm_up_checker_found_wrong_costs_the_provider_it_cleared_nothing(w):
    """The first checker of a warm-up check lies and a tie-break clears the provider: the
    lying replay is not paid, and the provider owes nothing for either replay (the tie-break
    stays with the hold; the liar's slash repays the client where it has stake)."""
    w.write(jobs.submit, new_job("j", "ca", 2_000_000, True), w.now)
    start(w, "j", "h1")
    checkpoint(w, "j", "h1", 10, dataclasses.replace(CHECK, draw=0.5))
    (first,) = checks(w, "j")
    disagree(w, "j", first, "liar", "h3", True, False)
    tiebreak = [c for c in checks(w, "j") if c != first][0]
    assert checks(w, "j")[tiebreak]["paid_by"] == "h1"
    w.now += 1000
    w.write(jobs.succeed, "j", w.job("j")["epoch"], "h1",
            receipt("j", "h1", ["model.safetensors"], w), w.now, NO_CHECK)
    assert w.job("j")["state"] == jobs.SUCCEEDED
    own = work_cost(w, "j", "h1")
    assert w.db.execute("SELECT count(*) FROM ledger_postings WHERE type = 'warmup'"
                        ).fetchone()[0] == 0
    assert ledger.balance(w.db, ledger.provider("h1")) == own - own * 50_000 // 10**6
    assert ledger.balance(w.db, ledger.provider("liar")) == 0
    assert spent(w) == own + work_cost(w, tiebreak, "h3")
    assert ledger.audit(w.db) == []
