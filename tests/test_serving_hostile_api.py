"""An attacker's pass over endpoints (docs/serving.md), the API part: what a hostile caller
(with a key, another client's key, or none) or a provider's answers can make the broker's
OpenAI-compatible API (broker/serving/openai_api.py) do, on aiohttp's test server. Docstrings that
start with "Fixed hole" describe a weakness the review found, now mended."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer

from gpumarket.broker.metrics import BrokerMetrics
from gpumarket.broker.serving import endpoints
from gpumarket.broker.serving.openai_api import OpenAIApi
from gpumarket.kinds.engine_protocol import BadRequest, Complete, read_line, request_line
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import gateway_pb2_grpc
from gpumarket.proto.wire import CLIENT_OPTIONS, MAX_MESSAGE_BYTES, SERVER_OPTIONS
from gpumarket.provider.runners.engine import chat_prompt



from tests.serving_fakes import (
    AnsweringSession, live_row, ready, router,
)


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
    theirs = replace(live_row(), id="ep2", client_id="c2", name="theirs")
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
    announced (broker/serving/openai_api.py:197 _limit). One hostile replica announcing max_seq_len 1
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
    """Fixed hole: ``"stream_options": "yes"`` (or a list, or a number) with ``"stream": true``
    passes
    completion_request() and the request is run on a replica; then
    ``(body.get("stream_options") or {}).get(...)`` (broker/serving/openai_api.py:236), outside the
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
    broker/serving/openai_api.py:183-184 does not catch (only ValueError): a 500 with a traceback in the
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
    limit both ends use (proto/wire.py MAX_MESSAGE_BYTES, 4 MiB), and broker/serving/router.py:322
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
    and nothing caps waiting bytes broker-wide (broker/serving/router.py:311, :84). One client with a
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
        from gpumarket.broker.serving.router import MAX_HELD_BYTES

        fit = min(ep.queue_limit, MAX_HELD_BYTES // len(raw) + 1)
        pinned = each * fit
        assert pinned <= 1 << 30, (
            f"each waiting request holds {each / 1e6:.1f} MB for a {len(raw) / 1e6:.1f} MB"
            f" body; the {fit} that fit the broker's budget hold {pinned / 1e9:.1f} GB")
    asyncio.run(main())


def test_a_replicas_nan_embeddings_make_the_api_answer_invalid_json():
    """Fixed hole (low): the embeddings check (broker/serving/openai_api.py:320) takes any int or float,
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
    """Fixed (a generation counter on the cache). Was: revoking clears the key cache
    (broker/api/marketplace.py RevokeEndpointKey), but
    a lookup that began before the revocation and ends after it writes its stale answer back
    into the cache (broker/serving/openai_api.py:165-166): the revoked key then works for another
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
            store.live = [r for r in store.live if r.id != "ep"]
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
    from gpumarket.broker.serving.openai_api import ApiError, completion_request

    with pytest.raises(BadRequest):     # the engine's decoder refuses the role
        Complete.from_dict({"messages": [{"role": "system", "content": "x"},
                                         {"role": "wizard", "content": "x"}]})
    work = completion_request({"messages": [{"role": "developer", "content": "be brief"},
                                            {"role": "user", "content": "hi"}]}, True, 16)
    assert read_line(request_line("r1", work)) == ("r1", work)   # the engine takes it
    chat_prompt(object(), work.messages)
    assert work.messages[0].role == "system"
    with pytest.raises(ApiError) as refused:
        completion_request({"messages": [{"role": "tool", "content": "x"}]}, True, 16)
    assert refused.value.status == 400
