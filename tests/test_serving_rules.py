"""The endpoints' router and autoscaler rules, without processes (broker/serving/router.py,
broker/serving/autoscaler.py): least-loaded routing, the bounded queue (429) and the cold-start
limit (503), fail-over of a request nothing was streamed for, bounds on what a provider
sends, and each scaling decision."""

from __future__ import annotations

import asyncio
import json

import pytest

from gpumarket.broker.metrics import BrokerMetrics
from gpumarket.broker.serving.autoscaler import Watch, decide
from gpumarket.broker.serving.router import MAX_BUFFER, Endpoint, Refused, Serving
from gpumarket.broker.serving.rows import LiveEndpoint, LiveReplica
from gpumarket.kinds.engine_protocol import Complete, Final, Piece, encode_request
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from tests.serving_fakes import REQ

SETTINGS = {"task": "generate", "min_replicas": 1, "max_replicas": 3, "max_concurrency": 2,
            "target": 2, "window_s": 5, "idle_s": 60, "max_tokens": 0, "max_seq_len": 0}


class FakeSession:
    def __init__(self) -> None:
        self.sent: list[gw.BrokerMessage] = []

    def send(self, message: gw.BrokerMessage) -> None:
        self.sent.append(message)


class FakeSessions(dict):
    def get(self, provider_id):   # noqa: D401 (a dict of provider id -> FakeSession)
        return super().get(provider_id)


def router(**settings) -> tuple[Serving, FakeSessions]:
    sessions = FakeSessions(p1=FakeSession(), p2=FakeSession())
    serving = Serving(sessions, BrokerMetrics(), queue_wait_s=0.3, cold_start_s=0.3,
                      request_timeout_s=5)
    serving.sync([LiveEndpoint("ep", "c", "tiny", {**SETTINGS, **settings})])
    return serving, sessions


def ready(serving: Serving, provider: str, job: str, concurrency: int = 2) -> None:
    serving.ready(provider, job, 1, "ep", gw.ReplicaReady(engine="test", task="generate",
                                                          max_concurrency=concurrency))


def answer(serving: Serving, provider: str, request_id: str, *messages: dict) -> None:
    data = b"".join(json.dumps(m).encode() + b"\n" for m in messages)
    serving.chunk(provider, gw.InferenceChunk(request_id=request_id, data=data,
                                              last=any(m.get("done") for m in messages)))


async def collect(agen) -> list[dict]:
    return [m async for m in agen]


def sent_requests(session: FakeSession) -> list[str]:
    return [m.infer.request_id for m in session.sent if m.WhichOneof("msg") == "infer"]


def test_least_loaded_ready_replica_takes_the_request():
    async def main():
        serving, sessions = router()
        ready(serving, "p1", "r1")
        ready(serving, "p2", "r2")
        ep = serving.endpoints["ep"]
        first = serving.run(ep, REQ)
        task1 = asyncio.create_task(first.__anext__())
        await asyncio.sleep(0.05)
        second = serving.run(ep, REQ)
        task2 = asyncio.create_task(second.__anext__())
        await asyncio.sleep(0.05)
        # One request on each replica: the second went to the idle one.
        assert len(sent_requests(sessions["p1"])) == 1 and len(sent_requests(sessions["p2"])) == 1
        for provider in ("p1", "p2"):
            answer(serving, provider, sent_requests(sessions[provider])[0],
                   {"done": True, "finish_reason": "stop", "prompt_tokens": 3,
                    "output_tokens": 1})
        assert isinstance(await task1, Final) and isinstance(await task2, Final)
        await first.aclose()
        await second.aclose()
        assert ep.in_flight == 0
    asyncio.run(main())


def test_full_queue_is_429_and_no_replica_is_503_after_cold_start():
    async def main():
        serving, sessions = router(max_replicas=1, max_concurrency=1)
        ep = serving.endpoints["ep"]
        with pytest.raises(Refused) as cold:
            await collect(serving.run(ep, REQ))
        assert cold.value.status == 503 and cold.value.retry_after
        assert "ep" in serving.want        # the autoscaler was asked for a first replica
        ready(serving, "p1", "r1", concurrency=1)
        busy = serving.run(ep, REQ)
        pending = asyncio.create_task(busy.__anext__())
        await asyncio.sleep(0.05)
        waiting = [asyncio.create_task(collect(serving.run(ep, REQ)))
                   for _ in range(ep.queue_limit + 1)]
        done = await asyncio.gather(*waiting, return_exceptions=True)
        statuses = sorted(e.status for e in done if isinstance(e, Refused))
        assert statuses and set(statuses) == {429}, done
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await busy.aclose()
        assert ep.in_flight == 0 and ep.replicas["r1"].in_flight == 0
    asyncio.run(main())


def test_a_lost_replica_fails_over_before_streaming_and_errors_after():
    async def main():
        serving, sessions = router()
        ready(serving, "p1", "r1")
        ready(serving, "p2", "r2")
        ep = serving.endpoints["ep"]
        ep.replicas["r2"].in_flight = 1        # so the first goes to r1
        answer_task = asyncio.create_task(collect(serving.run(ep, REQ)))
        await asyncio.sleep(0.05)
        ep.replicas["r2"].in_flight = 0
        serving.provider_gone("p1")            # nothing streamed yet: tried on r2
        await asyncio.sleep(0.05)
        retried = sent_requests(sessions["p2"])
        assert len(retried) == 1
        answer(serving, "p2", retried[0], {"text": "hi"},
               {"done": True, "finish_reason": "stop", "prompt_tokens": 1, "output_tokens": 1})
        messages = await answer_task
        assert messages[0] == Piece("hi") and isinstance(messages[-1], Final)
        # Streamed, then lost: the request ends in an error.
        streamed = serving.run(ep, REQ)
        first = asyncio.create_task(streamed.__anext__())
        await asyncio.sleep(0.05)
        rid = sent_requests(sessions["p2"])[-1]
        answer(serving, "p2", rid, {"text": "a"})
        assert (await first) == Piece("a")
        serving.provider_gone("p2")
        rest = [m async for m in streamed]
        assert isinstance(rest[-1], Final) and rest[-1].status == 503
    asyncio.run(main())


def test_chunks_from_another_provider_or_too_large_are_not_taken():
    async def main():
        serving, sessions = router()
        ready(serving, "p1", "r1")
        ep = serving.endpoints["ep"]
        agen = serving.run(ep, REQ)
        task = asyncio.create_task(agen.__anext__())
        await asyncio.sleep(0.05)
        rid = sent_requests(sessions["p1"])[0]
        answer(serving, "p2", rid, {"text": "injected"},
               {"done": True, "prompt_tokens": 1, "output_tokens": 1})
        await asyncio.sleep(0.05)
        assert not task.done()
        serving.chunk("p1", gw.InferenceChunk(request_id=rid, data=b"x" * (MAX_BUFFER + 1)))
        final = await task
        assert final.status == 502 and "too large" in final.error
        await agen.aclose()
        cancels = [m for m in sessions["p1"].sent if m.WhichOneof("msg") == "infer_cancel"]
        assert cancels and cancels[0].infer_cancel.request_id == rid
    asyncio.run(main())


def test_usage_counts_are_bounded_and_survive_a_dropped_replica():
    async def main():
        serving, sessions = router()
        ready(serving, "p1", "r1")
        ep = serving.endpoints["ep"]
        agen = serving.run(ep, Complete(prompt="hi", max_tokens=4))
        task = asyncio.create_task(collect(agen))
        await asyncio.sleep(0.05)
        rid = sent_requests(sessions["p1"])[0]
        answer(serving, "p1", rid, {"text": "a"},
               {"done": True, "prompt_tokens": 2**40, "output_tokens": 5})
        await task
        serving.provider_gone("p1")
        usage = serving.take_usage()
        assert usage == [("r1.1", "ep", "r1", "p1", 1, 0, 0, 4)]    # not over max_tokens
        assert serving.take_usage() == []
    asyncio.run(main())


# -- the autoscaler's decisions ------------------------------------------------------------

def endpoint(**settings) -> Endpoint:
    return Endpoint("ep", "c", "tiny", {**SETTINGS, **settings})


def rows(*states: int) -> list[LiveReplica]:
    return [LiveReplica(f"r{i}", i, s, epoch=1, provider_id=f"p{i}", progress_step=1)
            for i, s in enumerate(states, 1)]


def serving_replicas(ep: Endpoint, *ids: str, in_flight: int = 0) -> None:
    from gpumarket.broker.serving.router import Replica

    for i in ids:
        ep.replicas[i] = Replica(i, 1, f"p{i[1:]}", ep.id, max_concurrency=2,
                                 in_flight=in_flight)


RUNNING = pb.JOB_STATE_RUNNING


def test_below_min_and_from_zero_add_at_once():
    ep = endpoint(min_replicas=2)
    d = decide(ep, rows(RUNNING), Watch(), now=100.0, wanted=False)
    assert d.add == 1 and "below min_replicas 2" in d.add_why
    zero = endpoint(min_replicas=0)
    assert decide(zero, [], Watch(), now=100.0, wanted=False).add == 0
    d = decide(zero, [], Watch(), now=100.0, wanted=True)
    assert d.add == 1 and "scale from zero" in d.add_why


def test_scale_out_only_after_the_window_and_never_past_max():
    ep = endpoint()
    serving_replicas(ep, "r1", in_flight=2)
    ep.in_flight = 2
    ep.waiting.extend([object()] * 3)       # load 5 over target 2 x 1 replica
    watch = Watch()
    assert decide(ep, rows(RUNNING), watch, now=100.0, wanted=False).add == 0
    assert decide(ep, rows(RUNNING), watch, now=104.0, wanted=False).add == 0
    d = decide(ep, rows(RUNNING), watch, now=105.5, wanted=False)
    assert d.add == 1 and "scale out" in d.add_why
    # One still starting: wait for it before adding another.
    watch = Watch(over_since=0.0)
    assert decide(ep, rows(RUNNING, pb.JOB_STATE_QUEUED), watch, now=200.0,
                  wanted=False).add == 0
    full = endpoint(max_replicas=1)
    serving_replicas(full, "r1", in_flight=2)
    full.in_flight = 9
    assert decide(full, rows(RUNNING), Watch(over_since=0.0), now=500.0, wanted=False).add == 0


def test_scale_in_after_idle_takes_a_starting_replica_first():
    ep = endpoint(min_replicas=1)
    serving_replicas(ep, "r1")
    ep.last_request = 0.0
    watch = Watch(last_change=0.0)
    assert decide(ep, rows(RUNNING, pb.JOB_STATE_QUEUED), watch, now=30.0,
                  wanted=False).retire == ()
    d = decide(ep, rows(RUNNING, pb.JOB_STATE_QUEUED), watch, now=61.0, wanted=False)
    assert d.retire == ("r2",) and "scale in" in d.retire_why
    # Not below min_replicas, and not while a request is in flight.
    assert decide(ep, rows(RUNNING), Watch(), now=1000.0, wanted=False).retire == ()
    ep.in_flight = 1
    assert decide(ep, rows(RUNNING, RUNNING), Watch(), now=1000.0, wanted=False).retire == ()


def test_a_starting_replica_a_request_waits_for_is_not_retired_as_idle():
    """Scale from zero, then a replica slower to start than idle_s: the request waiting for
    it keeps it (it was retired and another started, over and over)."""
    ep = endpoint(min_replicas=0, idle_s=6)
    ep.last_request = 0.0
    watch = Watch(last_change=0.0)
    ep.waiting.append(object())     # a request waiting for a free replica
    for wanted in (True, False):
        assert decide(ep, rows(pb.JOB_STATE_QUEUED), watch, now=60.0,
                      wanted=wanted).retire == ()
    ep.waiting.clear()
    assert decide(ep, rows(pb.JOB_STATE_QUEUED), watch, now=60.0, wanted=True).retire == ()
    assert decide(ep, rows(pb.JOB_STATE_QUEUED), watch, now=60.0,
                  wanted=False).retire != ()


def test_a_draining_replica_is_replaced_before_it_is_retired():
    ep = endpoint(min_replicas=1)
    serving_replicas(ep, "r1", in_flight=1)
    ep.replicas["r1"].draining = True
    watch = Watch()
    d = decide(ep, rows(RUNNING), watch, now=10.0, wanted=False)
    assert d.add == 1 and "drains" in d.add_why and d.retire == ("r1",) and not d.retire_why
    watch.replacing["r1"] = "r2"
    # The replacement is not ready yet: nothing more.
    assert decide(ep, rows(RUNNING, pb.JOB_STATE_QUEUED), watch, now=11.0,
                  wanted=False).retire_why == ""
    serving_replicas(ep, "r2")
    # Ready, but the old one still has a request in flight: it finishes first.
    assert decide(ep, rows(RUNNING, RUNNING), watch, now=12.0, wanted=False).retire_why == ""
    ep.replicas["r1"].in_flight = 0
    d = decide(ep, rows(RUNNING, RUNNING), watch, now=13.0, wanted=False)
    assert d.retire == ("r1",) and "draining provider" in d.retire_why


def test_a_replacement_slower_to_start_than_idle_s_is_not_scaled_in():
    """Found in CI under load: a draining replica's replacement took longer to start than
    idle_s, scale-in retired it as "one still starting", and the draining replica was never
    moved. Idle does not count while a replacement starts; a replacement that failed is
    started again."""
    ep = endpoint(min_replicas=0, idle_s=6)
    ep.last_request = 0.0
    serving_replicas(ep, "r1")
    ep.replicas["r1"].draining = True
    watch = Watch(last_change=0.0)
    d = decide(ep, rows(RUNNING), watch, now=1.0, wanted=False)
    assert d.add == 1 and d.retire == ("r1",) and not d.retire_why
    watch.replacing["r1"] = "r2"
    for now in (10.0, 60.0, 600.0):         # r2 still starting, long past idle_s
        d = decide(ep, rows(RUNNING, pb.JOB_STATE_LEASED), watch, now=now, wanted=False)
        assert d.retire == () and d.add == 0, (now, d)
    # r2 failed for good (gone from the endpoint's replicas): another replacement starts.
    d = decide(ep, rows(RUNNING), watch, now=601.0, wanted=False)
    assert d.add == 1 and d.retire == ("r1",) and not d.retire_why


# -- the provider's link to its engine (provider/replica.py) -----------------------------

def test_engine_link_takes_only_answers_to_open_requests_and_bounds_them():
    import socket

    from gpumarket.provider import replica

    async def main():
        sent, readies = [], []
        link = replica.EngineLink(sent.append, readies.append)
        engine = socket.socket(fileno=link.child_fd)
        await link.start()
        request = gw.InferenceRequest(request_id="q1", job_id="j", epoch=1,
                                      body=encode_request(REQ))
        assert "not ready" in link.forward(request)
        engine.sendall(b'{"event": "ready", "engine": "e", "task": "generate",'
                       b' "max_concurrency": 4, "max_seq_len": 99}\n')
        await asyncio.sleep(0.05)
        assert readies and readies[0].max_concurrency == 4
        assert link.forward(request) == ""
        assert json.loads(engine.recv(1000)) == {"id": "q1", **REQ.to_dict()}
        # Answers to requests it was not sent, garbage, and a second "ready" are dropped.
        engine.sendall(b'{"id": "other", "text": "x"}\nnot json\n[1]\n{"event": "ready"}\n'
                       b'{"id": "q1", "text": "hi"}\n')
        await asyncio.sleep(0.05)
        assert [m.chunk.request_id for m in sent] == ["q1"] and len(readies) == 1
        # An answer over MAX_ANSWER ends in a 502, and the engine is told to stop it.
        replica.MAX_ANSWER, old = 100, replica.MAX_ANSWER
        try:
            engine.sendall(b'{"id": "q1", "text": "' + b"y" * 200 + b'"}\n')
            await asyncio.sleep(0.05)
        finally:
            replica.MAX_ANSWER = old
        final = json.loads(sent[-1].chunk.data)
        assert sent[-1].chunk.last and final["status"] == 502, final
        assert b'"op": "cancel"' in engine.recv(1000)
        # The engine goes away: what it still owed ends in a 503.
        link.forward(gw.InferenceRequest(request_id="q2", job_id="j", epoch=1,
                                         body=encode_request(REQ)))
        engine.close()
        await asyncio.sleep(0.05)
        assert json.loads(sent[-1].chunk.data)["status"] == 503
        assert sent[-1].chunk.request_id == "q2" and not link.open
    asyncio.run(main())
