"""What a spot check's verdict does (docs/verification.md): a check that agrees pays the held
segment on; one that disagrees calls a tie-break on a third provider; the provider two of
three found wrong loses its pay on the job and its stake, the job goes back to its last clean
checkpoint elsewhere, and a second failure bans it; a checker found wrong is not paid for its
replay. Also what ends checks without a verdict: a job that ends, a replay that cannot run, a
check no provider took in time. No grpc here; every function runs inside one write
transaction (the scheduler's loop compares, broker/checks/verdicts.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from sqlite_utils import Database

from gpumarket.broker.checks import answers, task_checks, verification
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.money import ledger
from gpumarket.broker.market import providers
from gpumarket.broker.store import blob_holdings
from gpumarket.proto.v1 import types_pb2 as pb

OPEN = verification.OPEN       # check states that still await a verdict
_row = verification.check_row
MARKS = ", ".join("?" * len(OPEN))
PROGRESS = "progress"    # a check's scope: how far the broker's comparison of it got so far


def compared_in_part(db: Database, check_id: str, progress: dict) -> None:
    """The broker's comparison of a returned check ran out of its time for a pass before it
    compared everything (kinds.base.Unfinished): keep how far it got in the check's scope,
    where its next pass goes on from (verdicts.decide). The check stays returned: neither
    passed nor disputed."""
    row = db.execute("SELECT scope FROM checks WHERE id = ? AND state = 'returned'",
                     [check_id]).fetchone()
    if row is not None:
        db.execute("UPDATE checks SET scope = ? WHERE id = ?",
                   [json.dumps({**json.loads(row[0]), PROGRESS: progress}), check_id])


def could_not_run(db: Database, check_id: str, error: str, now: int) -> None:
    """The check's job failed on its checker (or ran out of attempts): nothing to compare;
    the checked provider keeps its pay, its record unchanged."""
    _close(db, _row(db, check_id), "skipped",
           f"the replay did not finish: {error}", None, now)


@dataclass(frozen=True)
class ToCompare:
    check_id: str
    kind: int
    role: str
    expect: dict[str, dict]
    outputs: dict[str, dict]
    first_outputs: dict[str, dict]      # a tie-break: what the disagreeing checker returned
    scope: dict


def to_compare(db: Database) -> list[ToCompare]:
    out = []
    for (check_id,) in db.execute("SELECT id FROM checks WHERE state = 'returned'").fetchall():
        c = _row(db, check_id)
        kind = db.execute("SELECT kind FROM jobs WHERE id = ?", [check_id]).fetchone()[0]
        first = _row(db, c["first_check"]) if c["first_check"] else None
        out.append(ToCompare(check_id, kind, c["role"], json.loads(c["expect"]),
                             json.loads(c["outputs"] or "{}"),
                             json.loads(first["outputs"] or "{}") if first else {},
                             json.loads(c["scope"])))
    return out


@dataclass(frozen=True)
class Outcome:
    """What ``conclude`` did that the caller must tell providers: leases to stop, providers
    banned."""

    stop: tuple[tuple[str, int, str], ...] = ()     # (job, epoch, provider)
    banned: tuple[str, ...] = ()


def conclude(db: Database, check_id: str, agrees: bool, agrees_first: bool, detail: str,
             now: int, ban_after: int = verification.BAN_AFTER) -> Outcome:
    """Apply a check's verdict: ``agrees`` with the checked provider's result; for a
    tie-break, ``agrees_first``: with the first checker's."""
    c = _row(db, check_id)
    if c is None or c["state"] != "returned":
        return Outcome()
    if c["role"] == "check":
        if agrees:
            _close(db, c, "passed", detail, None, now)
            return Outcome()
        db.execute("UPDATE checks SET state = 'disagreed', detail = ?, ended_at_ms = ? WHERE"
                   " id = ?", [detail, now, check_id])
        job = _job(db, c["job_id"])
        # (the tie-break compares everything again: none of this check's progress)
        scope = {k: v for k, v in json.loads(c["scope"]).items() if k != PROGRESS}
        verification.queue(db, job, c["provider_id"], c["lease_id"], c["settle_seq"],
                           c["step_from"], c["step_to"],
                           json.loads(c["start"]) if c["start"] else None,
                           json.loads(c["expect"]), scope, "tiebreak", check_id, now,
                           c["paid_by"])
        verification.note(db, job, f"check {check_id} disagreed with {c['provider_id']}'s"
                          f" result ({detail}); a third provider decides", now)
        return Outcome()
    first = _row(db, c["first_check"])
    if agrees and not agrees_first:
        # The checked work passed; the first check's replay was what was wrong (``liar``).
        db.execute("UPDATE checks SET state = 'passed', liar = ?, detail = ?, ended_at_ms = ?"
                   " WHERE id = ?", [first["checker_id"], f"the checker's replay was wrong"
                                     f" ({first['detail']}; the tie-break {check_id} agreed"
                                     " with the provider)", now, first["id"]])
        _reverse(db, first["id"], first["checker_id"], now)   # a wrong replay is not paid
        # ... and costs its checker up to the pay it put in dispute, from its stake: a
        # checker found wrong loses more than its replay would have earned.
        disputed = ledger.settled_to(db, c["settle_seq"]) if c["settle_seq"] is not None else 0
        if disputed and not _client_ruled(c):
            ledger.slash(db, first["checker_id"], _job(db, c["job_id"])["client_id"],
                         first["id"], disputed, now)
        _close(db, c, "passed", f"{detail}; the first checker ({first['checker_id']}) was"
               " wrong", None, now)
        banned = _maybe_ban(db, first["checker_id"], ban_after, now)
        return Outcome(banned=banned)
    if agrees_first and not agrees:
        # The work this check replayed was wrong (the tie-break counts the failure: ``liar``).
        db.execute("UPDATE checks SET state = 'failed', detail = ?, ended_at_ms = ? WHERE id = ?",
                   [f"{first['detail']}: the tie-break {check_id} agreed with this replay", now,
                    first["id"]])
        return _convict(db, c, detail, now, ban_after)
    if json.loads(c["scope"]).get("outputs"):
        _not_deterministic(db, c, first, detail, now)
        return Outcome()
    _unresolved(db, c, first, f"{detail}; no two of the three results agree", now,
                ran=True)
    return Outcome()


def _not_deterministic(db: Database, c: dict, first: dict, detail: str, now: int) -> None:
    """Three runs of a script whose client declared its outputs comparable, three different
    results: the script is not deterministic as its client said (two cheats would have to
    differ from each other and from an honest run). The client's word was wrong, not a
    provider's: the held pay is paid on, the replays are paid, nobody is counted against,
    and the work reads "unverified" (not what an inconclusive check of a built-in kind does,
    where the client could not have made the runs differ and so gets the pay back)."""
    why = (f"{detail}; no two of the three results agree: the script is not deterministic"
           " as its outputs_compare says, so it is paid as run and unverified")
    db.execute("UPDATE checks SET state = 'inconclusive', ended_at_ms = ? WHERE id = ?",
               [now, first["id"]])
    _close(db, c, "inconclusive", why, None, now, held_paid=True)


UNRESOLVED = ("unresolved: pay returned, the work unverified (a checker disagreed and no"
              " second replay settled who was right)")


def _unresolved(db: Database, c: dict, first: dict, detail: str, now: int,
                ran: bool) -> None:
    """A tie-break that settles nothing (no two of three agree, or no provider replayed it in
    time): nobody is paid for the disputed work — the checked segment's held pay goes back
    to the client, and the replays that disagreed (the first check's, and the tie-break's if
    it ``ran``) are not paid either — and nobody is counted against. A checker that
    disagrees thus costs the checked provider that segment's pay but gains nothing itself."""
    db.execute("UPDATE checks SET state = 'inconclusive', ended_at_ms = ? WHERE id = ?",
               [now, first["id"]])
    if first["checker_id"]:
        _reverse(db, first["id"], first["checker_id"], now)
    if ran and c["checker_id"]:
        _reverse(db, c["id"], c["checker_id"], now)
    _close(db, c, "inconclusive", detail, None, now)


def _job(db: Database, job_id: str) -> dict:
    return jobs.job_row(db, job_id)


def _close(db: Database, c: dict, state: str, detail: str, liar: str | None, now: int,
           finish: bool = True, held_paid: bool = False) -> None:
    """End a check: its held settlement is paid on (unless its provider was found wrong, or
    the check was inconclusive and not ``held_paid``), and a job waiting for its checks
    finished when none is left (what it compared stays, as the job's evidence, until the job
    ends)."""
    db.execute("UPDATE checks SET state = ?, detail = ?, liar = ?, ended_at_ms = ? WHERE id = ?",
               [state, detail, liar, now, c["id"]])
    db.execute("DELETE FROM artifact_refs WHERE job_id = ?", [c["id"]])
    if json.loads(c["scope"]).get("answers"):
        answers.forget_evidence(db, _row(db, c["id"]))
    seq = c["settle_seq"]
    if liar is None and seq is not None and ledger.posted(db, f"resolve:{seq}") is None \
            and not _still_checked(db, seq):
        if state == "inconclusive" and not held_paid:
            ledger.resolve(db, seq, False, now, why=UNRESOLVED)
        else:
            ledger.resolve(db, seq, True, now)
    job = _job(db, c["job_id"])
    word = {"passed": "passed", "skipped": "skipped", "cancelled": "cancelled",
            "inconclusive": "was inconclusive (its held pay returned to the client, the"
                            " replays that disagreed unpaid)"}.get(state, state)
    if state == "inconclusive" and held_paid:
        word = "was inconclusive (paid as run, the work unverified)"
    if state != "failed":
        part = verification.what(c["step_from"], c["step_to"], json.loads(c["scope"]))
        verification.note(db, job, f"check {c['id']} of {part} {word}: {detail}", now)
    if finish:
        finish_if_checked(db, c["job_id"], now)


def _still_checked(db: Database, seq: int) -> bool:
    return db.execute(f"SELECT 1 FROM checks WHERE settle_seq = ? AND state IN"
                      f" ({MARKS})", [seq, *OPEN]).fetchone() is not None


def finish_if_checked(db: Database, job_id: str, now: int) -> None:
    """A job VERIFYING whose last check ended succeeds now."""
    job = jobs.job_row(db, job_id)
    if job["state"] != verification.VERIFYING or verification.open_checks(db, job_id):
        return
    status = verification.summary(db, job_id)
    jobs.finished(db, job, now, f"finished; receipt verified; work {status}")


def _convict(db: Database, c: dict, detail: str, now: int, ban_after: int) -> Outcome:
    """The checked provider's result was wrong: undo all it was paid on this job, re-run the
    job from its last clean checkpoint elsewhere, and count it against it."""
    liar, job_id = c["provider_id"], c["job_id"]
    _close(db, c, "failed", detail, liar, now, finish=False)
    # All it was paid on this job goes back: the job will not keep work of a provider caught
    # lying on it (it re-runs from before its first checkpoint).
    _reverse(db, job_id, liar, now)
    # Its other segments' checks have nothing left to decide.
    stop: list[tuple[str, int, str]] = []
    for (other,) in db.execute(
            f"SELECT id FROM checks WHERE job_id = ? AND provider_id = ? AND state IN"
            f" ({MARKS})", [job_id, liar, *OPEN]).fetchall():
        stop += _cancel(db, _row(db, other), f"{liar}'s work on this job was found wrong",
                        now, finish=False)
    # Its replays on this job's checks cannot be trusted either: ended, and not paid. One of
    # another part's (or lease's) work is queued again first, for another provider: that work
    # still waits for a verdict (VERIFYING), and its held pay stays held for the new check.
    for (other, state) in db.execute("SELECT id, state FROM checks WHERE top_id = ? AND"
                                     " checker_id = ?", [c["top_id"], liar]).fetchall():
        if state in OPEN:
            void = _row(db, other)
            if void["job_id"] != job_id:
                _check_again(db, void, now)
            stop += _cancel(db, void, "its checker was found wrong on this job", now,
                            finish=False)
        _reverse(db, other, liar, now)
    job = _job(db, job_id)
    paid = ledger.settled_to(db, c["settle_seq"]) if c["settle_seq"] is not None else 0
    if paid and not _client_ruled(c):
        ledger.slash(db, liar, job["client_id"], job_id, paid, now)
    step, start = clean_point(db, job_id)
    if job["tasks"] and job["parent_id"]:
        # An array's lease: every task it ran goes back to the queue, for another provider.
        task_checks.rerun(db, job, liar, f"check {c['id']} found {liar}'s result for"
                                         f" {verification.what(0, 0, json.loads(c['scope']))}"
                                         f" wrong ({detail})", now)
        finish_if_checked(db, job_id, now)      # (its tasks get new batches as it ends)
    elif job["state"] in jobs.TERMINAL_STATES:
        pass    # an endpoint's replica that ended meanwhile: nothing left to re-run
    elif _tainted(db, job, step):
        db.execute("UPDATE checkpoint_history SET dropped = 1 WHERE job_id = ? AND step > ?",
                   [job_id, step])
        # Checks of work past the clean point check work the job no longer keeps.
        for (other,) in db.execute(
                f"SELECT id FROM checks WHERE job_id = ? AND step_to > ? AND state IN"
                f" ({MARKS})", [job_id, step, *OPEN]).fetchall():
            stop += _cancel(db, _row(db, other), "the work it checks is re-run", now,
                            finish=False)
        part = verification.what(c["step_from"], c["step_to"], json.loads(c["scope"]))
        stop += rewind(db, job, step, start, f"check {c['id']} found {liar}'s result for"
                       f" {part} wrong ({detail}); its pay returned to the hold", now)
    else:
        finish_if_checked(db, job_id, now)
    banned = _maybe_ban(db, liar, ban_after, now)
    return Outcome(stop=tuple(stop), banned=banned)


def _check_again(db: Database, c: dict, now: int) -> None:
    """Queue check ``c`` again as it was made (its role, its first check for a tie-break),
    for a checker other than the one just found wrong (verification.excluded keeps that one
    from it)."""
    verification.queue(db, _job(db, c["job_id"]), c["provider_id"], c["lease_id"],
                       c["settle_seq"], c["step_from"], c["step_to"],
                       json.loads(c["start"]) if c["start"] else None,
                       json.loads(c["expect"]), json.loads(c["scope"]), c["role"],
                       c["first_check"], now, c["paid_by"])


def _reverse(db: Database, job_id: str, provider_id: str, now: int) -> None:
    """Return to the hold everything ``provider_id`` was paid for its work on ``job_id``
    (held first where it was not; taken back where a check had let it be paid)."""
    for (seq,) in db.execute(
            "SELECT seq FROM ledger_postings WHERE type = 'settle' AND job_id = ?"
            " AND provider_id = ?", [job_id, provider_id]).fetchall():
        if ledger.posted(db, f"resolve:{seq}") is not None:
            ledger.claw_back(db, seq, now)
            continue
        if ledger.posted(db, f"dispute:{seq}") is None:
            ledger.dispute(db, seq, now)
        ledger.resolve(db, seq, False, now)


def _liars(db: Database, job_id: str) -> set[str]:
    """Providers a check on this job found wrong: as its provider or as a checker."""
    return {r[0] for r in db.execute("SELECT liar FROM checks WHERE job_id = ? AND liar IS NOT"
                                     " NULL", [job_id]).fetchall()}


def clean_point(db: Database, job_id: str) -> tuple[int, dict | None]:
    """The latest checkpoint of the job that no provider found wrong on it had a hand in:
    (its step, its ArtifactRef); (0, None) for the start. The kept history is one chain
    (each lease resumes from the checkpoint before it), so it is the one before the first
    checkpoint such a provider wrote."""
    liars = _liars(db, job_id)
    best: tuple[int, dict | None] = (0, None)
    for step, ref, provider_id in db.execute(
            "SELECT step, ref, provider_id FROM checkpoint_history WHERE job_id = ? AND"
            " dropped = 0 ORDER BY seq", [job_id]).fetchall():
        if provider_id in liars:
            break
        best = (step, json.loads(ref))
    return best


def _tainted(db: Database, job: dict, clean_step: int) -> bool:
    """Whether the job's work now rests on anything past its clean point (or is a liar's)."""
    liars = _liars(db, job["id"])
    if job["checkpoint_step"] > clean_step or job["provider_id"] in liars:
        return True
    if job["lease_id"] and job["state"] in (pb.JOB_STATE_LEASED, pb.JOB_STATE_RUNNING,
                                            verification.VERIFYING):
        start = db.execute("SELECT start_step FROM leases WHERE id = ?",
                           [job["lease_id"]]).fetchone()
        return start is not None and start[0] > clean_step
    return False


def _client_ruled(c: dict) -> bool:
    """Whether the check judged a script's outputs by the rule its client declared. The
    client wrote the code, and code can behave differently on one provider's host (its
    name, its CPU, the time): two honest checkers would then convict that provider. So a
    conviction there costs the provider what a cheat gains — the job's pay, re-checked at
    rate 1 from then on (its warm-up checks its own to pay) — but never its stake (which
    would go to the very client that could have framed it) nor a step towards a ban."""
    return bool(json.loads(c["scope"]).get("outputs"))


def _maybe_ban(db: Database, provider_id: str, ban_after: int, now: int) -> tuple[str, ...]:
    # (convictions on a client's declared rule do not count: _client_ruled)
    fails = db.execute("SELECT count(*) FROM checks WHERE liar = ? AND"
                       " json_extract(scope, '$.outputs') IS NULL",
                       [provider_id]).fetchone()[0]
    if fails < ban_after:
        return ()
    banned = db.execute("SELECT banned FROM providers WHERE id = ?", [provider_id]).fetchone()
    if banned is None or banned[0]:
        return ()
    providers.set_banned(db, provider_id, True, f"banned: {fails} spot checks found its results"
                         " wrong", now)
    return (provider_id,)


def _cancel(db: Database, c: dict, why: str, now: int, finish: bool = True
            ) -> list[tuple[str, int, str]]:
    """End an open check without a verdict; its checker is paid up to now."""
    stop = end_check_job(db, c["id"], why, now)
    _close(db, c, "cancelled", why, None, now, finish)
    return stop


def drop(db: Database, top_id: str, failed: bool, now: int) -> None:
    """The job ended while checks of its work were open: they end too. If its client
    cancelled it, the held pay is paid on (nobody was found wrong); if it FAILED, the work
    under check is not paid (a job that fails delivers nothing, and a provider must not escape
    a pending check by failing the job)."""
    why = "the job it checks failed: the work under check is not paid" if failed \
        else "the job it checks was cancelled"
    for (check_id,) in db.execute(f"SELECT id FROM checks WHERE top_id = ? AND state IN"
                                  f" ({MARKS})", [top_id, *OPEN]).fetchall():
        c = _row(db, check_id)
        end_check_job(db, check_id, why, now)
        db.execute("UPDATE checks SET state = 'cancelled', detail = ?, ended_at_ms = ? WHERE"
                   " id = ?", [why, now, c["id"]])
        seq = c["settle_seq"]
        if seq is not None and ledger.posted(db, f"resolve:{seq}") is None \
                and not _still_checked(db, seq):
            ledger.resolve(db, seq, not failed, now)
    db.execute("DELETE FROM artifact_refs WHERE job_id = ? AND role = 'evidence'", [top_id])
    charge_warmups(db, top_id, now)


def charge_warmups(db: Database, top_id: str, now: int) -> None:
    """The job ended (its checks with it): each warm-up check of its work, advanced from the
    job's hold while it ran, is charged to the provider it checked, from its earnings, back
    into the hold (its release returns it to the client). What its earnings cannot cover
    stays paid by the hold: a provider's balance never goes below zero for this, so no
    checker is paid with money nobody put in."""
    job = _job(db, top_id)
    # Not a tie-break that found the first checker wrong: that checker's slash repays the
    # client for it, and the provider it cleared owes nothing for it.
    for check_id, provider_id in db.execute(
            "SELECT c.id, c.paid_by FROM checks c LEFT JOIN checks f ON f.id = c.first_check"
            " WHERE c.top_id = ? AND c.paid_by IS NOT NULL AND (f.liar IS NULL OR"
            " f.liar != f.checker_id) ORDER BY c.created_at_ms, c.id", [top_id]).fetchall():
        ledger.charge_check(db, check_id, provider_id, top_id, job["client_id"], now)


def waiting_too_long(db: Database, before_ms: int) -> list[str]:
    """Checks still queued (no provider could take them) since before ``before_ms``."""
    return [r[0] for r in db.execute(
        "SELECT c.id FROM checks c JOIN jobs j ON j.id = c.id WHERE c.state = 'queued'"
        " AND j.state = ? AND j.updated_at_ms < ?", [pb.JOB_STATE_QUEUED, before_ms]).fetchall()]


def skip(db: Database, check_id: str, why: str, now: int) -> list[tuple[str, int, str]]:
    c = _row(db, check_id)
    if c is None or c["state"] not in OPEN:
        return []
    stop = end_check_job(db, check_id, why, now)
    if c["role"] == "tiebreak":
        _unresolved(db, c, _row(db, c["first_check"]), f"the first check disagreed and {why}",
                    now, ran=False)
    else:
        _close(db, c, "skipped", why, None, now)
    return stop


def rewind(db: Database, job: dict, step: int, start: dict | None, why: str,
           now: int) -> list[tuple[str, int, str]]:
    """A check found work on the job wrong from ``step`` on: stop whoever runs it now, drop
    its result if it had one, and queue it again from the checkpoint at ``step`` (``start``;
    None: from the beginning). Returns the leases to stop."""
    stop = []
    if job["state"] in jobs.ACTIVE_STATES and job["lease_id"]:
        lease = jobs.lease_row(db, job["lease_id"])
        if lease["provider_id"] not in verification.excluded(db, job["id"]):
            ledger.settle(db, job, lease, job["settled_step"], now, tag="end")
        jobs.end_lease(db, lease["id"], "revoked", why, now)
        stop.append((job["id"], job["epoch"], lease["provider_id"]))
    db.execute("DELETE FROM artifact_refs WHERE job_id = ? AND role IN ('output', 'checkpoint')",
               [job["id"]])
    if start:
        blob_holdings.refer(db, start["sha256"], job["id"], "checkpoint")
    attempt = job["attempt"] + 1
    jobs.set_job(db, job["id"], now, state=jobs.QUEUED, attempt=attempt, provider_id=None,
                 lease_id=None, receipt=None, resume_from=json.dumps(start) if start else None,
                 checkpoint_step=step, progress_step=step, settled_to_ms=None,
                 settled_step=step)
    where = f"from step {step}" if start else "from the start"
    jobs.append_event(db, job["id"], "disputed", jobs.QUEUED, attempt, now,
                      message=f"{why}; queued to run again {where} on another provider")
    return stop


def end_check_job(db: Database, check_id: str, why: str, now: int
                  ) -> list[tuple[str, int, str]]:
    """Stop a check's job row (its checker paid up to now); the leases to stop."""
    job = jobs.job_row(db, check_id)
    stop = []
    if job["state"] in jobs.ACTIVE_STATES and job["lease_id"]:
        jobs.stop_lease(db, job, "cancelled", why, now)
        stop.append((check_id, job["epoch"], job["provider_id"]))
    if job["state"] not in jobs.TERMINAL_STATES:
        jobs.set_job(db, check_id, now, state=jobs.CANCELLED, error=why)
        jobs.append_event(db, check_id, "cancelled", jobs.CANCELLED, job["attempt"], now,
                          message=why)
    return stop
