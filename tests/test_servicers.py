"""The Marketplace servicer called in-process over a real store, SQLite and PostgreSQL
(tests/servicers.py): SubmitJob in each shape a job takes (one job, a split job, a job array,
an endpoint), a bad submission refused with its status and one line and nothing written,
CancelJob, GetJob and ListJobs, Quote, an endpoint's keys, a client's ledger lines — what a
client would get back, and what the broker stored."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from gpumarket.proto.envelope import seal
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import marketplace_pb2 as mp
from gpumarket.proto.v1 import types_pb2 as pb
from tests.servicers import Refused, Servicers

SCRIPT = """
name = "{name}"
kind = "script"
max_price = 1.0
max_runtime = 600

[script]
code = "main.py"
{extra}
"""

RENDER = """
name = "frames"
kind = "render"
max_price = 1.0
max_runtime = 600

[render]
scene = "scene.blend"
frame_start = 1
frame_end = 6
split = 3
"""

MODEL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 320, "max_position_embeddings": 256}

ENDPOINT = """
kind = "endpoint"
name = "tiny"
max_price = 1.0

[endpoint]
model = "{model}"
min_replicas = 2
max_replicas = 3
"""


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def database(request) -> str:
    """"" for a fresh SQLite file per test; else one PostgreSQL database (the broker's schema
    applied) that this file's tests share: each test's keys are its own, so no test sees
    another's jobs or money, and a database made once spares each test its making."""
    if request.param == "sqlite":
        return ""
    cluster = request.getfixturevalue("pg_cluster")
    return cluster.database(template=cluster.template)


@pytest.fixture
def broker(tmp_path, database):
    """The servicers over SQLite, then over PostgreSQL (skipped where it is not installed):
    the same calls answer the same on either store."""
    s = Servicers(tmp_path / "broker", database)
    yield s
    s.close()


@pytest.fixture
def alice(broker):
    key = Identity.generate()
    broker.credit(key)
    return key


def job_file(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    (tmp_path / "main.py").write_text("print('hi')\n")
    (tmp_path / "scene.blend").write_bytes(b"BLENDER-v300" + bytes(64))
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(MODEL))
    path = tmp_path / name
    path.write_text(text.replace("{model}", str(model)))
    return path


def script(tmp_path: Path, name: str = "one", extra: str = "") -> Path:
    return job_file(tmp_path, SCRIPT.format(name=name, extra=extra), f"{name}.toml")


def units(seconds: int, devices: int = 1) -> int:
    """What a hold of ``seconds`` of ``devices`` at max_price 1.0 a device-hour is."""
    return -(-1_000_000 * devices * seconds // 3600)


def get(broker: Servicers, key: Identity, job_id: str) -> pb.Job:
    return broker.call("GetJob", mp.GetJobRequest(job_id=job_id), key).job


def held(broker: Servicers, key: Identity) -> int:
    return broker.call("GetAccount", mp.GetAccountRequest(limit=1), key).held


def test_a_job_is_submitted_queued_and_read_back_by_its_client_alone(broker, alice, tmp_path):
    resp = broker.submit(alice, broker.spec(alice, script(tmp_path)))
    assert resp.state == pb.JOB_STATE_QUEUED
    job = get(broker, alice, resp.job_id)
    assert (job.name, job.state, job.kind, job.attempt) == ("one", pb.JOB_STATE_QUEUED,
                                                            pb.JOB_KIND_SCRIPT, 1)
    assert not job.parts and not job.array.tasks
    # Its hold: 600 s (its max_runtime) at max_price 1.0 on one device.
    assert job.billing.hold == held(broker, alice) == units(600)
    assert [j.job_id for j in broker.call("ListJobs", mp.ListJobsRequest(), alice).jobs] \
        == [resp.job_id]
    # Another client: the job is not there, and it lists only its own.
    bob = Identity.generate()
    with pytest.raises(Refused) as caught:
        get(broker, bob, resp.job_id)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert broker.call("ListJobs", mp.ListJobsRequest(), bob).jobs == []
    with pytest.raises(Refused) as caught:
        broker.call("ListJobs", mp.ListJobsRequest(client_id=alice.id), bob)
    assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_a_split_job_is_stored_with_its_parts(broker, alice, tmp_path):
    resp = broker.submit(alice, broker.spec(alice, job_file(tmp_path, RENDER)))
    job = get(broker, alice, resp.job_id)
    assert [(p.part, p.job_id, p.state, p.progress.total) for p in job.parts] == [
        (i, f"{resp.job_id}-{i}", pb.JOB_STATE_QUEUED, 2) for i in (1, 2, 3)]
    # One hold for the three parts that run at once.
    assert job.billing.hold == units(600, 3)


def test_a_job_array_is_stored_with_its_tasks_in_batches(broker, alice, tmp_path):
    path = script(tmp_path, "grid", '\n[array]\ngrid = { args = [["a"], ["b"]], steps = [1, 2] }'
                                    "\nper_lease = 2\n")
    resp = broker.submit(alice, broker.spec(alice, path))
    job = get(broker, alice, resp.job_id)
    assert job.array.tasks == 4 and job.state == pb.JOB_STATE_QUEUED
    tasks = broker.call("ListTasks", mp.ListTasksRequest(job_id=resp.job_id), alice).tasks
    assert [t.task for t in tasks] == [0, 1, 2, 3]
    assert len({t.lease_job_id for t in tasks}) == 2        # two tasks a lease
    assert job.billing.hold == units(600, 4)  # every task, held at once
    one = broker.submit(alice, broker.spec(alice, script(tmp_path))).job_id
    with pytest.raises(Refused) as caught:
        broker.call("ListTasks", mp.ListTasksRequest(job_id=one), alice)
    assert (caught.value.code, caught.value.message) == (
        grpc.StatusCode.FAILED_PRECONDITION, f"job {one} is not a job array")


def test_an_endpoint_is_stored_serving_with_its_first_replicas(broker, alice, tmp_path):
    resp = broker.submit(alice, broker.spec(alice, job_file(tmp_path, ENDPOINT)))
    assert resp.state == pb.JOB_STATE_QUEUED
    ep = broker.call("GetEndpoint", mp.GetEndpointRequest(endpoint="tiny"), alice).endpoint
    assert ep.job_id == resp.job_id and ep.state == pb.JOB_STATE_RUNNING
    assert [r.state for r in ep.replicas] == [pb.JOB_STATE_QUEUED] * 2
    # Its hold pays for max_replicas at once (1 h each: its work is not known ahead) — and
    # a quote of the same spec says so (it said one replica's hour before).
    assert get(broker, alice, resp.job_id).billing.hold == 3 * 1_000_000
    again = broker.spec(alice, job_file(tmp_path, ENDPOINT.replace("tiny", "tiny2")))
    assert broker.call("Quote", mp.QuoteRequest(spec=again, limit=5), alice).hold == 3 * 1_000_000


def test_an_endpoints_keys_are_made_shown_and_revoked_by_its_client_alone(broker, alice,
                                                                           tmp_path):
    broker.submit(alice, broker.spec(alice, job_file(tmp_path, ENDPOINT)))
    made = broker.call("CreateEndpointKey", mp.EndpointKeyRequest(endpoint="tiny"), alice)
    key = made.key
    assert made.secret.startswith("gm-") and key.key_id and key.created_at_ms
    assert not key.revoked_at_ms
    revoke = mp.EndpointKeyRequest(endpoint="tiny", key_id=key.key_id)
    with pytest.raises(Refused) as caught:     # another client's endpoint is not there
        broker.call("RevokeEndpointKey", revoke, Identity.generate())
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    gone = broker.call("RevokeEndpointKey", revoke, alice).key
    assert (gone.key_id, gone.created_at_ms) == (key.key_id, key.created_at_ms)
    assert gone.revoked_at_ms >= key.created_at_ms
    assert broker.call("RevokeEndpointKey", revoke, alice).key == gone    # again: the same
    ep = broker.call("GetEndpoint", mp.GetEndpointRequest(endpoint="tiny"), alice).endpoint
    assert list(ep.keys) == [gone]
    assert [e.message for e in ep.events][-2:] == [f"API key {key.key_id} created",
                                                   f"API key {key.key_id} revoked"]
    # Its client's ledger lines, newest first: the endpoint's hold, then the credit.
    lines = broker.call("GetAccount", mp.GetAccountRequest(), alice).lines
    assert [(x.type, x.account, x.amount, x.job_id) for x in lines] == [
        ("hold", "available", -3_000_000, ep.job_id), ("hold", "held", 3_000_000, ep.job_id),
        ("credit", "available", 1_000_000_000, "")]


def bad_kind_value(spec: pb.JobSpec) -> None:
    spec.custom.json = json.dumps({**json.loads(spec.custom.json), "entry": "../main.py"})


def bad_nonce(spec: pb.JobSpec) -> None:
    spec.nonce = b"short"


def bad_input_size(spec: pb.JobSpec) -> None:
    spec.inputs[0].size_bytes += 1


def stale(spec: pb.JobSpec) -> None:
    spec.created_at_ms, spec.expires_at_ms = now_ms() - 7_200_000, now_ms() - 3_600_000


INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("spoil, code, words", [
    (bad_kind_value, INVALID, "script.entry"),
    (bad_nonce, INVALID, "nonce"),
    (bad_input_size, INVALID, "does not match the stored"),
    (stale, grpc.StatusCode.FAILED_PRECONDITION, "job spec expired 3600s ago"),
])
def test_a_bad_spec_is_refused_in_one_line_and_writes_nothing(broker, alice, tmp_path, spoil,
                                                              code, words):
    spec = broker.spec(alice, script(tmp_path))
    before = broker.counts()
    spoil(spec)
    with pytest.raises(Refused) as caught:
        broker.submit(alice, spec)
    assert caught.value.code == code, caught.value
    assert words in caught.value.message and "\n" not in caught.value.message, caught.value
    assert broker.counts() == before
    assert held(broker, alice) == 0


def test_a_bad_array_task_is_named_and_nothing_is_written(broker, alice, tmp_path):
    spec = broker.spec(alice, script(tmp_path, "grid", '\n[array]\ngrid = { steps = [1, 2] }'))
    tasks = b'{"steps": 1}\n{"entry": "../x.py"}\n'
    ref = next(r for r in spec.inputs if r.name == spec.array.tasks_input)
    ref.CopyFrom(broker.put(alice, {ref.name: tasks})[0])    # a client that skipped its check
    before = broker.counts()
    with pytest.raises(Refused) as caught:
        broker.submit(alice, spec)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "task 1" in caught.value.message and "\n" not in caught.value.message
    assert broker.counts() == before


def test_what_else_a_submission_is_refused_for(broker, alice, tmp_path):
    spec = broker.spec(alice, script(tmp_path))
    bob = Identity.generate()
    broker.credit(bob)
    cases = [
        # Signed by one key, sent by another.
        (lambda: broker.call("SubmitJob", mp.SubmitJobRequest(spec=seal(alice, spec)), bob),
         grpc.StatusCode.PERMISSION_DENIED, "signed by another key"),
        # Someone else's input: the same answer as an input never uploaded.
        (lambda: broker.submit(bob, spec), grpc.StatusCode.FAILED_PRECONDITION,
         "is not uploaded (by you)"),
    ]
    before = broker.counts()
    for call, code, words in cases:
        with pytest.raises(Refused) as caught:
            call()
        assert caught.value.code == code and words in caught.value.message, caught.value
    assert broker.counts() == before
    broker.submit(alice, spec)
    with pytest.raises(Refused) as caught:     # the same signed spec again
        broker.submit(alice, spec)
    assert caught.value.code == grpc.StatusCode.ALREADY_EXISTS


def test_a_client_without_funds_is_refused_and_nothing_is_held(broker, tmp_path):
    poor = Identity.generate()
    broker.credit(poor, 0.1)            # 0.1 credits; the job holds 600 s at 1.0 a device-hour
    spec = broker.spec(poor, script(tmp_path))
    before = broker.counts()
    with pytest.raises(Refused) as caught:
        broker.submit(poor, spec)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "\n" not in caught.value.message
    assert broker.counts() == before


def test_too_many_queued_jobs_are_refused(tmp_path):
    broker = Servicers(tmp_path / "broker", max_queued_jobs=2)
    try:
        key = Identity.generate()
        broker.credit(key)
        for n in ("a", "b"):
            broker.submit(key, broker.spec(key, script(tmp_path, n)))
        with pytest.raises(Refused) as caught:
            broker.submit(key, broker.spec(key, script(tmp_path, "c")))
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 queued jobs" in caught.value.message
    finally:
        broker.close()


def cancel(broker: Servicers, key: Identity, job_id: str, at_ms: int | None = None) -> int:
    order = seal(key, mp.CancelOrder(job_id=job_id, at_ms=at_ms or now_ms()))
    return broker.call("CancelJob", mp.CancelJobRequest(order=order), key).state


def test_a_job_is_cancelled_by_its_client_alone_and_its_hold_given_back(broker, alice,
                                                                         tmp_path):
    job_id = broker.submit(alice, broker.spec(alice, job_file(tmp_path, RENDER))).job_id
    bob = Identity.generate()
    with pytest.raises(Refused) as caught:
        cancel(broker, bob, job_id)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(Refused) as caught:     # an order dated an hour ago
        cancel(broker, alice, job_id, now_ms() - 3_600_000)
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert get(broker, alice, job_id).state == pb.JOB_STATE_QUEUED
    assert cancel(broker, alice, job_id) == pb.JOB_STATE_CANCELLED
    job = get(broker, alice, job_id)
    assert job.state == pb.JOB_STATE_CANCELLED
    assert {p.state for p in job.parts} == {pb.JOB_STATE_CANCELLED}
    assert held(broker, alice) == 0
    events = broker.stream("WatchJob", mp.WatchJobRequest(job_id=job_id), alice)
    assert [e.event.type for e in events] == ["submitted", "cancelled"]
    assert cancel(broker, alice, job_id) == pb.JOB_STATE_CANCELLED     # again: the same


def test_a_quote_stores_nothing_and_says_why_no_offer_fits(broker, alice, tmp_path):
    spec = broker.spec(alice, script(tmp_path))
    before = broker.counts()
    q = broker.call("Quote", mp.QuoteRequest(spec=spec, limit=5), alice)
    assert (q.offers, list(q.candidates)) == (0, [])
    assert q.hold == units(600) and "max_runtime" in q.hold_basis
    assert q.explanation
    assert broker.counts() == before
