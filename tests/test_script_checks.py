"""Spot checks of ``script`` jobs (issue 34): a script is checked only where its job declares
how its outputs compare (``outputs_compare``); the check replays the last lease's work on
another provider and compares every output file by that rule, and a mismatch goes the way of
every check (tie-break, conviction, re-run). The rules run here on a real SQLite file
through the broker's own transactions, as tests/test_verification_rules.py runs them;
tests/test_verification.py has a cheating script provider end to end."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest

from gpumarket.broker.checks import disputes
from gpumarket.broker.checks import verification
from gpumarket.broker.jobs import endings
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.money import ledger
from gpumarket.client import jobfile
from gpumarket.kinds import script
from gpumarket.kinds.schema import ParamError
from gpumarket.proto.errors import JobFileError
from gpumarket.proto.v1 import types_pb2 as pb
from tests.helpers import BIN
from tests.test_ledger import new_job
from tests import test_verification_rules as verification_rules
from tests.test_verification_rules import (CHECK, NO_CHECK, checkpoint, checks, receipt,
                                           replay, start)

OUTPUTS = ["result.json", "samples.bin"]


# The broker's store with a client in funds and four providers online.
w = verification_rules.w


def script_job(job_id: str, rule: str, **more):
    """A script job whose signed spec declares ``outputs_compare = rule``."""
    values = {"code": "code.tar", "entry": "main.py", "args": [], "steps": 0,
              "checkpoint_every": 0, "outputs_compare": rule, "outputs_rtol": 0.0,
              "outputs_atol": 0.0, **more}
    spec = pb.JobSpec()
    script.KIND.write(spec, values)
    job = new_job(job_id, "ca", 500_000, True)
    return dataclasses.replace(
        job, spec=pb.Envelope(payload=spec.SerializeToString()).SerializeToString(),
        needs=dataclasses.replace(job.needs, kind=pb.JOB_KIND_SCRIPT))


def finish(w, job_id: str, provider: str, policy=CHECK) -> None:
    w.now += 60_000
    w.write(jobs.succeed, job_id, w.job(job_id)["epoch"], provider,
            receipt(job_id, provider, OUTPUTS, w), w.now, policy)


def files(tmp_path, name: str, **contents: bytes) -> dict:
    """Output files by name, as the broker's blob paths give them to a compare."""
    root = tmp_path / name
    root.mkdir()
    out = {}
    for fname, data in contents.items():
        out[fname.replace("_", ".", 1)] = p = root / fname
        p.write_bytes(data)
    return out


HONEST = {"result_json": b'{"loss": 0.25, "steps": [1, 2, 3]}', "samples_bin": b"\x00\x01"}


def test_a_script_that_declares_no_rule_is_never_checked_and_reads_unverified(w):
    w.write(jobs.submit, script_job("s", "none"), w.now)
    start(w, "s", "h1")
    finish(w, "s", "h1")
    assert checks(w, "s") == {}
    assert w.job("s")["state"] == jobs.SUCCEEDED
    v = verification.view(w.db, "s")
    assert (v.status, v.rate) == ("unverified", 0)          # never "passed", no rate named
    assert ledger.balance(w.db, ledger.provider("h1")) > 0  # paid as its receipt says
    # The same script declaring a rule, on the same new provider: checked at its rate.
    w.write(jobs.submit, script_job("e", "exact"), w.now)
    start(w, "e", "h1")
    assert verification.view(w.db, "e").rate == 1


def test_an_honest_deterministic_script_is_replayed_whole_and_verified(w, tmp_path):
    w.write(jobs.submit, script_job("j", "exact"), w.now)
    start(w, "j", "h1")
    finish(w, "j", "h1")
    (check_id,) = checks(w, "j")
    c = checks(w, "j")[check_id]
    assert set(json.loads(c["expect"])) == set(OUTPUTS)        # every delivered file
    assert (c["step_from"], c["start"]) == (0, None)           # the whole run
    assert w.job("j")["state"] == verification.VERIFYING
    assert ledger.balance(w.db, ledger.provider("h1")) == 0    # held while checked
    replay(w, check_id, "h2")
    agrees, detail = script.KIND.compare(files(tmp_path, "provider", **HONEST),
                                         files(tmp_path, "replay", **HONEST),
                                         json.loads(c["scope"]))
    assert agrees, detail
    w.write(disputes.conclude, check_id, agrees, False, detail, w.now)
    assert checks(w, "j")[check_id]["state"] == "passed"
    assert w.job("j")["state"] == jobs.SUCCEEDED
    assert verification.summary(w.db, "j") == "verified"
    assert ledger.balance(w.db, ledger.provider("h1")) > 0
    assert ledger.audit(w.db) == []


def test_a_cheating_script_provider_is_caught_unpaid_and_its_job_re_run(w, tmp_path):
    """The cheat delivers a result.json other than the script writes: the checker's replay
    differs, a tie-break agrees with the checker, and the cheat keeps nothing."""
    w.write(jobs.submit, script_job("j", "exact"), w.now)
    start(w, "j", "liar")
    finish(w, "j", "liar")
    (first,) = checks(w, "j")
    scope = json.loads(checks(w, "j")[first]["scope"])
    doctored = files(tmp_path, "liar", **{**HONEST, "result_json": b'{"loss": 0.1}'})
    replay(w, first, "h1")
    agrees, detail = script.KIND.compare(doctored, files(tmp_path, "h1", **HONEST), scope)
    assert not agrees and detail.startswith("result.json differs"), detail
    w.write(disputes.conclude, first, agrees, False, detail, w.now)
    tiebreak = next(c for c, row in checks(w, "j").items() if row["first_check"] == first)
    assert verification.excluded(w.db, tiebreak) == {"liar", "h1"}
    replay(w, tiebreak, "h2")
    h2 = files(tmp_path, "h2", **HONEST)
    agrees, _ = script.KIND.compare(doctored, h2, scope)
    agrees_first, _ = script.KIND.compare(files(tmp_path, "h1b", **HONEST), h2,
                                          {**scope, "replays": True})
    out = w.write(disputes.conclude, tiebreak, agrees, agrees_first, "tie-break", w.now)
    assert checks(w, "j")[tiebreak]["liar"] == "liar"
    assert ledger.balance(w.db, ledger.provider("liar")) == 0
    assert ledger.balance(w.db, ledger.disputed("j", "liar")) == 0
    assert w.job("j")["state"] == jobs.QUEUED                # re-run, never by the cheat
    assert "liar" in verification.excluded(w.db, "j")
    assert verification.summary(w.db, "j") == "disputed -> re-run"
    assert not out.banned                                     # its first failure
    assert ledger.audit(w.db) == []


def test_a_script_conviction_costs_the_job_and_the_record_never_the_stake_or_a_ban(w):
    """A client's script can behave differently on one provider's host and have two honest
    checkers convict it: a conviction on a client's declared rule costs the pay and resets
    the record (checked at rate 1 again), but takes no stake and never bans; two of them on
    the same provider leave it unbanned, its stake whole."""
    w.write(ledger.credit, "liar", 10**6, "stake", "", "op", "stake-liar", 1)
    for job_id in ("j", "k"):
        w.write(jobs.submit, script_job(job_id, "exact"), w.now)
        start(w, job_id, "liar")
        finish(w, job_id, "liar")
        (first,) = checks(w, job_id)
        replay(w, first, "h1")
        w.write(disputes.conclude, first, False, False, "result.json differs", w.now)
        tiebreak = next(c for c, r in checks(w, job_id).items() if r["first_check"] == first)
        replay(w, tiebreak, "h2")
        out = w.write(disputes.conclude, tiebreak, False, True, "tie-break", w.now)
        assert checks(w, job_id)[tiebreak]["liar"] == "liar"
        assert not out.banned
        assert ledger.balance(w.db, ledger.provider("liar")) == 0
    assert ledger.balance(w.db, ledger.stake("liar")) == 10**6
    assert w.db.execute("SELECT banned FROM providers WHERE id = 'liar'").fetchone()[0] == 0
    assert verification.record(w.db, "liar")[2] == 2
    assert verification.provider_rate(w.db, "liar") == 1.0
    assert ledger.audit(w.db) == []


def test_three_different_runs_pay_the_script_as_run_and_read_unverified(w):
    """No two of three runs agree: the script is not deterministic as its client declared.
    Its provider and the replays are paid, nobody is counted against, and the work is
    unverified (the client does not get the run for free by declaring a rule falsely)."""
    w.write(jobs.submit, script_job("j", "json", outputs_rtol=1e-6), w.now)
    start(w, "j", "h1")
    finish(w, "j", "h1")
    (first,) = checks(w, "j")
    replay(w, first, "h2")
    w.write(disputes.conclude, first, False, False, "result.json differs", w.now)
    tiebreak = next(c for c, row in checks(w, "j").items() if row["first_check"] == first)
    replay(w, tiebreak, "h3")
    w.write(disputes.conclude, tiebreak, False, False, "result.json differs", w.now)
    c = checks(w, "j")
    assert c[first]["state"] == c[tiebreak]["state"] == "inconclusive"
    assert "not deterministic" in c[tiebreak]["detail"]
    assert not any(row["liar"] for row in c.values())
    for p in ("h1", "h2", "h3"):
        assert ledger.balance(w.db, ledger.provider(p)) > 0, p
    assert w.job("j")["state"] == jobs.SUCCEEDED
    assert verification.summary(w.db, "j") == "unverified"
    assert ledger.audit(w.db) == []


def test_a_script_run_that_delivered_nothing_is_checked_all_the_same(w):
    """A cheat that skips the work and delivers no file at all is still checked: the
    replay's files are compared with none."""
    w.write(jobs.submit, script_job("j", "exact"), w.now)
    start(w, "j", "liar")
    w.now += 60_000
    w.write(jobs.succeed, "j", w.job("j")["epoch"], "liar", receipt("j", "liar", [], w),
            w.now, CHECK)
    (check_id,) = checks(w, "j")
    assert json.loads(checks(w, "j")[check_id]["expect"]) == {}
    assert w.job("j")["state"] == verification.VERIFYING


def test_a_resumed_script_is_replayed_from_the_checkpoint_its_lease_started_at(w):
    """The last lease resumed from another provider's checkpoint: its work (step 10 on) is
    replayed from that checkpoint, and only the last lease's provider answers for it."""
    w.write(jobs.submit, script_job("j", "exact"), w.now)
    start(w, "j", "h1")
    checkpoint(w, "j", "h1", 10, NO_CHECK)       # a script's checkpoint: never a check
    assert checks(w, "j") == {}
    h1_ref = json.loads(w.job("j")["resume_from"])
    w.write(endings.lose_lease, w.job("j")["lease_id"], "gone", w.now)
    start(w, "j", "h2")
    finish(w, "j", "h2")
    (check_id,) = checks(w, "j")
    c = checks(w, "j")[check_id]
    assert (c["provider_id"], c["step_from"]) == ("h2", 10)
    assert json.loads(c["start"])["sha256"] == h1_ref["sha256"]
    assert verification.excluded(w.db, check_id) == {"h2"}
    assert "from step 10" in verification.view(w.db, "j").checks[0].what


def test_outputs_compare_every_file_by_the_declared_rule(tmp_path):
    exact = {"outputs": "exact", "rtol": 0.0, "atol": 0.0}
    loose = {"outputs": "json", "rtol": 1e-6, "atol": 1e-12}
    base = files(tmp_path, "a", **{"out_json": b'{"x": 1.0, "y": [0.5, "s"]}',
                                   "log_jsonl": b'{"v": 2}\n{"v": 3}\n', "raw_bin": b"\x01"})

    def other(name: str, **change: bytes) -> dict:
        return files(tmp_path, name, **{"out_json": base["out.json"].read_bytes(),
                                        "log_jsonl": base["log.jsonl"].read_bytes(),
                                        "raw_bin": b"\x01", **change})

    compare = script.KIND.compare
    assert compare(base, other("same"), exact)[0]
    reordered = other("reordered", out_json=b'{"y": [0.5000000001, "s"], "x": 1}')
    assert not compare(base, reordered, exact)[0]           # bytes differ
    assert compare(base, reordered, loose)[0]               # by value, within 1e-6
    assert compare(base, other("lines", log_jsonl=b'{"v":2}\n{"v":3.000000001}\n'), loose)[0]
    far = other("far", out_json=b'{"x": 1.001, "y": [0.5, "s"]}')
    agrees, why = compare(base, far, loose)
    assert not agrees and why == "out.json differs at /x (1.0 against 1.001)", why
    assert not compare(base, other("text", out_json=b'{"x": 1.0, "y": [0.5, "t"]}'), loose)[0]
    assert not compare(base, other("bin", raw_bin=b"\x02"), loose)[0]   # not JSON: bytes
    # Every delivered file: one missing or one extra is a mismatch.
    missing = dict(base)
    del missing["raw.bin"]
    agrees, why = compare(base, missing, exact)
    assert not agrees and why == "the replay returned no raw.bin"
    agrees, why = compare(missing, base, exact)
    assert not agrees and why == "the checked result has no raw.bin"
    assert compare({}, {}, exact)[0]                        # nothing, as the replay
    agrees, why = compare({}, base, exact)                  # a run that delivered nothing
    assert not agrees and why.startswith("the checked result has no "), why


@pytest.mark.parametrize("table, problem", [
    ('outputs_compare = "bitwise"',
     "field 'script.outputs_compare' must be one of ['exact', 'json', 'none']"),
    ('outputs_compare = "exact"\noutputs_rtol = 0.01',
     "field 'script.outputs_rtol' a tolerance needs outputs_compare = \"json\" (it is"
     " 'exact')"),
    ('outputs_compare = "json"\noutputs_rtol = 2.0',
     "field 'script.outputs_rtol' must be between 0.0 and 1.0"),
])
def test_a_bad_outputs_compare_is_refused_at_submit_in_one_line(tmp_path, table, problem):
    (tmp_path / "main.py").write_text("print('hi')\n")
    path = tmp_path / "job.toml"
    path.write_text(f'kind = "script"\nname = "s"\nmax_price = 1.0\n\n[script]\n'
                    f'code = "main.py"\n{table}\n')
    with pytest.raises(JobFileError) as caught:
        jobfile.load(path)
    assert problem in str(caught.value) and "\n" not in str(caught.value), caught.value
    # The broker checks a signed spec by the same schema.
    values = script.KIND.param("outputs_compare")
    with pytest.raises(ParamError):
        values.check("bitwise", "script")


def test_the_cli_refuses_a_bad_outputs_compare_in_one_line(tmp_path):
    (tmp_path / "main.py").write_text("print('hi')\n")
    path = tmp_path / "job.toml"
    path.write_text('kind = "script"\nname = "s"\nmax_price = 1.0\n\n[script]\n'
                    'code = "main.py"\noutputs_compare = "bitwise"\n')
    r = subprocess.run([str(BIN / "gpumarket"), "--broker", "127.0.0.1:9", "submit",
                        str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "outputs_compare' must be one of" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
