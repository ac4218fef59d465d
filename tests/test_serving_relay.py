"""Endpoints served on any broker of a shared store (broker/serving/relay.py), in process: two
brokers' OpenAI-compatible APIs on aiohttp's test servers, the replica (a fake provider's
session) on one of them; and the directory of brokers on a real SQLite database."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field, replace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from sqlite_utils import Database

from gpumarket.broker.checks import verification
from gpumarket.broker.serving import relay as relay_mod
from gpumarket.broker.serving.autoscaler import Decision, Watch, decide
from gpumarket.broker.serving.rows import LiveReplica
from gpumarket.broker.serving.openai_api import OpenAIApi
from gpumarket.broker.serving.relay import NOT_HERE, RELAYED, Peer, Relay
from gpumarket.broker.store.schema import migrations
from gpumarket.proto.v1 import types_pb2 as pb

from tests.serving_fakes import (
    REQ, SETTINGS, AnsweringSession, collect, live_row, ready, router,
)
from tests.test_serving_hostile_api import KEY, FakeState, FakeStore, chat, post


@dataclass
class Config:
    queue_wait_s: float = 0.5
    request_timeout_s: float = 2.0
    body_timeout_s: float = 2.0


@dataclass
class Broker:
    """One broker's API as the tests drive it: its router, relay, test server and client."""

    holder: str
    api: OpenAIApi
    relay: Relay
    server: TestServer | None = None
    client: TestClient | None = None
    calls: list[str] = field(default_factory=list)   # paths of requests it was sent

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")


def broker(holder: str, sessions: dict, cold_start_s: float = 0.5) -> Broker:
    serving, _ = router(sessions, cold_start_s=cold_start_s)
    store = FakeStore({KEY: "ep"}, [live_row()])
    state = FakeState(store)
    state.config, state.holder, state.epoch = Config(), holder, None
    rel = Relay(state, serving, "")
    return Broker(holder, OpenAIApi(state, serving, 2.0, rel), rel)


async def started(b: Broker) -> Broker:
    app = b.api.app()

    @web.middleware
    async def seen(request, handler):
        b.calls.append(request.path)
        return await handler(request)

    app.middlewares.append(seen)
    b.server = TestServer(app, host="127.0.0.1")
    b.client = TestClient(b.server)
    await b.client.start_server()
    return b


async def pair() -> tuple[Broker, Broker, AnsweringSession]:
    """Broker a with a ready replica (provider p1's session), broker b with none; b's
    directory lists a as holding one."""
    session = AnsweringSession("p1", lambda r: [{"text": "he"}, {"text": "llo"}, {
        "done": True, "finish_reason": "stop", "prompt_tokens": 3, "output_tokens": 2}])
    a = await started(broker("a", {"p1": session}))
    ready(a.api.serving, "p1", "r1")
    b = await started(broker("b", {}))
    b.relay.peers = [Peer("a", a.url, {"ep": a.relay.served()["ep"][0]})]
    return a, b, session


async def close(*brokers: Broker) -> None:
    for x in brokers:
        await x.relay.close_client()
        await x.client.close()


async def sse(client: TestClient, body: dict, key: str = KEY) -> tuple[int, list]:
    response = await client.post("/v1/chat/completions", data=json.dumps(body),
                                 headers={"Authorization": f"Bearer {key}"})
    text = await response.text()
    return response.status, [json.loads(line[6:]) for line in text.split("\n")
                             if line.startswith("data: {")]


def test_a_broker_without_a_replica_relays_whole_and_streamed_answers():
    async def go():
        a, b, session = await pair()
        try:
            assert b.relay.served()["ep"][:2] == [0, 0] and a.relay.served()["ep"][:2] == [1, 0]
            here = await post(a.client, "/v1/chat/completions", chat())
            there = await post(b.client, "/v1/chat/completions", chat())
            assert here[0] == there[0] == 200, there
            assert there[1]["choices"][0]["message"]["content"] == "hello"
            assert there[1]["usage"] == here[1]["usage"]
            status, events = await sse(b.client, chat(stream=True))
            assert status == 200
            assert "".join(e["choices"][0]["delta"].get("content") or ""
                           for e in events if e["choices"]) == "hello"
            # Three requests reached the replica, each once, all counted by a's router;
            # b counts nothing of them (its router has no replica, nothing left over).
            assert len(session.requests()) == 3
            usage = a.api.serving.take_usage()
            assert [u[4] for u in usage] == [3], usage
            assert b.api.serving.take_usage() == []
            assert b.calls.count("/v1/chat/completions") == 2
            assert a.calls.count("/v1/chat/completions") == 3
        finally:
            await close(a, b)
    asyncio.run(go())


def test_the_key_is_checked_where_the_request_came_and_nothing_is_relayed():
    async def go():
        a, b, session = await pair()
        try:
            status, body = await post(b.client, "/v1/chat/completions", chat(), key="gm-bad")
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
            assert a.calls == [] and session.requests() == []
        finally:
            await close(a, b)
    asyncio.run(go())


def test_a_relayed_request_is_never_relayed_again():
    """b gets a request marked as relayed and holds no replica: a 503 at once (not the
    router's wait for a first replica), and a sees nothing of it."""
    async def go():
        a, b, session = await pair()
        try:
            began = time.monotonic()
            response = await b.client.post("/v1/chat/completions", data=json.dumps(chat()),
                                           headers={"Authorization": f"Bearer {KEY}",
                                                    RELAYED: "c"})
            assert response.status == 503 and response.headers[RELAYED] == NOT_HERE
            assert time.monotonic() - began < 0.4       # cold_start_s is 0.5
            assert a.calls == [] and session.requests() == []
            # Neither holds a replica, each lists the other as holding one (stale rows): the
            # request goes b -> a once, a refuses, b's own router answers; no ping-pong.
            a.api.serving.provider_gone("p1")
            a.relay.peers = [Peer("b", b.url, {"ep": 1})]
            status, body = await post(b.client, "/v1/chat/completions", chat())
            assert status == 503 and "none became ready" in body["error"]["message"], body
            assert a.calls == ["/v1/chat/completions"] and session.requests() == []
            assert b.calls.count("/v1/chat/completions") == 2
        finally:
            await close(a, b)
    asyncio.run(go())


def test_a_dead_peer_is_skipped_for_the_next_and_with_none_left_the_router_answers():
    async def go():
        a, b, session = await pair()
        dead = await started(broker("dead", {}))
        dead_url = dead.url
        await close(dead)                               # its port now refuses
        try:
            b.relay.peers = [Peer("dead", dead_url, {"ep": 5}), Peer("a", a.url, {"ep": 1})]
            status, body = await post(b.client, "/v1/chat/completions", chat())
            assert status == 200 and body["choices"][0]["message"]["content"] == "hello"
            assert dead_url in b.relay.down and len(session.requests()) == 1
            # A peer that says it has no replica (a stale directory) is passed over too.
            b.relay.peers = [Peer("a", a.url, {"ep": 1})]
            a.api.serving.provider_gone("p1")
            status, body = await post(b.client, "/v1/chat/completions", chat())
            assert status == 503 and "none became ready" in body["error"]["message"], body
        finally:
            await close(a, b)
    asyncio.run(go())


async def peer_app(handler) -> tuple[TestClient, str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    return client, str(client.server.make_url("")).rstrip("/")


def test_a_request_waiting_for_a_first_replica_goes_where_one_became_ready():
    """b holds no replica and knows of none: the request waits in b's router (counted in
    what b tells the others: the leader's autoscaler starts a replica for it); once b hears
    that a holds one, the request is relayed there."""
    async def go():
        session = AnsweringSession("p1")
        a = await started(broker("a", {"p1": session}))
        b = await started(broker("b", {}, cold_start_s=30))
        try:
            asked = asyncio.ensure_future(post(b.client, "/v1/chat/completions", chat()))
            ep = b.api.serving.endpoints["ep"]
            deadline = time.monotonic() + 10
            while not ep.waiting and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert b.relay.served()["ep"][:2] == [0, 1] and a.calls == []
            ready(a.api.serving, "p1", "r1")
            b.relay.peers = [Peer("a", a.url, {"ep": 1})]
            b.relay.hear()
            status, body = await asyncio.wait_for(asked, 10)
            assert status == 200 and body["choices"][0]["message"]["content"] == "hi"
            assert a.calls == ["/v1/chat/completions"] and len(session.requests()) == 1
            assert b.api.serving.take_usage() == []
        finally:
            await close(a, b)
    asyncio.run(go())


def test_what_a_peer_sends_back_is_bounded(monkeypatch):
    """A peer that streams more than an answer may hold, or goes silent mid-stream: the
    stream ends in an error event; a whole answer too large is a 502."""
    monkeypatch.setattr(relay_mod, "MAX_ANSWER", 1000)

    async def endless(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(1000):
            await response.write(b"data: {\"choices\": []}\n\n")
        return response

    async def silent(request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: {\"choices\": []}\n\n")
        await asyncio.sleep(30)
        return response

    async def large(request):
        return web.json_response({"x": "y" * 5000})

    async def go():
        b = await started(broker("b", {}))
        b.relay.gap_s = 0.5
        peers = []
        try:
            for handler, check in ((endless, "too large"), (silent, "went away")):
                peer, url = await peer_app(handler)
                peers.append(peer)
                b.relay.peers = [Peer("p", url, {"ep": 1})]
                status, events = await sse(b.client, chat(stream=True))
                assert status == 200 and check in events[-1]["error"]["message"], events[-1]
            peer, url = await peer_app(large)
            peers.append(peer)
            b.relay.peers = [Peer("p", url, {"ep": 1})]
            status, body = await post(b.client, "/v1/chat/completions", chat())
            assert status == 502 and "too large" in body["error"]["message"]
        finally:
            await close(b)
            for peer in peers:
                await peer.close()
    asyncio.run(go())


def test_the_directory_lists_fresh_peers_and_what_they_serve():
    db = Database(memory=True)
    migrations.apply(db)
    relay_mod.announce(db, "a", "http://a:1", {"ep": [2, 0, 5]}, 10_000)
    relay_mod.announce(db, "b", "http://b:1", {}, 10_000)
    relay_mod.announce(db, "a", "http://a:2", {"ep": [1, 3, 70], "ep2": [0, 1, 0]},
                       20_000)                                  # renewed
    assert relay_mod.peers(db, "b", 15_000) == [Peer("a", "http://a:2", {"ep": 1}, {
        "ep": (3, 70), "ep2": (1, 0)})]
    assert relay_mod.peers(db, "a", 15_000) == []       # b's row is stale
    assert [p.holder for p in relay_mod.peers(db, "c", 5_000)] == ["a", "b"]
    relay_mod.withdraw(db, "a")
    assert relay_mod.peers(db, "b", 0) == []
    relay_mod.announce(db, "c", "http://c:1", {}, 10_000_000)   # b's, an hour stale: gone
    assert db.execute("SELECT holder FROM serving_brokers").fetchall() == [("c",)]
    assert relay_mod.advertised_url("", "0.0.0.0:7072").endswith(":7072")
    assert "0.0.0.0" not in relay_mod.advertised_url("", "0.0.0.0:7072")
    assert relay_mod.advertised_url("http://x:9/", "127.0.0.1:1") == "http://x:9"


def test_what_peers_say_reaches_the_router_and_the_leaders_autoscaler():
    """The leader holds no replica of the endpoint; another broker holds one and serves
    requests: the leader scales out on that load, and does not retire the replica for
    want of requests of its own; with no replica anywhere, a request waiting on another
    broker starts one."""
    async def go():
        lead = broker("a", {})
        ep = lead.api.serving.endpoints["ep"]
        lead.relay.peers = [Peer("b", "http://b", {"ep": 1}, {"ep": (9, 10)})]
        lead.relay.hear()
        assert (ep.peer_ready, ep.peer_load) == (1, 9)
        assert time.monotonic() - ep.peer_last_request < 1
        replica = LiveReplica("r1", 1, pb.JOB_STATE_RUNNING, 1, "p1", progress_step=1)
        settings = {**SETTINGS, "min_replicas": 0, "idle_s": 5, "window_s": 0}
        ep.settings, ep.last_request = settings, time.monotonic() - 3600
        d = decide(ep, [replica], Watch(), time.monotonic(), False)
        assert d.add == 1 and "9 requests" in d.add_why, d
        lead.relay.peers = [Peer("b", "http://b", {"ep": 1}, {"ep": (0, 1000)})]
        lead.relay.hear()
        assert decide(ep, [replica], Watch(), time.monotonic(), False) == Decision()
        lead.relay.peers = [Peer("b", "http://b", {}, {"ep": (1, 0)})]
        lead.relay.hear()
        d = decide(ep, [], Watch(), time.monotonic(), False)
        assert d.add == 1 and "scale from zero" in d.add_why, d
        lead.relay.peers = []
        lead.relay.hear()
        assert decide(ep, [], Watch(), time.monotonic(), False) == Decision()
    asyncio.run(go())


def test_candidates_prefer_more_replicas_and_skip_peers_down():
    async def go():
        b = broker("b", {})
        b.relay.peers = [Peer("a", "http://a", {"ep": 1}), Peer("c", "http://c", {"ep": 3}),
                         Peer("d", "http://d", {"ep2": 1})]
        assert [p.holder for p in b.relay.candidates("ep")] == ["c", "a"]
        b.relay.down["http://c"] = time.monotonic() + 10
        assert [p.holder for p in b.relay.candidates("ep")] == ["a"]
    asyncio.run(go())


class WritingStore(FakeStore):
    """FakeStore that also takes writes (the directory's, usage), or fails them."""

    def __init__(self, fail: bool = False) -> None:
        replica = LiveReplica("r1", 1, pb.JOB_STATE_RUNNING, 1, "p1", progress_step=1)
        super().__init__({KEY: "ep"}, [replace(live_row(), replicas=(replica,))])
        self.fail, self.writes, self.standings_read = fail, [], 0

    async def write(self, fn, *args):
        if self.fail and fn is not relay_mod.announce:
            raise OSError("the store went away")
        self.writes.append((fn.__name__, args))

    async def read(self, fn, *args):
        if fn is relay_mod.peers:
            return []
        if fn is verification.past_warm_up:
            self.standings_read += 1
            return frozenset({"p1"})
        return await super().read(fn, *args)


def test_a_broker_that_does_not_lead_writes_its_own_replicas_usage_once():
    async def go():
        session = AnsweringSession("p1")
        b = broker("b", {"p1": session})
        ready(b.api.serving, "p1", "r1")
        b.api.state.store = store = WritingStore(fail=True)
        await collect(b.api.serving.run(b.api.serving.endpoints["ep"], REQ))
        with pytest.raises(OSError):
            await b.relay.one_pass()            # the write failed: the usage is kept
        store.fail = False
        await b.relay.one_pass()
        # It samples answers as the leader would: p1 is past its warm-up, read once a while.
        assert b.api.serving.samples.settled == {"p1"} and store.standings_read == 1
        usage = [args for name, args in store.writes if name == "record_usage"]
        assert len(usage) == 1 and [u[4] for u in usage[0][0]] == [1], usage
        announced = [args for name, args in store.writes if name == "announce"]
        assert announced[-1][:2] == ("b", "") and announced[-1][2]["ep"][:2] == [1, 0]
        await collect(b.api.serving.run(b.api.serving.endpoints["ep"], REQ))
        b.api.state.epoch = 7                   # it leads: its autoscaler writes usage
        await b.relay.one_pass()
        assert len([n for n, _ in store.writes if n == "record_usage"]) == 1
        assert store.standings_read == 1
    asyncio.run(go())


def test_a_relayed_body_is_held_within_the_brokers_request_memory():
    """Held as the router holds one until the peer's answer begins: no room is a 429 before
    any peer is asked; another client's request needing the room ends a relay still waiting
    for its answer to begin in a 429 (and its connection to the peer is closed)."""
    async def go():
        asked: list[str] = []
        gone = asyncio.Event()

        async def slow(request):
            asked.append(request.headers.get(RELAYED, ""))
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                gone.set()
                raise
            return web.json_response({})

        b = await started(broker("b", {}))
        peer, url = await peer_app(slow)
        b.relay.peers = [Peer("a", url, {"ep": 1})]
        shares = b.api.serving.shares
        big = chat(messages=[{"role": "user", "content": "x" * 2000}])
        try:
            shares.budget = 100
            status, body = await post(b.client, "/v1/chat/completions", big)
            assert status == 429 and "budget" in body["error"]["message"] and asked == []
            shares.budget = 3000
            relayed = asyncio.ensure_future(post(b.client, "/v1/chat/completions", big))
            deadline = time.monotonic() + 10
            while not asked and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert asked == ["b"] and shares.held > 2000
            shares.take("ep2", "c2", 1500)      # another client's request needs the room
            status, body = await asyncio.wait_for(relayed, 4)   # not the 8.5 s headers_s
            assert status == 429 and "its share" in body["error"]["message"], body
            assert b.relay.relayed.labels(outcome="evicted")._value.get() == 1
            await asyncio.wait_for(gone.wait(), 10)
            assert shares.held == 1500
        finally:
            await close(b)
            await peer.close()
    asyncio.run(go())


def test_a_request_whose_peer_died_waits_for_a_replica_here():
    """The directory still lists a dead broker as holding the endpoint's replica (its row is
    not stale yet): the request is not refused but waits in this broker's router, and is
    served by the replica that moves here (its provider reconnecting)."""
    async def go():
        session = AnsweringSession("p1")
        dead = await started(broker("dead", {}))
        dead_url = dead.url
        await close(dead)
        b = await started(broker("b", {"p1": session}, cold_start_s=10))
        try:
            b.relay.peers = [Peer("dead", dead_url, {"ep": 1})]
            b.relay.hear()
            asked = asyncio.ensure_future(post(b.client, "/v1/chat/completions", chat()))
            ep = b.api.serving.endpoints["ep"]
            deadline = time.monotonic() + 10
            while not ep.waiting and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert ep.waiting and ep.peer_ready == 0 and dead_url in b.relay.down
            ready(b.api.serving, "p1", "r1")
            status, body = await asyncio.wait_for(asked, 5)
            assert status == 200 and body["choices"][0]["message"]["content"] == "hi"
        finally:
            await close(b)
    asyncio.run(go())
