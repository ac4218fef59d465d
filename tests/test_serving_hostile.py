"""An attacker's pass over endpoints (docs/serving.md): what a hostile API caller, provider or
engine child can make the broker's router (broker/serving.py), its OpenAI-compatible API
(broker/openai_api.py), the autoscaler (broker/autoscaler.py), the endpoints' database code
(broker/endpoints.py) and the provider's engine link (provider/replica.py) do.

Tests whose docstring starts with "HOLE:" demonstrate a weakness and fail until it is fixed;
the others pin behaviour that already holds. Everything runs in process, without a model:
fake provider sessions that answer requests the way a (hostile) provider would, aiohttp's
test server for the API, a real SQLite store for the database rules, and a real socket pair
for the engine link."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer

from gpumarket import kinds
from gpumarket.broker import endpoints, jobs, ledger, views
from gpumarket.broker.admission import Needs, NewJob
from gpumarket.broker.autoscaler import Autoscaler, Decision, Watch, decide
from gpumarket.broker.metrics import BrokerMetrics
from gpumarket.broker.openai_api import OpenAIApi
from gpumarket.broker.serving import Endpoint, Refused, Serving
from gpumarket.broker.sessions import CHUNKS_PER_S, ProviderSession
from gpumarket.broker.store import Store
from gpumarket.proto.envelope import seal
from gpumarket.proto.errors import FailedPrecondition, InvalidArgument
from gpumarket.proto.identity import Identity
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import gateway_pb2_grpc
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.proto.wire import CLIENT_OPTIONS, MAX_MESSAGE_BYTES, SERVER_OPTIONS
from gpumarket.provider.replica import EngineLink
from gpumarket.provider.runners.engine import RequestError, chat_prompt

SETTINGS = {"task": "generate", "min_replicas": 1, "max_replicas": 3, "max_concurrency": 4,
            "target": 4, "window_s": 5, "idle_s": 60, "max_tokens": 0, "max_seq_len": 0}
RUNNING = pb.JOB_STATE_RUNNING
DONE = {"done": True, "finish_reason": "stop", "prompt_tokens": 3, "output_tokens": 1}


# -- fake providers: sessions that answer InferenceRequests ---------------------------------

def honest(request: dict) -> list[dict]:
    return [{"text": "hi"}, dict(DONE)]


class AnsweringSession:
    """A provider's session as the router sees it: ``send`` takes BrokerMessages; an
    InferenceRequest is answered (soon, on the loop) with what ``answer`` returns for its
    decoded body, sent back as one InferenceChunk; None: silence."""

    def __init__(self, provider_id: str, answer=honest) -> None:
        self.provider_id, self.answer = provider_id, answer
        self.sent: list[gw.BrokerMessage] = []
        self.serving: Serving | None = None

    def send(self, message: gw.BrokerMessage) -> None:
        self.sent.append(message)
        if message.WhichOneof("msg") == "infer" and self.answer is not None:
            request = message.infer
            messages = self.answer(json.loads(request.body))
            if messages is not None:
                data = b"".join(json.dumps(m).encode() + b"\n" for m in messages)
                asyncio.get_running_loop().call_soon(
                    self.serving.chunk, self.provider_id,
                    gw.InferenceChunk(request_id=request.request_id, data=data,
                                      last=any(m.get("done") for m in messages)))

    def requests(self) -> list[gw.InferenceRequest]:
        return [m.infer for m in self.sent if m.WhichOneof("msg") == "infer"]


def router(sessions: dict[str, AnsweringSession], queue_wait_s: float = 0.5,
           cold_start_s: float = 0.5, request_timeout_s: float = 5.0,
           **settings) -> tuple[Serving, Endpoint]:
    serving = Serving(sessions, BrokerMetrics(), queue_wait_s, cold_start_s, request_timeout_s)
    for s in sessions.values():
        s.serving = serving
    serving.sync([live_row(**settings)])
    return serving, serving.endpoints["ep"]


def live_row(**settings) -> dict:
    return {"id": "ep", "client_id": "c1", "name": "tiny", "created_at_ms": 0,
            "settings": {**SETTINGS, **settings}, "replicas": []}


def ready(serving: Serving, provider: str, job: str, concurrency: int = 4,
          max_seq_len: int = 0) -> None:
    serving.ready(provider, job, 1, "ep", gw.ReplicaReady(
        engine="test", task="generate", max_concurrency=concurrency, max_seq_len=max_seq_len))


async def collect(agen) -> list[dict]:
    return [m async for m in agen]


# -- the router -----------------------------------------------------------------------------

def test_a_fast_failing_replica_draws_every_request_and_its_retries():
    """Fixed hole: routing is "fewest in flight, then lowest TPOT", and a retry picks again with the
    same rule. A replica that answers every request at once with a 503 (a hostile provider, or
    a broken one whose daemon answers "no such replica on this provider") always has 0 in
    flight and TPOT 0.0 (never measured), so it wins every pick, the request's two retries
    included: the request fails on "3 replicas" that were all the same one, while a healthy
    replica sits idle. One bad replica black-holes the endpoint (broker/serving.py:94 best(),
    :313 _acquire on retry)."""
    async def main():
        bad = AnsweringSession("p1", lambda r: [{"error": "no such replica on this provider",
                                                 "status": 503, "done": True}])
        good = AnsweringSession("p2")
        serving, ep = router({"p1": bad, "p2": good})
        ready(serving, "p1", "r1")
        ready(serving, "p2", "r2")
        ep.replicas["r2"].tpot_s = 0.02      # it has served before: its TPOT is measured
        try:
            messages = await asyncio.wait_for(collect(serving.run(ep, {"op": "complete"})), 5)
        except Refused as exc:
            messages = [{"refused": exc.status, "message": exc.message}]
        assert len(bad.requests()) <= 1, (
            f"the failing replica got the request {len(bad.requests())} times, the healthy one"
            f" {len(good.requests())} times; the caller got {messages[-1]}")
        assert messages[-1].get("done") and "error" not in messages[-1], messages
    asyncio.run(main())


def test_tiny_chunks_after_a_long_partial_line_stall_the_brokers_event_loop():
    """Fixed hole: Serving.chunk appends each chunk to the request's buffer and then splits the
    whole buffer and copies its rest (broker/serving.py:228-235), on the event loop. A
    provider sends a line just under MAX_BUFFER (4 MiB) without its newline, then one-byte
    chunks: each costs two 4 MiB copies and a scan, ~10 ms here, and the gateway allows
    20,000 chunks a second (bursts of 200,000) per provider. ~100 chunks a second from one
    provider, for one request it was sent, stall the broker's only event loop: every
    provider's heartbeats (leases then time out market-wide), every API call, every RPC."""
    async def main():
        serving, ep = router({"p1": AnsweringSession("p1", answer=None)})
        ready(serving, "p1", "r1")
        agen = serving.run(ep, {"op": "complete"})
        first = asyncio.create_task(agen.__anext__())
        await asyncio.sleep(0.05)
        rid = serving.sessions["p1"].requests()[0].request_id
        serving.chunk("p1", gw.InferenceChunk(request_id=rid,
                                              data=b'{"text": "' + b"a" * ((4 << 20) - 3000)))
        began = time.perf_counter()
        for _ in range(100):
            serving.chunk("p1", gw.InferenceChunk(request_id=rid, data=b"a"))
        each = (time.perf_counter() - began) / 100
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await agen.aclose()
        assert each < 0.001, (f"{each * 1000:.1f} ms of the event loop per one-byte chunk:"
                              f" at the {CHUNKS_PER_S:,.0f} chunks/s a provider may send,"
                              f" {each * CHUNKS_PER_S:,.0f} s of work a second")
    asyncio.run(main())


def test_reported_token_counts_are_not_bounded_by_the_request():
    """Fixed hole: docs/serving.md says output tokens are counted "as the engine reports them
    (bounded by the request's max_tokens)", but broker/serving.py:373 (_count) takes any int
    below 2**31. A provider reports 2**31 - 1 output tokens for a max_tokens=4 request: that is
    what goes to the endpoint_usage table (the unit a per-token price would bill), to the
    client's ``usage``, to /metrics, and it drives the replica's TPOT to ~0, which wins it the
    routing tie-break (:94)."""
    async def main():
        liar = AnsweringSession("p1", lambda r: [{"text": "a"}, {
            "done": True, "finish_reason": "length", "prompt_tokens": 2**31 - 1,
            "output_tokens": 2**31 - 1}])
        serving, ep = router({"p1": liar})
        ready(serving, "p1", "r1")
        await collect(serving.run(ep, {"op": "complete", "prompt": "hi", "max_tokens": 4}))
        (_, _, _, _, requests, _, prompt, output), = serving.take_usage()
        assert requests == 1
        assert output <= 4, f"usage recorded {output:,} output tokens for max_tokens=4"
        assert prompt <= 1 << 20, f"usage recorded {prompt:,} prompt tokens for a 2-char prompt"
    asyncio.run(main())


def test_a_replica_may_stream_without_bound_past_max_tokens():
    """Fixed hole: nothing bounds how many pieces one answer has but MAX_ANSWER (64 MiB of lines):
    for a max_tokens=4 request a provider sends 100,000 pieces (1.3 MB) and every one is
    parsed and queued (broker/serving.py:249, an unbounded asyncio.Queue). Each tiny line
    becomes a dict of ~200+ bytes: 64 MiB of ``{}`` lines is ~22 million queued dicts, several
    GB for one request while its HTTP client reads slowly."""
    async def main():
        serving, ep = router({"p1": AnsweringSession("p1", answer=None)})
        ready(serving, "p1", "r1")
        agen = serving.run(ep, {"op": "complete", "prompt": "hi", "max_tokens": 4})
        first = asyncio.create_task(agen.__anext__())
        await asyncio.sleep(0.05)
        rid = serving.sessions["p1"].requests()[0].request_id
        serving.chunk("p1", gw.InferenceChunk(request_id=rid, data=b'{"text":"x"}\n' * 100_000))
        await first
        queued = serving.pending[rid].queue.qsize()
        await agen.aclose()
        assert queued <= 4 + 1, f"{queued:,} pieces queued for a max_tokens=4 request"
    asyncio.run(main())


def test_a_slow_drip_replica_holds_a_request_open_past_request_timeout():
    """Fixed hole: request_timeout bounds the silence between two messages, not the request: a
    replica that sends one piece just inside each timeout keeps the request (and its slot,
    and the caller) forever; "Nothing waits forever" (docs/serving.md) does not hold
    (broker/serving.py:327). Here request_timeout is 0.3 s and the request is still open
    after 2 s (ten timeouts)."""
    async def main():
        serving, ep = router({"p1": AnsweringSession("p1", answer=None)},
                             request_timeout_s=0.3)
        ready(serving, "p1", "r1")
        task = asyncio.create_task(collect(serving.run(ep, {"op": "complete",
                                                              "max_tokens": 4})))
        await asyncio.sleep(0.05)
        rid = serving.sessions["p1"].requests()[0].request_id
        began = time.monotonic()
        while time.monotonic() - began < 2.0 and not task.done():
            serving.chunk("p1", gw.InferenceChunk(request_id=rid, data=b'{"text":"."}\n'))
            await asyncio.sleep(0.2)
        still_open = not task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert not still_open, "a request with request_timeout 0.3 s was still open after 2 s"
    asyncio.run(main())


def test_a_deleted_endpoints_request_is_sent_again_to_its_stopped_replica():
    """Fixed hole (low): when an endpoint stops serving, sync() pops it from ``endpoints`` before it
    drops its replicas, so drop() (broker/serving.py:213) no longer finds the endpoint and
    leaves the replicas in the old Endpoint object. The in-flight request fails with the
    retryable 503 and run() retries it on the same old object: the request is sent again to
    the stopped replica (of a deleted endpoint), and its usage is counted on a replica no
    take_usage() will ever see."""
    async def main():
        p1 = AnsweringSession("p1", answer=None)
        serving, ep = router({"p1": p1})
        ready(serving, "p1", "r1")
        task = asyncio.create_task(collect(serving.run(ep, {"op": "complete"})))
        await asyncio.sleep(0.05)
        serving.sync([])            # the endpoint was deleted
        await asyncio.sleep(0.1)
        sent = len(p1.requests())
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert sent == 1, f"the deleted endpoint's request was sent {sent} times to its replica"
    asyncio.run(main())


def test_chunks_are_only_taken_from_the_provider_the_request_was_sent_to():
    """Holds: another provider (even one serving the same endpoint) cannot inject pieces or
    the final message into a request it was not sent, nor end it early."""
    async def main():
        serving, ep = router({"p1": AnsweringSession("p1", answer=None),
                              "p2": AnsweringSession("p2", answer=None)})
        ready(serving, "p1", "r1")
        ready(serving, "p2", "r2")
        ep.replicas["r2"].in_flight = 1
        task = asyncio.create_task(collect(serving.run(ep, {"op": "complete",
                                                             "max_tokens": 4})))
        await asyncio.sleep(0.05)
        rid = serving.sessions["p1"].requests()[0].request_id
        for guess in (rid, rid.replace("-1", "-2")):
            serving.chunk("p2", gw.InferenceChunk(
                request_id=guess, last=True,
                data=json.dumps({"text": "injected"}).encode() + b"\n"
                + json.dumps({**DONE, "output_tokens": 999}).encode() + b"\n"))
        await asyncio.sleep(0.05)
        assert not task.done()
        serving.chunk("p1", gw.InferenceChunk(request_id=rid, last=True,
                                              data=json.dumps(DONE).encode() + b"\n"))
        messages = await task
        assert messages == [DONE]
        assert serving.take_usage() == [("r1.1", "ep", "r1", "p1", 1, 0, 3, 1)]
    asyncio.run(main())


def test_a_replicas_claimed_concurrency_is_capped_by_the_endpoint():
    """Holds: a replica announcing max_concurrency 2**31-1 gets the endpoint's own."""
    serving, ep = router({"p1": AnsweringSession("p1")}, max_concurrency=3)
    ready(serving, "p1", "r1", concurrency=2**31 - 1)
    assert ep.replicas["r1"].max_concurrency == 3


def test_a_malformed_or_nested_answer_line_ends_only_that_request():
    """Holds for malformed lines (502 and a cancel). A line nested deeper than the JSON
    parser's recursion limit raises RecursionError out of Serving.chunk (only ValueError is
    caught, broker/serving.py:239): the gateway then ends that provider's own session with a
    logged traceback; the provider only hurts itself, so this pins the malformed case and
    records the nested one."""
    async def main():
        serving, ep = router({"p1": AnsweringSession("p1", answer=None)})
        ready(serving, "p1", "r1")
        agen = serving.run(ep, {"op": "complete"})
        first = asyncio.create_task(agen.__anext__())
        await asyncio.sleep(0.05)
        rid = serving.sessions["p1"].requests()[0].request_id
        serving.chunk("p1", gw.InferenceChunk(request_id=rid, data=b"not json\n"))
        final = await first
        assert final["status"] == 502 and "malformed" in final["error"]
        await agen.aclose()
        with pytest.raises(RecursionError):
            json.loads(b"[" * 100_000)
    asyncio.run(main())


# -- the OpenAI-compatible API --------------------------------------------------------------

class FakeStore:
    """What openai_api reads: a key's endpoint, and the live endpoints. ``gate``, if set, holds
    key lookups until it is set (a slow database)."""

    def __init__(self, keys: dict[str, str | None], live: list[dict]) -> None:
        self.keys, self.live, self.gate = keys, live, None
        self.lookups = 0

    async def read(self, fn, *args):
        if fn is endpoints.key_endpoint:
            self.lookups += 1
            found = self.keys.get(args[0])
            if self.gate is not None:
                await self.gate.wait()
            return found
        if fn is endpoints.live:
            return self.live
        raise AssertionError(f"unexpected read {fn.__name__}")


class FakeState:
    def __init__(self, store: FakeStore) -> None:
        self.store, self.metrics = store, BrokerMetrics()


KEY, OTHER_KEY = "gm-mine", "gm-theirs"


def api_for(sessions: dict[str, AnsweringSession], **settings):
    """(api, serving, store): endpoint "tiny" (id ep) of client c1 opened by KEY, and
    endpoint "theirs" (id ep2) of client c2 opened by OTHER_KEY, with no replica."""
    serving, _ = router(sessions, **settings)
    theirs = {**live_row(), "id": "ep2", "client_id": "c2", "name": "theirs"}
    store = FakeStore({KEY: "ep", OTHER_KEY: "ep2"}, [live_row(**settings), theirs])
    serving.sync(store.live)
    return OpenAIApi(FakeState(store), serving), serving, store


def chat(model: str = "tiny", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], **extra}


async def post(client: TestClient, path: str, body, key: str | None = KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    response = await client.post(path, data=data, headers=headers)
    text = await response.text()
    try:
        return response.status, json.loads(text)
    except ValueError:
        return response.status, text


def is_openai_error(body) -> bool:
    return isinstance(body, dict) and set(body.get("error", {})) >= {
        "message", "type", "param", "code"}


def test_one_replica_clamps_max_tokens_for_the_whole_endpoint():
    """Fixed hole: with the endpoint's max_tokens and max_seq_len left at 0 (the defaults), the
    largest max_tokens a request may ask is the *smallest* max_seq_len any ready replica
    announced (broker/openai_api.py:197 _limit). One hostile replica announcing max_seq_len 1
    makes every request with max_tokens > 1 a 400 (and the default max_tokens 1), even those
    the healthy replica would have served."""
    async def main():
        api, serving, _ = api_for({"p1": AnsweringSession("p1"), "p2": AnsweringSession("p2")})
        ready(serving, "p1", "r1", max_seq_len=2048)
        ready(serving, "p2", "r2", max_seq_len=1)          # the hostile one
        async with TestClient(TestServer(api.app())) as client:
            status, body = await post(client, "/v1/chat/completions", chat(max_tokens=16))
        assert status == 200, f"{status}: {body}"
    asyncio.run(main())


def test_stream_options_that_is_not_an_object_is_a_500():
    """Fixed hole: ``"stream_options": "yes"`` (or a list, or a number) with ``"stream": true`` passes
    completion_request() and the request is run on a replica; then
    ``(body.get("stream_options") or {}).get(...)`` (broker/openai_api.py:236), outside the
    try, raises AttributeError: a 500 in aiohttp's text format with a traceback in the
    broker's log, instead of OpenAI's 400. The replica did the work, and its slot is only
    freed when the abandoned answer generator is garbage collected."""
    async def main():
        api, serving, _ = api_for({"p1": AnsweringSession("p1")})
        ready(serving, "p1", "r1")
        async with TestClient(TestServer(api.app())) as client:
            status, body = await post(client, "/v1/chat/completions",
                                      chat(stream=True, stream_options="yes"))
        assert status == 400 and is_openai_error(body), f"{status}: {body}"
    asyncio.run(main())


def test_a_deeply_nested_body_is_a_500():
    """Fixed hole: a 200 kB body of ``[[[[...`` makes json.loads raise RecursionError, which
    broker/openai_api.py:183-184 does not catch (only ValueError): a 500 with a traceback in the
    log, for any caller with a key, instead of OpenAI's 400 "the request body is not JSON"."""
    async def main():
        api, serving, _ = api_for({"p1": AnsweringSession("p1")})
        ready(serving, "p1", "r1")
        async with TestClient(TestServer(api.app())) as client:
            status, body = await post(client, "/v1/chat/completions", "[" * 200_000)
        assert status == 400 and is_openai_error(body), f"{status}: {str(body)[:200]}"
    asyncio.run(main())


async def through_grpc(messages: list[gw.BrokerMessage]) -> tuple[list[str], object]:
    """Write ``messages`` from a gRPC server to a client as the broker's gateway writes to a
    provider's session (the options both ends use, proto/wire.py); returns the request ids
    the client received and the status its stream ended with (None: it ended cleanly)."""
    received: list[str] = []

    class Gateway(gateway_pb2_grpc.ProviderGatewayServicer):
        async def Session(self, request_iterator, context):
            await context.read()
            for message in messages:
                try:
                    await context.write(message)
                except Exception:       # noqa: BLE001 (what the broker's _write_loop hits)
                    return

    server = grpc.aio.server(options=SERVER_OPTIONS)
    gateway_pb2_grpc.add_ProviderGatewayServicer_to_server(Gateway(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    error = None
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                             options=CLIENT_OPTIONS) as channel:
            call = gateway_pb2_grpc.ProviderGatewayStub(channel).Session()
            await call.write(gw.ProviderMessage(heartbeat=gw.Heartbeat()))
            try:
                while (m := await asyncio.wait_for(call.read(), 10)) is not grpc.aio.EOF:
                    received.append(m.infer.request_id)
            except grpc.aio.AioRpcError as exc:
                error = exc.code()
    finally:
        await server.stop(0)
    return received, error


def test_one_api_call_can_cut_the_providers_session():
    """Fixed hole: the API takes a 4 MiB body, but the broker re-encodes it with json.dumps, which
    escapes every non-ASCII character (``é``, 2 bytes, becomes ``\\u00e9``, 6 bytes): a valid
    3.8 MB chat request becomes an 11.4 MB InferenceRequest, nearly three times the gRPC
    limit both ends use (proto/wire.py MAX_MESSAGE_BYTES, 4 MiB), and broker/serving.py:322
    sends it. Written on a real gRPC stream with those options, gRPC refuses it on the
    broker's side ("Sent message larger than max") and ends the whole stream with
    RESOURCE_EXHAUSTED: the provider's session, with every replica and lease it carries for
    every client, is cut by one API call from anyone with any key, as often as they like.
    The messages before and after it never arrive either."""
    async def main():
        api, serving, _ = api_for({"p1": AnsweringSession("p1", answer=None)},
                                  request_timeout_s=0.5)
        ready(serving, "p1", "r1")
        text = "é" * 950_000                                  # < MAX_TEXT characters each
        raw = json.dumps({"model": "tiny", "max_tokens": 1, "messages": [
            {"role": "user", "content": text}, {"role": "user", "content": text}]},
            ensure_ascii=False).encode()
        assert len(raw) < 4 << 20
        async with TestClient(TestServer(api.app())) as client:
            status, _ = await post(client, "/v1/chat/completions", raw)
        sent = serving.sessions["p1"].requests()
        if not sent:
            assert 400 <= status < 500         # refused up front: fine
            return
        size = gw.BrokerMessage(infer=sent[0]).ByteSize()
        before = gw.BrokerMessage(infer=gw.InferenceRequest(request_id="before"))
        after = gw.BrokerMessage(infer=gw.InferenceRequest(request_id="after"))
        received, error = await through_grpc([before, gw.BrokerMessage(infer=sent[0]), after])
        assert error is None and received == ["before", sent[0].request_id, "after"], (
            f"a {len(raw):,}-byte API request became a {size:,}-byte InferenceRequest (limit"
            f" {MAX_MESSAGE_BYTES:,}); the provider got {received} and then its session ended"
            f" with {error}")
    asyncio.run(main())


def test_requests_waiting_for_a_replica_pin_unbounded_broker_memory():
    """Fixed: requests' bodies waiting or in flight are capped broker-wide (serving's
    MAX_HELD_BYTES, a 429 past it), so what they pin is bounded whatever the queues. Was: a
    request keeps its raw body, the parsed body and its re-encoded JSON (three
    times the characters, see above) while it waits for a slot: ~17 MB for a 3.8 MB body,
    measured here. An endpoint queues up to 1,024 of them (queue_limit) for up to cold_start
    (300 s) when no replica ever becomes ready (min_replicas 0, a max_price no offer meets),
    which costs its owner nothing per request; one client may have any number of endpoints,
    and nothing caps waiting bytes broker-wide (broker/serving.py:311, :84). One client with a
    key to its own endpoint pins ~17 GB of the broker that every client and provider needs."""
    async def main():
        import gc
        import tracemalloc

        api, serving, _ = api_for({"p1": AnsweringSession("p1")}, cold_start_s=30,
                                  max_concurrency=1024, max_replicas=64)
        ep = serving.endpoints["ep"]
        text = "é" * 950_000
        raw = json.dumps({"model": "tiny", "max_tokens": 1, "messages": [
            {"role": "user", "content": text}, {"role": "user", "content": text}]},
            ensure_ascii=False).encode()
        async with TestClient(TestServer(api.app())) as client:
            gc.collect()
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                calls = [asyncio.create_task(client.post(
                    "/v1/chat/completions", data=raw,
                    headers={"Authorization": f"Bearer {KEY}"})) for _ in range(4)]
                while len(ep.waiting) < 4:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.2)
                gc.collect()
                each = (tracemalloc.get_traced_memory()[0] - base) / 4
            finally:
                tracemalloc.stop()
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
        from gpumarket.broker.serving import MAX_HELD_BYTES

        fit = min(ep.queue_limit, MAX_HELD_BYTES // len(raw) + 1)
        pinned = each * fit
        assert pinned <= 1 << 30, (
            f"each waiting request holds {each / 1e6:.1f} MB for a {len(raw) / 1e6:.1f} MB"
            f" body; the {fit} that fit the broker's budget hold {pinned / 1e9:.1f} GB")
    asyncio.run(main())


def test_a_replicas_nan_embeddings_make_the_api_answer_invalid_json():
    """Fixed hole (low): the embeddings check (broker/openai_api.py:320) takes any int or float,
    NaN, Infinity and booleans included (json.loads accepts NaN): the broker then answers the
    caller ``NaN`` in its body, which is not JSON (RFC 8259) and which strict clients (a
    browser's JSON.parse) refuse."""
    async def main():
        bad = AnsweringSession("p1", lambda r: [{"embeddings": [[float("nan"), float("inf"),
                                                                  True]], "prompt_tokens": 1,
                                                 "done": True}])
        api, serving, _ = api_for({"p1": bad}, task="embed")
        ready(serving, "p1", "r1")
        async with TestClient(TestServer(api.app())) as client:
            response = await client.post("/v1/embeddings", data=json.dumps(
                {"model": "tiny", "input": "x", "encoding_format": "float"}),
                headers={"Authorization": f"Bearer {KEY}"})
            text = await response.text()

        def strict(value):
            raise ValueError(f"not JSON: {value}")
        try:
            json.loads(text, parse_constant=strict)
        except ValueError as exc:
            pytest.fail(f"{response.status}: {exc}: {text[:200]}")
    asyncio.run(main())


def test_a_lookup_in_flight_recaches_a_key_revoked_meanwhile():
    """Fixed (a generation counter on the cache). Was: revoking clears the key cache (broker/marketplace.py RevokeEndpointKey), but
    a lookup that began before the revocation and ends after it writes its stale answer back
    into the cache (broker/openai_api.py:165-166): the revoked key then works for another
    KEY_CACHE_S (2 s). docs/serving.md: "it stops working at once"."""
    async def main():
        api, serving, store = api_for({"p1": AnsweringSession("p1")})
        async with TestClient(TestServer(api.app())) as client:
            store.gate = asyncio.Event()
            slow = asyncio.create_task(client.get("/v1/models",
                                                  headers={"Authorization": f"Bearer {KEY}"}))
            while store.lookups == 0:
                await asyncio.sleep(0.01)
            store.keys[KEY] = None           # revoked in the database ...
            serving.forget_keys()            # ... and the cache cleared, as RevokeEndpointKey does
            store.gate.set()
            await (await slow).text()
            after = await client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            assert after.status == 401, f"the revoked key still answered {after.status}"
    asyncio.run(main())


def test_a_key_opens_its_own_endpoint_and_no_other():
    """Holds: another client's key, an unknown key, no key, a revoked key (cache cleared) and a
    key whose endpoint stopped serving get OpenAI's errors (404 model_not_found for the other
    client's model, 401 otherwise), and nothing reaches a replica."""
    async def main():
        p1 = AnsweringSession("p1")
        api, serving, store = api_for({"p1": p1})
        ready(serving, "p1", "r1")
        async with TestClient(TestServer(api.app())) as client:
            status, body = await post(client, "/v1/chat/completions", chat("tiny"), OTHER_KEY)
            assert status == 404 and body["error"]["code"] == "model_not_found", body
            status, body = await post(client, "/v1/chat/completions", chat("theirs"), KEY)
            assert status == 404 and body["error"]["code"] == "model_not_found", body
            for key in ("gm-unknown", None, "x" * 8000):
                status, body = await post(client, "/v1/chat/completions", chat(), key)
                assert status == 401 and is_openai_error(body), body
            models = await client.get("/v1/models", headers={"Authorization": "Basic " + KEY})
            assert models.status == 401
            status, body = await post(client, "/v1/chat/completions", chat(max_tokens=4), KEY)
            assert status == 200 and body["choices"][0]["message"]["content"] == "hi", body
            store.keys[KEY] = None
            serving.keys.clear()
            status, body = await post(client, "/v1/chat/completions", chat(), KEY)
            assert status == 401, body
            store.keys[KEY] = "ep"           # the key is fine, but its endpoint was deleted
            serving.keys.clear()
            store.live = [r for r in store.live if r["id"] != "ep"]
            serving.sync(store.live)
            status, body = await post(client, "/v1/chat/completions", chat(), KEY)
            assert status == 401, body
        assert len(p1.requests()) == 1
    asyncio.run(main())


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b'"a string"', None),
    (json.dumps(chat(messages="hi")), "messages"),
    (json.dumps(chat(messages=[{"role": "wizard", "content": "x"}])), "messages[0].role"),
    (json.dumps(chat(messages=[{"role": "user", "content": {"a": 1}}])), "messages[0].content"),
    (json.dumps(chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}])),
     "messages[0].content"),
    (json.dumps(chat(max_tokens=True)), "max_tokens"),
    (json.dumps(chat(max_tokens=10**40)), "max_tokens"),
    (json.dumps(chat(max_tokens=1.5)), "max_tokens"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
     "temperature"),
    (json.dumps(chat(top_p=-1)), "top_p"),
    (json.dumps(chat(n=2)), "n"),
    (json.dumps(chat(stop=["a"] * 5)), "stop"),
    (json.dumps(chat(stop=[""])), "stop"),
    (json.dumps(chat(seed=-1)), "seed"),
    (json.dumps(chat(stream="yes")), "stream"),
    (json.dumps({"model": "tiny", "prompt": ["a", "b"]}), "prompt"),
    (json.dumps({"model": ["tiny"], "messages": []}), "model"),
])
def test_malformed_requests_are_openai_400s_and_reach_no_replica(body, param):
    """Holds: each malformed request is a 4xx in OpenAI's format, and no replica sees it."""
    async def main():
        p1 = AnsweringSession("p1")
        api, serving, _ = api_for({"p1": p1}, max_tokens=64)
        ready(serving, "p1", "r1")
        path = "/v1/completions" if b'"prompt"' in (body if isinstance(body, bytes)
                                                     else body.encode()) else "/v1/chat/completions"
        async with TestClient(TestServer(api.app())) as client:
            status, answer = await post(client, path, body)
        assert status in (400, 404) and is_openai_error(answer), f"{status}: {answer}"
        assert param is None or answer["error"]["param"] == param, answer
        assert p1.requests() == []
    asyncio.run(main())


def test_a_body_over_4_mib_is_an_openai_413():
    """Holds: the body limit is checked before the body is parsed."""
    async def main():
        api, _, _ = api_for({"p1": AnsweringSession("p1")})
        async with TestClient(TestServer(api.app())) as client:
            status, body = await post(client, "/v1/chat/completions", b"x" * (5 << 20))
        assert status == 413 and is_openai_error(body), f"{status}: {str(body)[:200]}"
    asyncio.run(main())


def test_roles_the_api_accepts_are_roles_the_engine_takes():
    """Fixed: the broker sends the engine only roles it takes (developer as system) and
    refuses the others itself. Was: the API accepted developer and tool, which the engine
    refused after a replica had taken the request."""
    from gpumarket.broker.openai_api import ApiError, completion_request

    with pytest.raises(RequestError):
        chat_prompt(object(), [{"role": "system", "content": "x"}, {"role": "wizard",
                                                                    "content": "x"}])
    work = completion_request({"messages": [{"role": "developer", "content": "be brief"},
                                            {"role": "user", "content": "hi"}]}, True, 16)
    chat_prompt(object(), work["messages"])      # the engine takes what the broker sends
    assert work["messages"][0]["role"] == "system"
    with pytest.raises(ApiError) as refused:
        completion_request({"messages": [{"role": "tool", "content": "x"}]}, True, 16)
    assert refused.value.status == 400


# -- the autoscaler ---------------------------------------------------------------------------

def replica_row(i: int, state: int = RUNNING, ready_: bool = True) -> dict:
    return {"id": f"r{i}", "part": i, "state": state, "epoch": 1, "provider_id": f"p{i}",
            "progress_step": int(ready_), "attempt": 1}


def test_a_replica_that_never_becomes_ready_is_never_replaced():
    """Fixed: a replica not ready within cold_start of its lease is lost (Autoscaler._late)
    and leased again elsewhere. Was: a replica whose provider reports it started but never ready (a hostile provider,
    or an engine stuck loading) counts as live for min_replicas, blocks scale-out as "still
    starting" (broker/autoscaler.py:93) and, while requests keep arriving, is never idle
    enough to retire; nothing gives up on it: there is no deadline for ``ready``. Requests wait
    cold_start each and get 503s for as long as the lease lasts (an endpoint has no
    max_runtime), and settle_running pays it every minute."""
    from types import SimpleNamespace

    from gpumarket.proto.jobspec import now_ms

    class Written:
        def __init__(self) -> None:
            self.calls = []

        async def write(self, fn, *args):
            self.calls.append((fn, args))
            return True

    store = Written()
    state = SimpleNamespace(store=store, metrics=BrokerMetrics(), sessions={},
                            config=SimpleNamespace(cold_start_s=300.0))
    ep = Endpoint("ep", "c1", "tiny", {**SETTINGS, "min_replicas": 1, "max_replicas": 3})
    scaler = Autoscaler(state, Serving({}, BrokerMetrics(), 1, 1, 1))
    fresh = {**replica_row(1, ready_=False), "lease_id": "r1.1", "issued_at_ms": now_ms()}
    stale = {**replica_row(2, ready_=False), "lease_id": "r2.1",
             "issued_at_ms": now_ms() - 301_000}
    served = {**replica_row(3), "lease_id": "r3.1", "issued_at_ms": now_ms() - 10**9}
    assert asyncio.run(scaler._late(ep, [fresh, stale, served]))
    assert [(fn.__name__, args[0]) for fn, args in store.calls] == [("lose_lease", "r2.1")]


def test_scale_in_races_a_request_routed_to_the_victim_meanwhile():
    """Fixed hole (low): decide() picks a victim while nothing is in flight, but apply() awaits the
    database (endpoints.retire) before it drops the replica from the router
    (broker/autoscaler.py:172-178). A request that arrives in between is routed to the victim,
    then fails with the retire; with no other replica it waits for a cold start and gets a
    503. The router should stop routing to the victim before the awaited write."""
    class SlowStore:
        async def write(self, fn, *args):
            await asyncio.sleep(0.1)

    class State:
        store, metrics = SlowStore(), BrokerMetrics()

    async def main():
        p1 = AnsweringSession("p1", answer=None)       # a long generation: no answer yet
        serving, ep = router({"p1": p1}, min_replicas=0, cold_start_s=0.3)
        ready(serving, "p1", "r1")
        scaler = Autoscaler(State(), serving)
        retiring = asyncio.create_task(scaler.apply(ep, Watch(), Decision(
            retire=("r1",), retire_why="scale in: idle")))
        await asyncio.sleep(0.02)
        request = asyncio.create_task(collect(serving.run(ep, {"op": "complete"})))
        await retiring
        try:
            outcome = (await request)[-1]
        except Refused as exc:
            outcome = {"refused": exc.status, "error": exc.message}
        # Fixed: the victim leaves the router before the awaited write, so the request is not
        # sent to it; it waits for a new replica instead (a 503 here: cold_start is 0.3 s).
        assert not p1.requests(), f"sent to the retiring replica: {outcome}"
        assert outcome.get("refused") == 503 or "error" not in outcome, outcome
    asyncio.run(main())


def test_scale_out_never_passes_max_replicas():
    """Holds: sustained load over target never adds past max_replicas, and nothing is added
    while a replica is still starting."""
    ep = Endpoint("ep", "c1", "tiny", {**SETTINGS, "max_replicas": 2, "window_s": 1})
    ep.waiting.extend([object()] * 500)
    watch = Watch(last_change=0.0)
    rows = [replica_row(1), replica_row(2)]
    assert all(decide(ep, rows, watch, t, wanted=True).add == 0 for t in range(0, 50, 2))
    rows = [replica_row(1, ready_=False)]
    assert all(decide(ep, rows, watch, t, wanted=True).add == 0 for t in range(50, 100, 2))


# -- the database: ready, money, crash loops --------------------------------------------------

BROKER = Identity.generate()
CLIENT = Identity.generate()


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "broker.db")
    s.open()
    yield s
    s.close()


def endpoint_job(min_replicas: int, max_replicas: int, hold: int = 0,
                 enforce: bool = False) -> NewJob:
    spec = pb.JobSpec(name="tiny", kind=endpoints.KIND, max_price_per_gpu_hour=1.0)
    kinds.get(endpoints.KIND).write(spec, {"model_name": "m", "min_replicas": min_replicas,
                                           "max_replicas": max_replicas})
    needs = Needs(kind=endpoints.KIND, gpus=1, min_memory_bytes=0,
                  accelerator=pb.ACCELERATOR_UNSPECIFIED, max_price_per_gpu_hour=1.0)
    return NewJob(id="ep", client_id=CLIENT.id, name="tiny",
                  spec=seal(CLIENT, spec).SerializeToString(), spec_sha256="0" * 64,
                  needs=needs, expires_at_ms=10**13, max_attempts=3, nonce=os.urandom(16).hex(),
                  hold=hold, enforce_funds=enforce)


def lease(db, job_id: str, provider: str, now: int) -> None:
    jobs.create_lease(db, job_id, provider, [0], 1.0, now, 60_000, 0,
                      lambda lease_: seal(BROKER, lease_))
    jobs.mark_started(db, job_id, jobs.job_row(db, job_id)["epoch"], provider, now)


def test_ready_is_refused_without_the_lease_or_for_a_plain_job(store):
    """Holds: ``ready`` is taken only from the provider holding the replica's current lease,
    and only for an endpoint replica (not the endpoint itself, not another kind of job)."""
    async def main():
        w = store.write
        await w(endpoints.submit, endpoint_job(1, 2), 1)
        await w(lease, "ep-r1", "p1", 2)
        for job_id, epoch, provider, error in (("ep-r1", 1, "p2", FailedPrecondition),
                                               ("ep-r1", 2, "p1", FailedPrecondition),
                                               ("ep", 0, "p1", FailedPrecondition),
                                               ("nope", 1, "p1", Exception)):
            with pytest.raises(error):
                await w(endpoints.mark_ready, job_id, epoch, provider, "x", 3)
        spec = pb.JobSpec(name="plain", kind=pb.JOB_KIND_TRAINING)
        plain = NewJob(id="j1", client_id=CLIENT.id, name="plain",
                       spec=seal(CLIENT, spec).SerializeToString(), spec_sha256="0" * 64,
                       needs=Needs(kind=pb.JOB_KIND_TRAINING, gpus=1, min_memory_bytes=0,
                                   accelerator=pb.ACCELERATOR_UNSPECIFIED,
                                   max_price_per_gpu_hour=1.0),
                       expires_at_ms=10**13, max_attempts=2, nonce=os.urandom(16).hex())
        await w(jobs.submit, plain, 4)
        await w(lease, "j1", "p1", 5)
        with pytest.raises(InvalidArgument):
            await w(endpoints.mark_ready, "j1", 1, "p1", "x", 6)
        job = await w(endpoints.mark_ready, "ep-r1", 1, "p1", "x", 7)
        assert job["parent_id"] == "ep"
    asyncio.run(main())


def test_a_retired_replica_is_paid_once_and_never_again(store):
    """Holds: settle_running pays each running replica for its time once (the next pass at
    the same instant pays nothing), retire pays the rest up to the retirement, and nothing is
    paid after it."""
    hour = 3_600_000

    def paid_to(db, provider: str) -> int:
        return ledger.balance(db, ledger.provider(provider))

    async def main():
        w = store.write
        await w(endpoints.submit, endpoint_job(1, 1), 0)
        await w(lease, "ep-r1", "p1", 0)
        assert await w(endpoints.settle_running, hour) == 1
        assert await w(endpoints.settle_running, hour) == 0
        first = await store.read(paid_to, "p1")
        assert first == ledger.units(1.0)
        await w(endpoints.retire, "ep-r1", "scale in", hour + hour // 2)
        second = await store.read(paid_to, "p1")
        assert second == first + ledger.units(1.0) // 2
        assert await w(endpoints.settle_running, 10 * hour) == 0
        assert await store.read(paid_to, "p1") == second
    asyncio.run(main())


def test_a_top_up_after_the_hold_ran_out_resumes_past_max_replicas(store):
    """Fixed hole: when the hold runs out, the replicas are paused (jobs.exhaust); decide() does not
    count PAUSED replicas as live (broker/autoscaler.py:58), so it adds min_replicas new ones;
    a top-up then resumes every paused replica as well (jobs.top_up walks all of the
    endpoint's "parts"): an endpoint with max_replicas 2 has 4 live replicas, and each
    exhaustion and top-up adds min_replicas more. The hold was sized for max_replicas."""
    hour = 3_600_000

    async def main():
        w = store.write
        await w(ledger.credit, CLIENT.id, ledger.units(1_000.0), "client", "", "op", "o1", 0)
        await w(endpoints.submit, endpoint_job(2, 2, hold=ledger.units(1.0), enforce=True), 0)
        await w(lease, "ep-r1", "p1", 0)
        await w(lease, "ep-r2", "p2", 0)
        for lease_id in await store.read(views.leases_over_hold, hour):
            await w(jobs.exhaust, lease_id, hour)
        rows = await store.read(endpoints.replicas, "ep")
        assert [r["state"] for r in rows] == [pb.JOB_STATE_PAUSED] * 2
        ep = Endpoint("ep", CLIENT.id, "tiny", (await store.read(endpoints.live))[0]["settings"])
        d = decide(ep, rows, Watch(last_change=0.0), 1.0, wanted=False)
        for _ in range(d.add):
            await w(endpoints.add_replica, "ep", hour, d.add_why)
        await w(jobs.top_up, "ep", CLIENT.id, ledger.units(100.0), hour + 1)
        live = [r for r in await store.read(endpoints.replicas, "ep")
                if r["state"] != pb.JOB_STATE_PAUSED]
        assert len(live) <= 2, f"{len(live)} live replicas for max_replicas 2: {live}"
    asyncio.run(main())


def test_one_provider_failing_three_new_replicas_fails_a_serving_endpoint(store):
    """Fixed hole: crash_loop (broker/endpoints.py:116) fails the whole endpoint once its three
    newest replicas failed before they were ready, whoever failed them and even while another
    replica serves. One provider that takes the replicas the autoscaler adds (each is a new
    job, so "previous providers" never steers them away) and reports ``failed`` before
    ``ready`` takes down a client's endpoint, healthy replicas and keys included."""
    async def main():
        w = store.write
        await w(endpoints.submit, endpoint_job(1, 4), 0)
        await w(lease, "ep-r1", "p1", 1)
        await w(endpoints.mark_ready, "ep-r1", 1, "p1", "batch", 2)      # serving
        for n in (2, 3, 4):
            replica = await w(endpoints.add_replica, "ep", 10 * n, "scale out")
            await w(lease, replica, "p9", 10 * n + 1)
            await w(jobs.fail, replica, 1, "p9", "engine crashed", 10 * n + 2)
        broken = await store.read(endpoints.crash_loop, "ep")
        assert broken == "", f"one provider failed a serving endpoint: {broken!r}"
    asyncio.run(main())


# -- the provider's link to its engine child (provider/replica.py) ---------------------------

async def engine_link() -> tuple[EngineLink, socket.socket, list[gw.ProviderMessage]]:
    """A link whose engine end is a socket the test writes to as the engine child would."""
    sent: list[gw.ProviderMessage] = []
    link = EngineLink(sent.append, lambda ready_: None)
    engine = socket.socket(fileno=link.child_fd)
    engine.setblocking(False)
    await link.start()
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(engine, b'{"event": "ready", "engine": "x", "task": "generate",'
                                    b' "max_concurrency": 4}\n')
    while link.ready is None:
        await asyncio.sleep(0.01)
    return link, engine, sent


def infer(request_id: str, body: bytes = b'{"op": "complete"}') -> gw.InferenceRequest:
    return gw.InferenceRequest(request_id=request_id, job_id="r1", epoch=1, body=body)


def chunks_for(sent: list[gw.ProviderMessage], request_id: str) -> list[gw.InferenceChunk]:
    return [m.chunk for m in sent if m.chunk.request_id == request_id]


def test_an_engine_line_nested_too_deep_wedges_the_link():
    """Fixed hole: EngineLink._handle catches only ValueError from json.loads
    (provider/replica.py:57 at 9686dab); a line of 100,000 ``[`` raises RecursionError, which kills the
    reader task without close(): the requests the engine owes never get their 503, the link
    still takes new requests (forward() sees an open writer) whose answers nobody reads, and
    the broker keeps routing to the replica. Each of them hangs until request_timeout."""
    async def main():
        link, engine, sent = await engine_link()
        loop = asyncio.get_running_loop()
        assert link.forward(infer("q1")) == ""
        await loop.sock_sendall(engine, b"[" * 100_000 + b"\n")
        await asyncio.sleep(0.1)
        taken = link.forward(infer("q2"))
        await loop.sock_sendall(engine, b'{"id": "q2", "done": true}\n')
        await asyncio.sleep(0.2)
        owed = chunks_for(sent, "q1") + chunks_for(sent, "q2")
        link.close()
        engine.close()
        assert owed, (f"after the nested line neither request got an answer or an error"
                      f" (the link still took q2: {taken!r})")
    asyncio.run(main())


def test_an_engine_that_stops_reading_grows_the_daemons_memory_without_bound():
    """Fixed hole: EngineLink.forward writes each request to the engine's socket without drain()
    or any bound on the write buffer (provider/replica.py:96 at 9686dab). An engine child
    that never reads its stdin (the job's own code, or one stuck in a long generate) makes
    the daemon buffer every request it is sent: here 100 requests of 1 MiB, all taken, ~100
    MiB in the daemon; the broker may send up to 4096 open requests of up to ~12 MiB each
    (and more as it cancels them). The daemon's memory is every tenant's on that host.
    (The working tree now refuses past MAX_UNREAD, 64 MiB: this test then passes.)"""
    async def main():
        link, engine, _ = await engine_link()
        body = json.dumps({"op": "complete", "prompt": "x" * (1 << 20)}).encode()
        taken = sum(link.forward(infer(f"q{i}", body)) == "" for i in range(100))
        buffered = link._writer.transport.get_write_buffer_size()
        link.close()
        engine.close()
        assert buffered <= 80 << 20, (f"{taken} requests taken, {buffered / 2**20:.0f} MiB"
                                      " buffered in the daemon for an engine that does not read")
    asyncio.run(main())


def test_engines_can_flood_past_the_brokers_chunk_limit_and_end_the_providers_session():
    """Fixed hole: every line an engine writes for an open request becomes at least one
    InferenceChunk (provider/replica.py:77-80; a 1 MiB line is 16), onto the provider's
    unbounded outbox (provider/session.py:61), and the broker ends a provider's whole
    session past CHUNKS_PER_S per session (20,000 a second, bursts of 200,000:
    broker/gateway.py:104). At 9686dab the daemon has no limit at all; the working tree adds
    one per engine link at the same 20,000 lines a second, which does not help once two
    replicas share a provider (or lines are over 64 KiB): here two engines each stay within
    their own limit and together get the provider's session ended, with every replica it
    serves for other clients and its heartbeats queued behind the flood. Honest load can hit
    it too: 8 replicas on an 8-GPU provider streaming 3,000 tokens a second each."""
    async def main():
        sent: list[gw.ProviderMessage] = []
        links = []
        for n in range(2):
            link, engine, mine = await engine_link()
            assert link.forward(infer(f"q{n}")) == ""
            line = json.dumps({"id": f"q{n}", "text": ""}).encode() + b"\n"
            for _ in range(150_000):
                link._handle(line)          # what _read does for each line the engine writes
            sent += mine
            links.append((link, engine))
        for link, engine in links:
            link.close()
            engine.close()
        limiter = ProviderSession("p1").chunks       # the gateway's, for this provider
        chunks = [m for m in sent if m.WhichOneof("msg") == "chunk"]
        refused = sum(not limiter.allow("") for _ in chunks)
        assert refused == 0, (f"the provider's engines sent {len(chunks):,} chunks in a burst;"
                              f" the broker refuses {refused:,} of them past"
                              f" {CHUNKS_PER_S:,.0f}/s and ends the provider's session")
    asyncio.run(main())


def test_the_engine_cannot_answer_requests_it_was_not_sent_nor_announce_twice():
    """Holds: lines for ids not open are dropped, a second ``ready`` is ignored, a line over
    MAX_LINE closes the link and every open request gets its 503."""
    async def main():
        link, engine, sent = await engine_link()
        loop = asyncio.get_running_loop()
        assert link.forward(infer("q1")) == ""
        await loop.sock_sendall(engine, b'{"id": "other", "text": "x", "done": true}\n'
                                        b'{"event": "ready", "max_concurrency": 9999}\n'
                                        b'{"id": "q1", "text": "ok"}\n')
        await asyncio.sleep(0.1)
        assert {m.chunk.request_id for m in sent} == {"q1"}
        assert link.ready.max_concurrency == 4
        try:
            await loop.sock_sendall(engine, b"x" * (2 << 20))
        except (BrokenPipeError, ConnectionResetError):
            pass                # the link closed its end on the over-long line
        await asyncio.sleep(0.2)
        last = chunks_for(sent, "q1")[-1]
        assert last.last and json.loads(last.data)["status"] == 503
        assert link.forward(infer("q2")) != ""
        engine.close()
    asyncio.run(main())
