"""Spot checks: the broker replays part of a provider's work on another provider and compares
(docs/verification.md). No grpc here; every function runs inside one write transaction.

A check is a job row of its own (``check_of`` = the job it checks, ``pays_from`` = the job
whose hold pays its checker) that the scheduler leases like any job, to a provider that is
neither the checked one nor, for a tie-break, the first checker. Its lease carries a
CheckScope: a training segment (resume from the checkpoint at ``step_from``, stop at
``step_to``), some rows of an inference job, or some frames of a render. What it returns is
compared with what the checked provider returned (``expect``) in the scheduler's loop
(broker/checks/verdicts.py reads the blobs), and broker/checks/disputes.py applies the verdict.

How often (BOINC's adaptive replication): a provider with ``streak`` checks passed since its
last failure has each segment checked with probability ``rate(streak)``: 1 for a new one
until it has passed WARMUP, then falling to FLOOR; a failure sets the streak back to 0. A
job's ``verify_rate`` raises it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection

from google.protobuf.message import DecodeError
from sqlite_utils import Database

from gpumarket import kinds
from gpumarket.broker.checks.policy import BAN_AFTER, OFF, Policy  # noqa: F401 (its callers')
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.money import ledger
from gpumarket.broker.store import blob_holdings
from gpumarket.kinds import arrays as task_arrays
from gpumarket.kinds import render as render_kind
from gpumarket.kinds.schema import ParamError
from gpumarket.proto.errors import InvalidArgument
from gpumarket.proto.v1 import types_pb2 as pb

FLOOR = 0.05          # the rate of a provider with a long clean record
WARMUP = 20           # checks a provider must pass in a row before its rate falls below 1
OPEN = ("queued", "running", "returned", "disagreed")

QUEUED = pb.JOB_STATE_QUEUED
VERIFYING = pb.JOB_STATE_VERIFYING


def rate(streak: int) -> float:
    """The share of a provider's segments to check after ``streak`` passed checks in a row:
    every one until WARMUP have passed, then WARMUP / (streak + 1), down to FLOOR (reached at
    400). bench/verification.py measures what this catches and costs."""
    return 1.0 if streak < WARMUP else max(FLOOR, WARMUP / (streak + 1))


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
    return max(client_share(job), provider_rate(db, provider_id))


def client_share(job: dict) -> float:
    """The share of a job's segments whose checks its client pays for: what it asked
    (verify), at least FLOOR, the rate of a provider with a long clean record. Checks above
    it are a new provider's warm-up, paid by that provider (disputes.charge_warmups)."""
    return max(float(json.loads(job["needs"]).get("verify_rate", 0.0)), FLOOR)


def _new_id() -> str:
    """A check's name: fresh and random, the form of a job's id, saying nothing of the job it
    checks. It is its job row's id, so the lease's job_id and lease_id the checker sees."""
    return secrets.token_hex(8)


def _ref(ref: dict | None) -> str | None:
    return json.dumps(ref) if ref else None


def choose(db: Database, policy: Policy, job: dict, lease: dict, step_from: int, step_to: int,
           start: dict | None, expect: dict[str, dict], scope: dict, now: int) -> str | None:
    """Decide whether to check the segment (step_from, step_to] of ``lease``'s work on
    ``job`` (its result: ``expect``, {name: ArtifactRef as a dict}); if so, hold its
    settlement and queue the check. Returns the check's id, or None."""
    # (a script's run is checked even where it delivered nothing: the replay's files say
    # whether it should have)
    if not policy.enabled or job["check_of"] or not (expect or scope.get("outputs")):
        return None
    if json.loads(job["needs"]).get("remote_code"):
        return None     # its model's own code runs: a replay need not behave the same
    if policy.draw >= _job_rate(db, job, lease["provider_id"]):
        return None
    if not policy.can_check(lease["accelerator"]):
        note(db, job, f"{what(step_from, step_to, scope)} left unchecked: no other provider"
               " of its device class online to replay it", now)
        return None
    seq = ledger.posted(db, f"settle:{lease['id']}:{step_to}") or ledger.posted(
        db, f"settle:{lease['id']}:final")
    if seq is not None and ledger.posted(db, f"dispute:{seq}") is None:
        ledger.dispute(db, seq, now)
    # The same draw says who pays: below the client's share, the client (as for a provider
    # with a long record); above it, the check is there only because the provider is new.
    paid_by = lease["provider_id"] if policy.draw >= client_share(job) else None
    return queue(db, job, lease["provider_id"], lease["id"], seq, step_from, step_to, start,
                  expect, scope, "check", None, now, paid_by)


def choose_segment(db: Database, policy: Policy, job: dict, lease: dict, step: int,
                   ref: dict, now: int) -> str | None:
    """At a checkpoint: perhaps check a training segment (since the previous checkpoint,
    replayed from it on another provider). Called before the job's row records ``ref``."""
    if kinds.get(job["kind"]).verify != "replay":
        return None
    return _replay(db, policy, job, lease, step, {"checkpoint.tar": ref}, now)


def _replay(db: Database, policy: Policy, job: dict, lease: dict, step_to: int,
            expect: dict, now: int) -> str | None:
    """Perhaps check the training segment from the job's latest checkpoint to ``step_to``."""
    return choose(db, policy, job, lease, job["checkpoint_step"], step_to,
                  json.loads(job["resume_from"]) if job["resume_from"] else None, expect, {},
                  now)


def choose_final(db: Database, policy: Policy, job: dict, lease: dict, total: int,
                 outputs: dict, receipt: pb.Receipt, now: int) -> str | None:
    """At the receipt: perhaps check the work of the lease since its last checkpoint
    (training), or some rows or frames of what it returned (the kind picks them)."""
    kind = kinds.get(job["kind"])
    names = kind.evidence(set(outputs))
    if kind.verify == "replay":
        return _replay(db, policy, job, lease, total, {n: outputs[n] for n in names}, now)
    if not kind.verify or not names and kind.verify != "outputs":
        return None
    values = _values(kind, job)
    if not kind.checked(values):
        return None
    # Only this lease's own work: rows or frames done before it resumed were another's.
    scope = kind.check_scope(values, job["part"], job["parts"], dict(receipt.metrics),
                             lease["start_step"])
    if not scope:
        return None
    if kind.verify == "outputs":
        # The whole of the lease's work, replayed from where it started: the checkpoint it
        # resumed from (another lease's), or the start; every file it delivered compared.
        start = resumed_from(db, job["id"], lease)
        if lease["start_step"] and start is None:
            note(db, job, f"steps {lease['start_step']}-{total} left unchecked: the"
                 " checkpoint they resumed from is no longer kept", now)
            return None
        # (A script need report no progress: its run ends no earlier than it started.)
        return choose(db, policy, job, lease, lease["start_step"],
                      max(total, lease["start_step"]), start, {n: outputs[n] for n in names},
                      scope, now)
    claimed = kind.check_claimed(outputs)
    if claimed:
        scope["claimed"] = claimed     # the check prefills its tokens (it may read them)
    return choose(db, policy, job, lease, lease["start_step"], total, None,
                  {n: outputs[n] for n in names}, scope, now)


def _values(kind: kinds.Kind, job: dict) -> dict:
    """The job's parameters, from its signed spec."""
    spec = pb.Envelope.FromString(job["spec"])
    return kind.values_of(pb.JobSpec.FromString(spec.payload))


def resumed_from(db: Database, job_id: str, lease: dict) -> dict | None:
    """The checkpoint (ArtifactRef as a dict) ``lease`` resumed the job from: the latest kept
    one at its start step written by another lease; None for a lease that started at 0 or
    one whose start is no longer kept."""
    if not lease["start_step"]:
        return None
    row = db.execute("SELECT ref FROM checkpoint_history WHERE job_id = ? AND step = ? AND"
                     " lease_id != ? AND dropped = 0 ORDER BY seq DESC LIMIT 1",
                     [job_id, lease["start_step"], lease["id"]]).fetchone()
    return json.loads(row[0]) if row else None


def queue(db: Database, job: dict, provider_id: str, lease_id: str, seq: int | None,
           step_from: int, step_to: int, start: dict | None, expect: dict, scope: dict,
           role: str, first: str | None, now: int, paid_by: str | None = None) -> str:
    check_id = _new_id()
    top = job["parent_id"] or job["id"]
    db["checks"].insert({
        "id": check_id, "job_id": job["id"], "top_id": top, "provider_id": provider_id,
        "lease_id": lease_id, "settle_seq": seq, "step_from": step_from, "step_to": step_to,
        "scope": json.dumps(scope), "start": _ref(start), "expect": json.dumps(expect),
        "role": role, "first_check": first, "state": "queued", "created_at_ms": now,
        "paid_by": paid_by})
    needs = json.loads(job["needs"])
    accel = db.execute("SELECT accelerator FROM leases WHERE id = ?", [lease_id]).fetchone()
    if accel and accel[0]:
        needs["accelerator"] = accel[0]     # replayed on the same device class: compared exactly
    jobs.spawn(db, job, "check", check_id,
               f"{role} of {job['name']} ({what(step_from, step_to, scope)})", now,
               needs=json.dumps(needs, sort_keys=True), resume_from=_ref(start),
               checkpoint_step=step_from, progress_step=step_from, progress_total=step_to)
    # The checker may read the job's inputs and the checkpoint it starts from; the result it
    # is compared with is kept for the job as evidence, which no provider may read (it must
    # not copy it; views.may_read).
    for sha in {r[0] for r in db.execute("SELECT sha256 FROM artifact_refs WHERE job_id = ?"
                                         " AND role = 'input'", [top]).fetchall()}:
        blob_holdings.refer(db, sha, check_id, "input")
    if scope.get("claimed"):
        # the checked provider's tokens, which a check by fingerprints prefills (never the
        # fingerprints it is compared with: those stay evidence)
        blob_holdings.refer(db, scope["claimed"]["sha256"], check_id, "input")
    if start:
        blob_holdings.refer(db, start["sha256"], check_id, "checkpoint")
    for ref in expect.values():
        blob_holdings.refer(db, ref["sha256"], top, "evidence")
    jobs.append_event(db, check_id, "submitted", QUEUED, 1, now,
                      message=f"{role} of {provider_id}'s {what(step_from, step_to, scope)}")
    note(db, job, f"{role} {check_id} queued: {what(step_from, step_to, scope)} of"
           f" {provider_id}'s work will be replayed on another provider"
           + (f" (a warm-up check: {paid_by} pays for it)" if paid_by else ""), now)
    return check_id


def what(step_from: int, step_to: int, scope: dict) -> str:
    if scope.get("tasks"):
        tasks = scope["tasks"]
        # (a sample of up to a quarter of 1,000 tasks is named by its range, as a render's)
        named = (f"task{'s' if len(tasks) > 1 else ''} {task_arrays.format_indices(tasks)}"
                 if len(tasks) <= 8 else f"{len(tasks)} tasks drawn from {min(tasks)}-"
                 f"{max(tasks)}")
        return (f"{named} ({len(tasks)} of the {scope.get('of_tasks', len(tasks))} a lease"
                f" ran): every output file, compared {scope['outputs']}")
    if scope.get("outputs"):
        start = f"from step {step_from}" if step_from else "from the start"
        return f"the run {start}: every output file, compared {scope['outputs']}"
    if scope.get("answers"):
        return (f"{scope['answers']} sampled answer{'s' if scope['answers'] > 1 else ''} of"
                f" {scope.get('of_answers', scope['answers'])} in a window, "
                + ("embedded again: vectors" if scope.get("task") == "embed" else
                   "prefilled: fingerprints"))
    if scope.get("batch_size"):
        how = ", prefilled: fingerprints" if scope.get("claimed") else ""
        return f"a batch of {scope['batch_size']} rows from row {step_from} on{how}"
    if scope.get("frames"):
        out = render_kind.said_frames(scope["frames"])
        if scope.get("preview"):
            first, last = scope["preview"]
            out += f"; frames {first}-{last} at a quarter's resolution"
        return out
    return f"steps {step_from}-{step_to}"


def note(db: Database, job: dict, message: str, now: int) -> None:
    state = db.execute("SELECT state, attempt FROM jobs WHERE id = ?", [job["id"]]).fetchone()
    jobs.append_event(db, job["id"], "check", state[0], state[1], now, message=message,
                      mirror=False)


def check_row(db: Database, check_id: str) -> dict | None:
    cur = db.execute("SELECT * FROM checks WHERE id = ?", [check_id])
    row = cur.fetchone()
    return dict(zip([d[0] for d in cur.description], row)) if row else None


def role(db: Database, check_id: str) -> str | None:
    """"check" or "tiebreak" for a check's job row; None for any other job."""
    row = db.execute("SELECT role FROM checks WHERE id = ?", [check_id]).fetchone()
    return row[0] if row else None


def scope_of(db: Database, check_id: str) -> pb.CheckScope | None:
    """The CheckScope a lease of this check's job row carries (None: not a check): what to
    replay, never whose work or which job's (docs/verification.md, What a checker learns)."""
    c = check_row(db, check_id)
    if c is None:
        return None
    scope = json.loads(c["scope"])
    return pb.CheckScope(step_from=c["step_from"],
                         step_to=c["step_to"], frames=scope.get("frames", []),
                         position=scope.get("position", 0.0),
                         batch_size=scope.get("batch_size", 0),
                         claimed=pb.ArtifactRef(**scope["claimed"]) if scope.get("claimed")
                         else None)


DISPUTED = ("disagreed", "inconclusive")    # a check's states that leave its provider in doubt


def found_wrong(db: Database, top_ids: Collection[str]) -> dict[str, frozenset[str]]:
    """By submitted job (of ``top_ids``: a job's, a split job's, an array's, an endpoint's
    id), the providers a check found wrong on any of its rows, as the provider of the work
    or as a checker; jobs with none are left out. One statement for a whole placement pass
    (placement.read_queue): a pass whose queued jobs have no conviction on record pays that
    one read, not one a job."""
    out: dict[str, set[str]] = {}
    if not top_ids:
        return {}
    for top, liar in db.execute(
            "SELECT DISTINCT top_id, liar FROM checks WHERE liar IS NOT NULL AND top_id IN"
            " (SELECT value FROM json_each(?))", [json.dumps(sorted(set(top_ids)))]).fetchall():
        out.setdefault(top, set()).add(liar)
    return {top: frozenset(liars) for top, liars in out.items()}


def disputed(db: Database, top_id: str) -> frozenset[str]:
    """Providers whose work on this job (any of its rows) a check disagreed with and no
    tie-break cleared: a tie-break still open, or one that settled nothing."""
    return frozenset(r[0] for r in db.execute(
        f"SELECT DISTINCT provider_id FROM checks WHERE top_id = ? AND state IN"
        f" ({', '.join('?' * len(DISPUTED))})", [top_id, *DISPUTED]).fetchall())


def excluded(db: Database, job_id: str) -> frozenset[str]:
    """Providers that must not run this job row (docs/verification.md, Who checks):

    - any row (a job, a part, an array's batch, a replica, a check): the providers a check
      found wrong on its job — a job gives no more work to a provider caught lying on it,
      whatever the row's attempt, and nor does a check of it (``found_wrong``);
    - a check besides: the provider it checks; whoever resumed the job from the checked
      result (it could copy it instead of replaying); for a tie-break the first checker;
      and every provider whose work on the same job is in dispute (``disputed``): a
      provider in doubt on a job never judges others' work on it, where it could frame an
      honest one or pass a partner's."""
    c = check_row(db, job_id)
    if c is None:
        row = db.execute("SELECT parent_id FROM jobs WHERE id = ?", [job_id]).fetchone()
        top = (row[0] if row else None) or job_id
        return found_wrong(db, [top]).get(top, frozenset())
    out = set(found_wrong(db, [c["top_id"]]).get(c["top_id"], ()))
    out |= disputed(db, c["top_id"])
    out.add(c["provider_id"])
    out |= {r[0] for r in db.execute("SELECT provider_id FROM leases WHERE job_id = ? AND"
                                     " start_step >= ?", [c["job_id"], c["step_to"]])}
    if c["first_check"]:
        first = check_row(db, c["first_check"])
        if first and first["checker_id"]:
            out.add(first["checker_id"])
    return frozenset(out)


def leased(db: Database, check_id: str, provider_id: str, now: int) -> None:
    db.execute("UPDATE checks SET checker_id = ?, state = 'running' WHERE id = ? AND state IN"
               " ('queued', 'running')", [provider_id, check_id])


def lease_scope(db: Database, check_id: str, provider_id: str, now: int
                ) -> pb.CheckScope | None:
    """A check's job row is leased (a reaction, jobs/reactions.py): the check runs on
    ``provider_id``; returns what the lease says it replays (``scope_of``)."""
    scope = scope_of(db, check_id)
    leased(db, check_id, provider_id, now)
    return scope


def checkpoint_stored(db: Database, policy: Policy, job: dict, lease: dict, step: int,
                      ref: dict, now: int) -> None:
    """A lease's checkpoint at ``step`` was stored (a reaction, jobs/reactions.py): keep it
    in the job's history, and perhaps check the segment it ends."""
    remember(db, job, lease, step, ref)
    choose_segment(db, policy, job, lease, step, ref, now)


def requeued(db: Database, check_id: str) -> None:
    db.execute("UPDATE checks SET state = 'queued' WHERE id = ? AND state = 'running'",
               [check_id])


def returned(db: Database, check_id: str, outputs: dict[str, dict], now: int) -> None:
    """The checker's receipt came: keep what it returned for the verdict (the scheduler's
    loop compares it, see ``to_compare``)."""
    # (a check of an array's tasks has them already: they came with its task results)
    kept = db.execute("SELECT outputs FROM checks WHERE id = ?", [check_id]).fetchone()
    outputs = {**json.loads(kept[0] if kept and kept[0] else "{}"), **outputs}
    db.execute("UPDATE checks SET outputs = ?, state = 'returned' WHERE id = ?",
               [json.dumps(outputs), check_id])
    top = db.execute("SELECT top_id FROM checks WHERE id = ?", [check_id]).fetchone()[0]
    for ref in outputs.values():
        blob_holdings.refer(db, ref["sha256"], top, "evidence")


def open_checks(db: Database, job_id: str) -> int:
    return db.execute(f"SELECT count(*) FROM checks WHERE job_id = ? AND state IN"
                      f" ({', '.join('?' * len(OPEN))})", [job_id, *OPEN]).fetchone()[0]


def remember(db: Database, job: dict, lease: dict, step: int, ref: dict) -> None:
    """Keep a checkpoint (and its blob) in the job's history until the job ends."""
    db["checkpoint_history"].insert({
        "job_id": job["id"], "step": step, "ref": json.dumps(ref), "lease_id": lease["id"],
        "provider_id": lease["provider_id"], "start_step": lease["start_step"]})
    blob_holdings.refer(db, ref["sha256"], job["id"], "history")


# -- reading --------------------------------------------------------------------------------

STATUS_WORDS = ("unverified", "checking", "verified", "disputed -> re-run")


def summary(db: Database, job_id: str) -> str:
    """One word for a client: how the job's work (all its parts) was checked. A check left
    inconclusive makes the work "unverified" whatever other checks passed: part of it was
    disputed and never settled."""
    states = [r[0] for r in db.execute(
        "SELECT state FROM checks WHERE top_id = ? OR job_id = ?", [job_id, job_id]).fetchall()]
    if "failed" in states:
        return "disputed -> re-run"
    if any(s in OPEN for s in states):
        return "checking"
    if "passed" in states and "inconclusive" not in states:
        return "verified"
    return "unverified"


def view(db: Database, job_id: str) -> pb.JobVerification:
    out = pb.JobVerification(status=summary(db, job_id))
    job = db.execute("SELECT provider_id, needs, kind, tasks, spec FROM jobs WHERE id = ?",
                     [job_id]).fetchone()
    # A rate only for work a check can replay: none for a kind that is never checked (a
    # script that declares no outputs_compare, an array of a built-in kind), or a model's
    # own code (docs/verification.md, What is not checked).
    if job is not None and _checkable(job[2], job[4]) \
            and not json.loads(job[1]).get("remote_code"):
        asked = float(json.loads(job[1]).get("verify_rate", 0.0))
        if job[3] and kinds.get(job[2]).verify == "outputs":
            # an array's leases, each at its provider's rate: at least the client's share
            out.rate = max(asked, FLOOR)
        elif job[0] and not job[3]:
            out.rate = max(asked, provider_rate(db, job[0]))
    for c in [check_row(db, r[0]) for r in db.execute(
            "SELECT id FROM checks WHERE top_id = ? OR job_id = ? ORDER BY created_at_ms, id",
            [job_id, job_id]).fetchall()]:
        state = "tie-break" if c["state"] == "disagreed" else c["state"]
        out.checks.append(pb.Check(
            check_id=c["id"], job_id=c["job_id"], provider_id=c["provider_id"],
            checker_id=c["checker_id"] or "", state=state, detail=c["detail"],
            what=what(c["step_from"], c["step_to"], json.loads(c["scope"])),
            created_at_ms=c["created_at_ms"], ended_at_ms=c["ended_at_ms"] or 0))
    return out


def _checkable(kind: int, spec: bytes) -> bool:
    """Whether work of this kind, with the parameters of this signed spec, can be checked
    (False for a kind this broker no longer knows, or a spec it cannot read)."""
    try:
        k = kinds.get(kind)
        if not k.verify:
            return False
        return k.checked(_values(k, {"spec": spec})) if k.verify == "outputs" else True
    except (InvalidArgument, ParamError, DecodeError):
        return False


def past_warm_up(db: Database) -> frozenset[str]:
    """The providers checked at less than the warm-up's full rate now: their endpoint
    replicas go without a sampled first answer each window (serving/answer_samples.py)."""
    return frozenset(p for p, (checked, _, _) in standings(db).items() if checked < 1)


def standings(db: Database) -> dict[str, tuple[float, int, int]]:
    """Per provider with a record: (check rate now, passed since its last failure, failures)."""
    out = {}
    for (pid,) in db.execute("SELECT DISTINCT provider_id FROM checks UNION"
                             " SELECT DISTINCT liar FROM checks WHERE liar IS NOT NULL"):
        streak, _, fails = record(db, pid)
        out[pid] = (rate(streak), streak, fails)
    return out
