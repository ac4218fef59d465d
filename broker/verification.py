"""Spot checks: the broker replays part of a provider's work on another provider and compares
(docs/verification.md). No grpc here; every function runs inside one write transaction.

A check is a job row of its own (``check_of`` = the job it checks, ``pays_from`` = the job
whose hold pays its checker) that the scheduler leases like any job, to a provider that is
neither the checked one nor, for a tie-break, the first checker. Its lease carries a
CheckScope: a training segment (resume from the checkpoint at ``step_from``, stop at
``step_to``), some rows of an inference job, or some frames of a render. What it returns is
compared with what the checked provider returned (``expect``) in the scheduler's loop
(broker/verdicts.py reads the blobs), then ``conclude`` applies the verdict:

- agree: the checked provider's pay for the segment, held while the check ran, is paid on;
- disagree: a tie-break on a third provider decides (BOINC's quorum: two of three);
- the checked provider was wrong: its pay for the segment and everything it did on the job
  after it goes back to the job's hold, its stake is slashed, the job re-runs from the
  segment's start on another provider, its record restarts, and past BAN_AFTER failures it is
  banned;
- the first checker was wrong: the same record and ban for it; the checked provider is paid.

How often (BOINC's adaptive replication): a provider with ``streak`` checks passed since its
last failure has each segment checked with probability ``rate(streak)``: 1 for a new one,
falling to FLOOR; a failure sets the streak back to 0. A job's ``verify_rate`` raises it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from sqlite_utils import Database

from gpumarket.broker import ledger
from gpumarket.proto.v1 import types_pb2 as pb

FLOOR = 0.05          # the rate of a provider with a long clean record
HALF_LIFE = 2.0       # checks passed that halve a new provider's rate ... (1 / (1 + n / HALF_LIFE))
BAN_AFTER = 2         # failed checks (since its last ban was lifted) that ban a provider
OPEN = ("queued", "running", "returned", "disagreed")

QUEUED = pb.JOB_STATE_QUEUED
SUCCEEDED = pb.JOB_STATE_SUCCEEDED
CANCELLED = pb.JOB_STATE_CANCELLED
VERIFYING = pb.JOB_STATE_VERIFYING


@dataclass(frozen=True)
class Policy:
    """What the caller knows that the transaction cannot: whether checks are on, whether
    any other provider is online to run one, and a uniform draw in [0, 1) (from a source the
    providers cannot predict) that decides whether this segment is checked."""

    enabled: bool = False
    others_online: bool = False
    draw: float = 1.0
    ban_after: int = BAN_AFTER


OFF = Policy()


def rate(streak: int) -> float:
    """The share of a provider's segments to check after ``streak`` passed checks in a row."""
    return max(FLOOR, 1.0 / (1.0 + streak / HALF_LIFE))


def record(db: Database, provider_id: str) -> tuple[int, int, int]:
    """(checks passed since its last failure, checks passed in all, failures) of a provider's
    work."""
    last_fail = db.execute("SELECT max(ended_at_ms) FROM checks WHERE liar = ?",
                           [provider_id]).fetchone()[0]
    passed = dict(db.execute(
        "SELECT ended_at_ms > ?, count(*) FROM checks WHERE provider_id = ? AND state = 'passed'"
        " AND role = 'check'"
        " GROUP BY 1", [last_fail or -1, provider_id]).fetchall())
    fails = db.execute("SELECT count(*) FROM checks WHERE liar = ?", [provider_id]).fetchone()[0]
    return passed.get(1, 0), sum(passed.values()), fails


def provider_rate(db: Database, provider_id: str) -> float:
    return rate(record(db, provider_id)[0])


def _job_rate(db: Database, job: dict, provider_id: str) -> float:
    asked = json.loads(job["needs"]).get("verify_rate", 0.0)
    return max(float(asked), provider_rate(db, provider_id))


def _new_id(db: Database, job_id: str) -> str:
    n = db.execute("SELECT count(*) FROM checks WHERE job_id = ?", [job_id]).fetchone()[0]
    return f"{job_id}~c{n + 1}"


def _ref(ref: dict | None) -> str | None:
    return json.dumps(ref) if ref else None


def choose(db: Database, policy: Policy, job: dict, lease: dict, step_from: int, step_to: int,
           start: dict | None, expect: dict[str, dict], scope: dict, now: int) -> str | None:
    """Decide whether to check the segment (step_from, step_to] of ``lease``'s work on
    ``job`` (its result: ``expect``, {name: ArtifactRef as a dict}); if so, hold its
    settlement and queue the check. Returns the check's id, or None."""
    if not policy.enabled or job["check_of"] or not expect:
        return None
    if policy.draw >= _job_rate(db, job, lease["provider_id"]):
        return None
    if not policy.others_online:
        _event(db, job, f"steps {step_from}-{step_to} left unchecked: no other provider"
               " online to replay them", now)
        return None
    seq = ledger.posted(db, f"settle:{lease['id']}:{step_to}") or ledger.posted(
        db, f"settle:{lease['id']}:final")
    if seq is not None and ledger.posted(db, f"dispute:{seq}") is None:
        ledger.dispute(db, seq, now)
    return _queue(db, job, lease["provider_id"], lease["id"], seq, step_from, step_to, start,
                  expect, scope, "check", None, now)


def _queue(db: Database, job: dict, provider_id: str, lease_id: str, seq: int | None,
           step_from: int, step_to: int, start: dict | None, expect: dict, scope: dict,
           role: str, first: str | None, now: int) -> str:
    from gpumarket.broker import jobs

    check_id = _new_id(db, job["id"])
    top = job["parent_id"] or job["id"]
    db["checks"].insert({
        "id": check_id, "job_id": job["id"], "top_id": top, "provider_id": provider_id,
        "lease_id": lease_id, "settle_seq": seq, "step_from": step_from, "step_to": step_to,
        "scope": json.dumps(scope), "start": _ref(start), "expect": json.dumps(expect),
        "role": role, "first_check": first, "state": "queued", "created_at_ms": now})
    row = {k: job[k] for k in ("client_id", "kind", "spec", "spec_sha256", "needs",
                               "expires_at_ms", "fee_ppm", "enforce_funds", "part", "parts")}
    needs = json.loads(job["needs"])
    accel = db.execute("SELECT accelerator FROM leases WHERE id = ?", [lease_id]).fetchone()
    if accel and accel[0]:
        needs["accelerator"] = accel[0]     # replayed on the same device class: compared exactly
    db["jobs"].insert({
        **row, "id": check_id,
        "name": f"{role} of {job['name']} ({what(step_from, step_to, scope)})",
        "state": QUEUED, "needs": json.dumps(needs, sort_keys=True), "attempt": 1,
        "max_attempts": 3, "epoch": 0, "created_at_ms": now, "updated_at_ms": now,
        "hold_basis": "", "resume_from": _ref(start), "checkpoint_step": step_from,
        "progress_step": step_from, "progress_total": step_to, "check_of": job["id"],
        "pays_from": top})
    # The checker may read the job's inputs and the checkpoint it starts from; the result it
    # is compared with is kept for the job as evidence, which no provider may read (it must
    # not copy it; views.may_read).
    for sha in {r[0] for r in db.execute("SELECT sha256 FROM artifact_refs WHERE job_id = ?"
                                         " AND role = 'input'", [top]).fetchall()}:
        db.execute("INSERT OR IGNORE INTO artifact_refs (sha256, job_id, role) VALUES (?, ?, ?)",
                   [sha, check_id, "input"])
    if start:
        db.execute("INSERT OR IGNORE INTO artifact_refs (sha256, job_id, role) VALUES (?, ?, ?)",
                   [start["sha256"], check_id, "checkpoint"])
    for ref in expect.values():
        db.execute("INSERT OR IGNORE INTO artifact_refs (sha256, job_id, role) VALUES (?, ?, ?)",
                   [ref["sha256"], top, "evidence"])
    jobs.append_event(db, check_id, "submitted", QUEUED, 1, now,
                      message=f"{role} of {provider_id}'s {what(step_from, step_to, scope)}")
    _event(db, job, f"{role} {check_id} queued: {what(step_from, step_to, scope)} of"
           f" {provider_id}'s work will be replayed on another provider", now)
    return check_id


def what(step_from: int, step_to: int, scope: dict) -> str:
    if scope.get("rows"):
        rows = scope["rows"]
        return f"rows {rows[0]}-{rows[-1]}" if len(rows) > 1 else f"row {rows[0]}"
    if scope.get("frames"):
        frames = scope["frames"]
        return "frame " + ", ".join(str(f) for f in frames)
    return f"steps {step_from}-{step_to}"


def _event(db: Database, job: dict, message: str, now: int) -> None:
    from gpumarket.broker import jobs

    state = db.execute("SELECT state, attempt FROM jobs WHERE id = ?", [job["id"]]).fetchone()
    jobs.append_event(db, job["id"], "check", state[0], state[1], now, message=message,
                      mirror=False)


def _check(db: Database, check_id: str) -> dict | None:
    cur = db.execute("SELECT * FROM checks WHERE id = ?", [check_id])
    row = cur.fetchone()
    return dict(zip([d[0] for d in cur.description], row)) if row else None


def scope_of(db: Database, check_id: str) -> pb.CheckScope | None:
    """The CheckScope a lease of this check's job row carries (None: not a check)."""
    c = _check(db, check_id)
    if c is None:
        return None
    scope = json.loads(c["scope"])
    return pb.CheckScope(checked_job_id=c["job_id"], step_from=c["step_from"],
                         step_to=c["step_to"], rows=scope.get("rows", []),
                         frames=scope.get("frames", []))


def excluded(db: Database, job_id: str) -> frozenset[str]:
    """Providers that must not run this job row: for a check, the provider it checks (and,
    for a tie-break, the checker that disagreed); for any job, providers a check found wrong
    on it."""
    out = {r[0] for r in db.execute("SELECT liar FROM checks WHERE job_id = ? AND liar IS NOT"
                                    " NULL", [job_id]).fetchall()}
    c = _check(db, job_id)
    if c is not None:
        out.add(c["provider_id"])
        if c["first_check"]:
            first = _check(db, c["first_check"])
            if first and first["checker_id"]:
                out.add(first["checker_id"])
    return frozenset(out)


def leased(db: Database, check_id: str, provider_id: str, now: int) -> None:
    db.execute("UPDATE checks SET checker_id = ?, state = 'running' WHERE id = ? AND state IN"
               " ('queued', 'running')", [provider_id, check_id])


def requeued(db: Database, check_id: str) -> None:
    db.execute("UPDATE checks SET state = 'queued' WHERE id = ? AND state = 'running'",
               [check_id])


def returned(db: Database, check_id: str, outputs: dict[str, dict], now: int) -> None:
    """The checker's receipt came: keep what it returned for the verdict (the scheduler's
    loop compares it, see ``to_compare``)."""
    db.execute("UPDATE checks SET outputs = ?, state = 'returned' WHERE id = ?",
               [json.dumps(outputs), check_id])
    top = db.execute("SELECT top_id FROM checks WHERE id = ?", [check_id]).fetchone()[0]
    for ref in outputs.values():
        db.execute("INSERT OR IGNORE INTO artifact_refs (sha256, job_id, role) VALUES (?, ?, ?)",
                   [ref["sha256"], top, "evidence"])


def could_not_run(db: Database, check_id: str, error: str, now: int) -> None:
    """The check's job failed on its checker (or ran out of attempts): nothing to compare;
    the checked provider keeps its pay, its record unchanged."""
    _close(db, _check(db, check_id), "skipped", f"the replay did not finish: {error}", None, now)


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
        c = _check(db, check_id)
        kind = db.execute("SELECT kind FROM jobs WHERE id = ?", [check_id]).fetchone()[0]
        first = _check(db, c["first_check"]) if c["first_check"] else None
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
             now: int, ban_after: int = BAN_AFTER) -> Outcome:
    """Apply a check's verdict: ``agrees`` with the checked provider's result; for a
    tie-break, ``agrees_first``: with the first checker's."""
    c = _check(db, check_id)
    if c is None or c["state"] != "returned":
        return Outcome()
    if c["role"] == "check":
        if agrees:
            _close(db, c, "passed", detail, None, now)
            return Outcome()
        db.execute("UPDATE checks SET state = 'disagreed', detail = ?, ended_at_ms = ? WHERE"
                   " id = ?", [detail, now, check_id])
        job = _job(db, c["job_id"])
        _queue(db, job, c["provider_id"], c["lease_id"], c["settle_seq"], c["step_from"],
               c["step_to"], json.loads(c["start"]) if c["start"] else None,
               json.loads(c["expect"]), json.loads(c["scope"]), "tiebreak", check_id, now)
        _event(db, job, f"check {check_id} disagreed with {c['provider_id']}'s result"
               f" ({detail}); a third provider decides", now)
        return Outcome()
    first = _check(db, c["first_check"])
    if agrees and not agrees_first:
        # The first checker was the wrong one.
        # The checked work passed; the check's replay was what was wrong (``liar``).
        db.execute("UPDATE checks SET state = 'passed', liar = ?, detail = ?, ended_at_ms = ?"
                   " WHERE id = ?", [first["checker_id"], f"the checker's replay was wrong"
                                     f" ({first['detail']}; the tie-break {check_id} agreed"
                                     " with the provider)", now, first["id"]])
        _reverse(db, first["id"], first["checker_id"], 0, now)   # a wrong replay is not paid
        _close(db, c, "passed", f"{detail}; the first checker ({first['checker_id']}) was"
               " wrong", None, now)
        banned = _maybe_ban(db, first["checker_id"], ban_after, now)
        return Outcome(banned=banned)
    if agrees_first and not agrees:
        db.execute("UPDATE checks SET state = 'passed', detail = ?, ended_at_ms = ? WHERE id = ?",
                   [f"{first['detail']}: the tie-break {check_id} agreed with this replay", now,
                    first["id"]])
        return _convict(db, c, detail, now, ban_after)
    _close(db, c, "inconclusive", f"{detail}; no two of the three results agree", None, now)
    db.execute("UPDATE checks SET state = 'inconclusive', ended_at_ms = ? WHERE id = ?",
               [now, first["id"]])
    return Outcome()


def _job(db: Database, job_id: str) -> dict:
    from gpumarket.broker import jobs

    return jobs.job_row(db, job_id)


def _close(db: Database, c: dict, state: str, detail: str, liar: str | None, now: int,
           finish: bool = True) -> None:
    """End a check: its held settlement is paid on (unless its provider was found wrong), and
    a job waiting for its checks finished when none is left (what it compared stays, as the
    job's evidence, until the job ends)."""
    db.execute("UPDATE checks SET state = ?, detail = ?, liar = ?, ended_at_ms = ? WHERE id = ?",
               [state, detail, liar, now, c["id"]])
    db.execute("DELETE FROM artifact_refs WHERE job_id = ?", [c["id"]])
    seq = c["settle_seq"]
    if liar is None and seq is not None and ledger.posted(db, f"resolve:{seq}") is None \
            and not _still_checked(db, seq):
        ledger.resolve(db, seq, True, now)
    job = _job(db, c["job_id"])
    word = {"passed": "passed", "skipped": "skipped", "inconclusive": "was inconclusive",
            "cancelled": "cancelled"}.get(state, state)
    if state != "failed":
        part = what(c["step_from"], c["step_to"], json.loads(c["scope"]))
        _event(db, job, f"check {c['id']} of {part} {word}: {detail}", now)
    if finish:
        finish_if_checked(db, c["job_id"], now)


def _still_checked(db: Database, seq: int) -> bool:
    return db.execute(f"SELECT 1 FROM checks WHERE settle_seq = ? AND state IN"
                      f" ({', '.join('?' * len(OPEN))})", [seq, *OPEN]).fetchone() is not None


def open_checks(db: Database, job_id: str) -> int:
    return db.execute(f"SELECT count(*) FROM checks WHERE job_id = ? AND state IN"
                      f" ({', '.join('?' * len(OPEN))})", [job_id, *OPEN]).fetchone()[0]


def finish_if_checked(db: Database, job_id: str, now: int) -> None:
    """A job VERIFYING whose last check ended succeeds now."""
    from gpumarket.broker import jobs

    job = jobs.job_row(db, job_id)
    if job["state"] != VERIFYING or open_checks(db, job_id):
        return
    status = summary(db, job_id)
    jobs.finished(db, job, now, f"finished; receipt verified; work {status}")


def _convict(db: Database, c: dict, detail: str, now: int, ban_after: int) -> Outcome:
    """The checked provider's result was wrong: undo what it was paid for it and after it on
    this job, re-run the job from the segment's start elsewhere, and count it against it."""
    from gpumarket.broker import jobs

    liar, job_id = c["provider_id"], c["job_id"]
    _close(db, c, "failed", detail, liar, now, finish=False)
    # All it was paid on this job goes back: the job will not keep work of a provider caught
    # lying on it (it re-runs from before its first checkpoint).
    _reverse(db, job_id, liar, 0, now)
    # Its other segments' checks have nothing left to decide.
    stop: list[tuple[str, int, str]] = []
    for (other,) in db.execute(
            f"SELECT id FROM checks WHERE job_id = ? AND provider_id = ? AND state IN"
            f" ({', '.join('?' * len(OPEN))})", [job_id, liar, *OPEN]).fetchall():
        stop += _cancel(db, _check(db, other), f"{liar}'s work on this job was found wrong",
                        now, finish=False)
    # Its replays on this job's checks cannot be trusted either: ended, and not paid.
    for (other,) in db.execute(
            f"SELECT id FROM checks WHERE top_id = ? AND checker_id = ? AND state IN"
            f" ({', '.join('?' * len(OPEN))})", [c["top_id"], liar, *OPEN]).fetchall():
        stop += _cancel(db, _check(db, other), "its checker was found wrong on this job", now,
                        finish=False)
    for (other,) in db.execute("SELECT id FROM checks WHERE top_id = ? AND checker_id = ?",
                               [c["top_id"], liar]).fetchall():
        _reverse(db, other, liar, 0, now)
    job = jobs.job_row(db, job_id)
    paid = db.execute("SELECT coalesce(sum(json_extract(entries, '$.\"' || ? || '\"')), 0)"
                      " FROM ledger_postings WHERE seq = ?",
                      [ledger.provider(liar), c["settle_seq"] or -1]).fetchone()[0]
    if paid:
        ledger.slash(db, liar, job["client_id"], job_id, paid, now)
    step, start = clean_point(db, job_id)
    if _tainted(db, job, step):
        db.execute("UPDATE checkpoint_history SET dropped = 1 WHERE job_id = ? AND step > ?",
                   [job_id, step])
        # Checks of work past the clean point check work the job no longer keeps.
        for (other,) in db.execute(
                f"SELECT id FROM checks WHERE job_id = ? AND step_to > ? AND state IN"
                f" ({', '.join('?' * len(OPEN))})", [job_id, step, *OPEN]).fetchall():
            stop += _cancel(db, _check(db, other), "the work it checks is re-run", now,
                            finish=False)
        stop += jobs.rewind(db, job, step, start,
                            f"check {c['id']} found {liar}'s result for"
                            f" {what(c['step_from'], c['step_to'], json.loads(c['scope']))}"
                            f" wrong ({detail}); its pay returned to the hold", now)
    else:
        finish_if_checked(db, job_id, now)
    banned = _maybe_ban(db, liar, ban_after, now)
    return Outcome(stop=tuple(stop), banned=banned)


def _reverse(db: Database, job_id: str, provider_id: str, after_step: int, now: int) -> None:
    """Return to the hold what ``provider_id`` was paid for its work on ``job_id`` past
    ``after_step`` (held first where it was not)."""
    for (seq,) in db.execute(
            "SELECT seq FROM ledger_postings WHERE type = 'settle' AND job_id = ?"
            " AND provider_id = ? AND (step_to > ? OR ? = 0)",
            [job_id, provider_id, after_step, after_step]).fetchall():
        if ledger.posted(db, f"resolve:{seq}") is not None:
            continue
        if ledger.posted(db, f"dispute:{seq}") is None:
            ledger.dispute(db, seq, now)
        ledger.resolve(db, seq, False, now)


def remember(db: Database, job: dict, lease: dict, step: int, ref: dict) -> None:
    """Keep a checkpoint (and its blob) in the job's history until the job ends."""
    db["checkpoint_history"].insert({
        "job_id": job["id"], "step": step, "ref": json.dumps(ref), "lease_id": lease["id"],
        "provider_id": lease["provider_id"], "start_step": lease["start_step"]})
    db.execute("INSERT OR IGNORE INTO artifact_refs (sha256, job_id, role) VALUES (?, ?, ?)",
               [ref["sha256"], job["id"], "history"])


def clean_point(db: Database, job_id: str) -> tuple[int, dict | None]:
    """The latest checkpoint of the job that no provider found wrong on it had a hand in:
    (its step, its ArtifactRef); (0, None) for the start. The kept history is one chain
    (each lease resumes from the checkpoint before it), so it is the one before the first
    checkpoint such a provider wrote."""
    liars = {r[0] for r in db.execute("SELECT liar FROM checks WHERE job_id = ? AND liar ="
                                      " provider_id", [job_id]).fetchall()}
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
    liars = {r[0] for r in db.execute("SELECT liar FROM checks WHERE job_id = ? AND liar ="
                                      " provider_id", [job["id"]]).fetchall()}
    if job["checkpoint_step"] > clean_step or job["provider_id"] in liars:
        return True
    if job["lease_id"] and job["state"] in (pb.JOB_STATE_LEASED, pb.JOB_STATE_RUNNING,
                                            VERIFYING):
        start = db.execute("SELECT start_step FROM leases WHERE id = ?",
                           [job["lease_id"]]).fetchone()
        return start is not None and start[0] > clean_step
    return False


def _maybe_ban(db: Database, provider_id: str, ban_after: int, now: int) -> tuple[str, ...]:
    from gpumarket.broker import providers

    fails = db.execute("SELECT count(*) FROM checks WHERE liar = ?", [provider_id]).fetchone()[0]
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
    from gpumarket.broker import jobs

    stop = jobs.end_check_job(db, c["id"], why, now)
    _close(db, c, "cancelled", why, None, now, finish)
    return stop


def drop(db: Database, top_id: str, now: int) -> None:
    """The job ended (failed, cancelled): its open checks end too."""
    for (check_id,) in db.execute(f"SELECT id FROM checks WHERE top_id = ? AND state IN"
                                  f" ({', '.join('?' * len(OPEN))})", [top_id, *OPEN]).fetchall():
        c = _check(db, check_id)
        from gpumarket.broker import jobs

        jobs.end_check_job(db, check_id, "the job it checks ended", now)
        db.execute("UPDATE checks SET state = 'cancelled', detail = ?, ended_at_ms = ? WHERE"
                   " id = ?", ["the job it checks ended", now, c["id"]])
        seq = c["settle_seq"]
        if seq is not None and ledger.posted(db, f"resolve:{seq}") is None:
            ledger.resolve(db, seq, True, now)
    db.execute("DELETE FROM artifact_refs WHERE job_id = ? AND role = 'evidence'", [top_id])


def waiting_too_long(db: Database, before_ms: int) -> list[str]:
    """Checks still queued (no provider could take them) since before ``before_ms``."""
    return [r[0] for r in db.execute(
        "SELECT c.id FROM checks c JOIN jobs j ON j.id = c.id WHERE c.state = 'queued'"
        " AND j.state = ? AND c.created_at_ms < ?", [QUEUED, before_ms]).fetchall()]


def skip(db: Database, check_id: str, why: str, now: int) -> list[tuple[str, int, str]]:
    c = _check(db, check_id)
    if c is None or c["state"] not in OPEN:
        return []
    from gpumarket.broker import jobs

    stop = jobs.end_check_job(db, check_id, why, now)
    if c["role"] == "tiebreak":
        first = _check(db, c["first_check"])
        db.execute("UPDATE checks SET state = 'inconclusive', ended_at_ms = ? WHERE id = ?",
                   [now, first["id"]])
        _close(db, c, "inconclusive", f"the first check disagreed and {why}", None, now)
    else:
        _close(db, c, "skipped", why, None, now)
    return stop


# -- reading --------------------------------------------------------------------------------

STATUS_WORDS = ("unverified", "checking", "verified", "disputed -> re-run", "inconclusive")


def summary(db: Database, job_id: str) -> str:
    """One word for a client: how the job's work (all its parts) was checked."""
    states = [r[0] for r in db.execute(
        "SELECT state FROM checks WHERE top_id = ? OR job_id = ?", [job_id, job_id]).fetchall()]
    if "failed" in states:
        return "disputed -> re-run"
    if any(s in OPEN for s in states):
        return "checking"
    if "passed" in states:
        return "verified"
    if "inconclusive" in states:
        return "inconclusive"
    return "unverified"


def view(db: Database, job_id: str) -> pb.JobVerification:
    out = pb.JobVerification(status=summary(db, job_id))
    job = db.execute("SELECT provider_id, needs FROM jobs WHERE id = ?", [job_id]).fetchone()
    if job is not None and job[0]:
        asked = json.loads(job[1]).get("verify_rate", 0.0)
        out.rate = max(float(asked), provider_rate(db, job[0]))
    for c in [_check(db, r[0]) for r in db.execute(
            "SELECT id FROM checks WHERE top_id = ? OR job_id = ? ORDER BY created_at_ms, id",
            [job_id, job_id]).fetchall()]:
        state = "tie-break" if c["state"] == "disagreed" else c["state"]
        out.checks.append(pb.Check(
            check_id=c["id"], job_id=c["job_id"], provider_id=c["provider_id"],
            checker_id=c["checker_id"] or "", state=state, detail=c["detail"],
            what=what(c["step_from"], c["step_to"], json.loads(c["scope"])),
            created_at_ms=c["created_at_ms"], ended_at_ms=c["ended_at_ms"] or 0))
    return out


def standings(db: Database) -> dict[str, tuple[float, int, int]]:
    """Per provider with a record: (check rate now, passed since its last failure, failures)."""
    out = {}
    for (pid,) in db.execute("SELECT DISTINCT provider_id FROM checks UNION"
                             " SELECT DISTINCT liar FROM checks WHERE liar IS NOT NULL"):
        streak, _, fails = record(db, pid)
        out[pid] = (rate(streak), streak, fails)
    return out

