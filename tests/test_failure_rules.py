"""The rules of a provider's reported failure on a real SQLite file, through the broker's own
transactions (endings.fail, the endpoints' crash loop and steering, reliability), the
gateway's check of a signed FailureReport, and the provider's report itself: a provider's
word alone fails nobody's work (docs/recovery.md)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from types import SimpleNamespace

import pytest
from gpumarket.broker.api.gateway import ProviderGatewayServicer
from gpumarket.broker.jobs import endings
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs.job import LeaseTerms
from gpumarket.broker.jobs import views
from gpumarket.broker.market import reliability
from gpumarket.broker.money import ledger
from gpumarket.broker.serving import endpoints
from gpumarket.broker.store.schema import migrations
from gpumarket.broker.store.store import Store
from gpumarket.proto.envelope import open_envelope, payload_sha256, seal
from gpumarket.proto.errors import BadSignature
from gpumarket.proto.identity import Identity
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider import failures
from gpumarket.provider.leases import Assignment
from sqlite_utils import Database

from tests.test_ledger import World, new_job, sign
from tests.test_serving_hostile_scaling import endpoint_job
from tests.test_verification_rules import CHECK, checkpoint, checks, start


@pytest.fixture
def w(tmp_path):
    world = World(tmp_path / "broker.db")
    for p in ("p1", "p2", "p3", "liar", "h1"):
        world.db["providers"].insert({"id": p, "public_key": b"", "first_seen_ms": 0,
                                      "last_seen_ms": 0, "online": 1})
    world.write(ledger.credit, "ca", 10**7, "client", "", "op", "k", 1)
    return world


def job(w: World, job_id: str = "j", max_attempts: int = 5) -> None:
    w.write(jobs.submit, dataclasses.replace(new_job(job_id, "ca", 2_000_000, True),
                                             max_attempts=max_attempts), w.now)


def fail(w: World, job_id: str, provider: str, error: str = "exit 1: ValueError",
         **kw) -> None:
    start(w, job_id, provider)
    w.now += 60_000
    w.write(lambda db: endings.fail(db, job_id, w.job(job_id)["epoch"], provider, error, w.now,
                                 **kw))


def outcomes(w: World, job_id: str) -> list[tuple[str, str]]:
    return [tuple(r) for r in w.db.execute(
        "SELECT provider_id, state FROM leases WHERE job_id = ? ORDER BY epoch", [job_id])]


def history(w: World, provider: str) -> reliability.ProviderHistory:
    return views.provider_history(w.db, provider, w.now)


def test_one_providers_report_requeues_the_job_elsewhere_unpaid(w):
    job(w)
    fail(w, "j", "p1", "CUDA error: an illegal memory access",
         log_tail=("Traceback (most recent call last):", "RuntimeError: CUDA error"))
    row = w.job("j")
    assert (row["state"], row["attempt"], row["error"]) == (jobs.QUEUED, 2, "")
    assert outcomes(w, "j") == [("p1", "failed")]
    assert views.previous_providers(w.db, "j") == {"p1"}      # placed elsewhere first
    assert ledger.balance(w.db, ledger.provider("p1")) == 0   # a minute of its time: unpaid
    assert ledger.job_money(w.db, "j")["charged"] == 0
    event = w.db.execute("SELECT type, message FROM events WHERE job_id = 'j'"
                         " ORDER BY seq DESC LIMIT 1").fetchone()
    assert event[0] == "requeued"
    assert event[1].startswith("p1 reports it failed: CUDA error: an illegal memory access;"
                               " attempt 2 starts over")
    assert event[1].endswith("\n    | RuntimeError: CUDA error")
    # Its reliability counts it as a lost lease would, until another provider confirms.
    h = history(w, "p1")
    assert (h.leases_failed, h.leases_lost, reliability.failures(h)) == (1, 0, 1)
    assert reliability.score(h) < reliability.score(history(w, "p3"))
    assert reliability.mtbf_s(h) < reliability.mtbf_s(history(w, "p3"))


def test_the_job_fails_once_two_providers_report_it_and_neither_is_blamed(w):
    job(w)
    fail(w, "j", "p1", "job exited with code 1: ValueError: bad row 7")
    fail(w, "j", "p2", "job exited with code 1: ValueError: bad row 7")
    row = w.job("j")
    assert row["state"] == jobs.FAILED
    assert row["error"] == ("failed on 2 providers: p1: job exited with code 1: ValueError:"
                            " bad row 7; p2: job exited with code 1: ValueError: bad row 7")
    assert outcomes(w, "j") == [("p1", "crashed"), ("p2", "crashed")]
    for p in ("p1", "p2"):
        assert reliability.failures(history(w, p)) == 0
    assert ledger.job_money(w.db, "j")["remaining"] == 0        # its hold went back
    assert ledger.audit(w.db) == []


def test_one_provider_alone_fails_a_job_only_by_using_up_its_attempts(w):
    job(w, max_attempts=3)
    for _ in range(2):
        fail(w, "j", "liar")
        assert w.job("j")["state"] == jobs.QUEUED
    fail(w, "j", "liar", "CUDA error")
    row = w.job("j")
    assert row["state"] == jobs.FAILED
    assert row["error"] == "gave up after 3 attempts; last: liar reports it failed: CUDA error"
    assert outcomes(w, "j") == [("liar", "failed")] * 3   # unconfirmed: all count against it
    assert reliability.failures(history(w, "liar")) == 3


def test_a_provider_that_failed_before_the_job_ran_never_counts_as_the_jobs_failure(w):
    job(w, max_attempts=3)
    fail(w, "j", "p1", "provider error while running", job_ran=False)
    fail(w, "j", "p2", "input fetch: connection reset", job_ran=False)
    assert w.job("j")["state"] == jobs.QUEUED                 # no two reports that it ran
    assert outcomes(w, "j") == [("p1", "lost"), ("p2", "lost")]
    assert w.db.execute("SELECT message FROM events WHERE job_id = 'j' AND type = 'requeued'"
                        " ORDER BY seq DESC").fetchone()[0].startswith(
        "p2 failed before the job ran: input fetch: connection reset")
    fail(w, "j", "p3", "job exited with code 1")
    assert "gave up after 3 attempts" in w.job("j")["error"]


def test_a_failed_check_job_still_means_the_replay_could_not_run(w):
    job(w)
    start(w, "j", "liar")
    checkpoint(w, "j", "liar", 10, CHECK)
    (check_id,) = checks(w, "j")
    fail(w, check_id, "h1", "out of memory")
    assert w.job(check_id)["state"] == jobs.FAILED              # no retry of a check
    assert checks(w, "j")[check_id]["state"] == "skipped"
    assert ledger.balance(w.db, ledger.provider("h1")) == 0     # its failed attempt: unpaid
    assert ledger.audit(w.db) == []


# -- endpoints: the crash loop counts providers, and steers replicas away ------------------

def replica_lease(w: World, replica: str, provider: str) -> int:
    w.now += 1000
    w.write(jobs.create_lease, LeaseTerms(replica, provider, (0,), 1.0, 60_000, 0), w.now, sign)
    epoch = w.job(replica)["epoch"]
    w.write(jobs.mark_started, replica, epoch, provider, w.now)
    return epoch


def replica_fails(w: World, replica: str, provider: str, error: str = "engine crashed"):
    epoch = replica_lease(w, replica, provider)
    w.now += 1000
    w.write(endings.fail, replica, epoch, provider, error, w.now)


def test_one_provider_failing_every_replica_never_fails_the_endpoint(w):
    """Was: six replicas in a row failed on any one provider failed the endpoint; each was a
    new job, leased to the same cheapest provider again."""
    w.write(endpoints.submit, endpoint_job(1, 2), w.now)
    replica = "ep-r1"
    for n in range(8):
        if w.job(replica)["state"] != jobs.QUEUED:    # used up its attempts: the autoscaler
            replica = w.write(endpoints.add_replica, "ep", w.now, "min_replicas")   # adds one
        replica_fails(w, replica, "liar")
        assert w.write(endpoints.crash_loop, "ep") == "", n
        avoid, exclude = w.write(endpoints.steer, "ep", w.now)
        assert avoid == {"liar"} and exclude == ({"liar"} if n >= 2 else set())
    # An hour later it gets another chance.
    assert w.write(endpoints.steer, "ep", w.now + endpoints.STEER_WINDOW_S * 1000) == (
        frozenset(), frozenset())


def test_replicas_failing_on_two_providers_fail_the_endpoint_naming_each(w):
    w.write(endpoints.submit, endpoint_job(1, 2), w.now)
    replica_fails(w, "ep-r1", "p1", "max_seq_len 512 is over max_position_embeddings 256")
    replica_fails(w, "ep-r1", "p2", "max_seq_len 512 is over max_position_embeddings 256")
    assert w.job("ep-r1")["state"] == jobs.FAILED           # two agree: that replica fails
    assert w.write(endpoints.crash_loop, "ep") == ""         # two failures: not yet a loop
    replica = w.write(endpoints.add_replica, "ep", w.now, "min_replicas")
    replica_fails(w, replica, "p1", "max_seq_len 512 is over max_position_embeddings 256")
    error = w.write(endpoints.crash_loop, "ep")
    assert error.startswith("replicas failed 3 times in a row before serving, on 2 providers:")
    assert "p1: max_seq_len 512" in error and "p2: max_seq_len 512" in error


def test_a_ready_replica_breaks_the_crash_loop_and_a_requeued_one_is_not_ready(w):
    w.write(endpoints.submit, endpoint_job(2, 2), w.now)
    replica_fails(w, "ep-r1", "p1")
    replica_fails(w, "ep-r1", "p2")
    epoch = replica_lease(w, "ep-r2", "p3")
    w.write(endpoints.mark_ready, "ep-r2", epoch, "p3", "batch", w.now)
    replica = w.write(endpoints.add_replica, "ep", w.now, "min_replicas", 3)
    replica_fails(w, replica, "p1")
    assert w.write(endpoints.crash_loop, "ep") == ""          # one failure since it served
    # A replica that served and is leased again is not ready until its new lease says so:
    # the autoscaler gives up on a lease not ready within cold_start.
    w.write(endings.lose_lease, w.job("ep-r2")["lease_id"], "missed heartbeats", w.now)
    assert w.job("ep-r2")["progress_step"] == 0


# -- the signed report: built by the provider, checked by the broker -----------------------

PROVIDER, OTHER = Identity.generate(), Identity.generate()


def assignment(job_id: str = "j", epoch: int = 1, spec_sha256: str = "ab" * 32) -> Assignment:
    lease = pb.Lease(job_id=job_id, epoch=epoch, lease_id=f"{job_id}.{epoch}")
    return Assignment(lease=lease, spec=pb.JobSpec(), client_id="ca", spec_sha256=spec_sha256)


def test_the_provider_signs_the_exit_status_and_its_log_tail_never_through_a_link(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.log").write_text("".join(f"line {i}\n" for i in range(30)) + "x" * 900)
    body = failures.failed(PROVIDER, assignment(), "job exited with code 1: boom", ran=True,
                           exit_code=1, workdir=work, owner=os.geteuid())
    report, signer = open_envelope(body.report, gw.FailureReport)
    assert signer == PROVIDER.id and report.provider_id == PROVIDER.id
    assert (report.job_id, report.epoch, report.job_ran, report.exit_code) == ("j", 1, True, 1)
    assert report.log_tail[-1] == "x" * failures.TAIL_CHARS
    assert len(report.log_tail) == failures.TAIL_LINES and report.log_tail[0] == "line 11"
    # A job that swapped its log for a link to the provider's key: no tail, nothing read.
    (work / "job.log").unlink()
    (tmp_path / "provider.key").write_text("secret")
    (work / "job.log").symlink_to(tmp_path / "provider.key")
    body = failures.failed(PROVIDER, assignment(), "boom", ran=True, workdir=work,
                           owner=os.geteuid())
    report, _ = open_envelope(body.report, gw.FailureReport)
    assert list(report.log_tail) == [] and not report.HasField("exit_code")
    # The provider failed before the job ran: no exit status, no log.
    report, _ = open_envelope(failures.failed(PROVIDER, assignment(), "fetch failed",
                                              ran=False).report, gw.FailureReport)
    assert not report.job_ran and list(report.log_tail) == []


@pytest.fixture
def gateway(tmp_path):
    store = Store(tmp_path / "gw.db")
    store.open()
    spec = pb.JobSpec(name="x", kind=pb.JOB_KIND_TRAINING)
    envelope = seal(Identity.generate(), spec)
    row = dataclasses.replace(new_job("j", "ca", 0, False),
                              spec=envelope.SerializeToString())
    asyncio.run(store.write(jobs.submit, row, 1))
    yield SimpleNamespace(state=SimpleNamespace(store=store)), payload_sha256(envelope)
    store.close()


def failed_update(body: gw.JobFailed, epoch: int = 1) -> gw.JobUpdate:
    return gw.JobUpdate(job_id="j", epoch=epoch, failed=body)


def test_the_broker_takes_a_failure_report_only_as_signed_for_this_lease(gateway):
    servicer, spec_sha = gateway

    def check(update):
        return asyncio.run(ProviderGatewayServicer._failure(servicer, PROVIDER.id, update))

    good = failures.failed(PROVIDER, assignment(spec_sha256=spec_sha), "exit 1: \x1b[2Jboom",
                           ran=True, exit_code=1)
    report = gw.FailureReport.FromString(good.report.payload)
    report.log_tail.extend(["\x1b]0;owned\x07last line"])
    resigned = gw.JobFailed(error="x", report=seal(PROVIDER, report))
    ran, error, tail = check(failed_update(resigned))
    assert (ran, error, tail) == (True, "exit 1: ?[2Jboom", ("?]0;owned?last line",))
    for body, epoch in (
            (failures.failed(OTHER, assignment(spec_sha256=spec_sha), "e", ran=True), 1),
            (good, 2),                                              # another epoch's update
            (failures.failed(PROVIDER, assignment(), "e", ran=True), 1)):    # another spec
        with pytest.raises(BadSignature):
            check(failed_update(body, epoch))
    # Without a report: the error alone, as a report that the job ran.
    assert check(failed_update(gw.JobFailed(error="e"))) == (True, "e", ())


def test_leases_failed_before_the_upgrade_keep_their_meaning(tmp_path):
    """A lease ``failed`` under the old rule (one report failed the job: its own failure)
    becomes ``crashed``, so an upgrade does not count old failures against providers."""
    db = Database(tmp_path / "old.db")
    migrations.apply(db, stop_before="m017_failed_leases_confirmed")
    for i, state in enumerate(("failed", "lost", "succeeded")):
        db["leases"].insert({"id": f"j.{i}", "job_id": "j", "attempt": 1, "epoch": i,
                             "provider_id": "p1", "device_indices": "[0]",
                             "price_per_gpu_hour": 1.0, "state": state, "issued_at_ms": 1,
                             "renewed_at_ms": 1, "envelope": b""})
    migrations.apply(db)
    assert [r[0] for r in db.execute("SELECT state FROM leases ORDER BY epoch")] == [
        "crashed", "lost", "succeeded"]
    h = views.provider_history(db, "p1", 10)
    assert (h.leases_failed, h.leases_lost, h.leases_completed) == (0, 1, 1)
