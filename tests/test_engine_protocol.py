"""The endpoint's engine protocol (kinds/engine_protocol.py): requests round-trip, each rule
refuses with its own message, answers are bounded as they are read, and a bad request gets
the same refusal from the broker's OpenAI route and from the engine."""

from __future__ import annotations

import asyncio
import json

import pytest

from gpumarket.broker.serving.openai_api import ApiError, completion_request
from gpumarket.kinds import engine_protocol as protocol
from gpumarket.kinds.engine_protocol import (
    BadRequest, Complete, Embed, Final, Malformed, Message, Piece, Ready, answer_line,
    decode_answer, decode_request, encode_answer, encode_request, read_line, request_line,
)
from gpumarket.provider.runners.serve import Server

# -- requests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("request_", [
    Complete(prompt="hi"),
    Complete(prompt="é" * 10, max_tokens=7, temperature=0, top_p=0.5, stop=("a", "bc"),
             seed=2**63 - 1),
    Complete(messages=(Message("system", "be brief"), Message("user", "hi")), max_tokens=256),
    Embed(("a", "b")),
])
def test_requests_round_trip(request_):
    assert decode_request(encode_request(request_)) == request_
    rid, back = read_line(request_line("r1", request_))
    assert (rid, back) == ("r1", request_)


def test_a_cancel_is_a_line_with_no_request():
    assert read_line(request_line("r1", None)) == ("r1", None)


def test_defaults_are_openais():
    assert Complete.from_dict({"prompt": "x"}).max_tokens == protocol.DEFAULT_MAX_TOKENS == 16
    chat = Complete.from_dict({"messages": [{"role": "user", "content": "x"}]})
    assert chat.max_tokens == protocol.DEFAULT_CHAT_MAX_TOKENS == 256
    assert Complete.from_dict({"prompt": "x"}, limit=8).max_tokens == 8   # within the limit
    c = Complete.from_dict({"prompt": "x", "stop": "END"})
    assert (c.temperature, c.top_p, c.stop, c.seed) == (1.0, 1.0, ("END",), None)


BAD = [
    ({}, "prompt must be a string (one prompt per request)", "prompt"),
    ({"prompt": 3}, "prompt must be a string (one prompt per request)", "prompt"),
    ({"prompt": "x" * (protocol.MAX_TEXT + 1)}, "prompt is longer than 1,048,576 characters",
     "prompt"),
    ({"messages": []}, "messages must be a list of 1 to 1024 messages", "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]},
     "messages[0] needs a role (system, user, assistant)", "messages[0].role"),
    ({"messages": [{"role": "user", "content": {"a": 1}}]},
     "messages[0].content must be a string", "messages[0].content"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens must be a positive integer", "max_tokens"),
    ({"prompt": "x", "max_tokens": "8"}, "max_tokens must be a positive integer", "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens must be a positive integer",
     "max_tokens"),
    ({"prompt": "x", "max_tokens": protocol.MAX_TOKENS + 1},
     "max_tokens 1048577 is over this endpoint's limit of 1048576", "max_tokens"),
    ({"prompt": "x", "temperature": 2.5}, "temperature must be a number from 0 to 2",
     "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature must be a number from 0 to 2",
     "temperature"),
    ({"prompt": "x", "top_p": -0.1}, "top_p must be a number from 0 to 1", "top_p"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]},
     "stop must be a string or a list of up to 4 strings (each 1 to 256 characters)", "stop"),
    ({"prompt": "x", "stop": [""]},
     "stop must be a string or a list of up to 4 strings (each 1 to 256 characters)", "stop"),
    ({"prompt": "x", "stop": ["x" * 257]},
     "stop must be a string or a list of up to 4 strings (each 1 to 256 characters)", "stop"),
    ({"prompt": "x", "stop": 5},
     "stop must be a string or a list of up to 4 strings (each 1 to 256 characters)", "stop"),
    ({"prompt": "x", "seed": -1}, "seed must be a non-negative integer", "seed"),
    ({"prompt": "x", "seed": 2**63}, "seed must be a non-negative integer", "seed"),
    ({"prompt": "x", "n": 2}, "n: only one choice per request is supported", "n"),
]


@pytest.mark.parametrize("body,message,param", BAD)
def test_each_rule_refuses_with_its_message(body, message, param):
    with pytest.raises(BadRequest) as refused:
        Complete.from_dict(body)
    assert (refused.value.message, refused.value.param) == (message, param)


def test_the_constructor_keeps_the_rules_too():
    with pytest.raises(BadRequest, match="stop must be"):
        Complete(prompt="x", stop=("a",) * 5)
    with pytest.raises(BadRequest, match="a completion needs a string prompt or a list"):
        Complete(prompt="x", messages=(Message("user", "y"),))
    with pytest.raises(BadRequest, match="input must be a string or a list of 1 to 2,048"):
        Embed(())
    with pytest.raises(BadRequest, match=r"input\[1\] is longer than"):
        Embed(("a", "x" * (protocol.MAX_TEXT + 1)))


@pytest.mark.parametrize("line,message", [
    (b"not json", "the request is not JSON (or is nested too deeply)"),
    (b"[1]", "the request is not a JSON object"),
    (b"[" * 100_000, "the request is not JSON (or is nested too deeply)"),
    (b'{"op": "complete", "prompt": "x"}', "a request is a JSON object with a string id"),
    (b'{"id": "r", "op": "frob"}', "op 'frob' is not complete or embed"),
])
def test_lines_that_are_no_request(line, message):
    with pytest.raises(BadRequest) as refused:
        read_line(line)
    assert refused.value.message == message


# -- the same refusal from either side --------------------------------------------------------

class NoEngine:
    """What Server needs of an engine to refuse a request (it never gets one)."""
    max_concurrency = 1

    def complete(self, request_id, request):
        raise AssertionError("a bad request reached the engine")


def engine_refusal(body: dict) -> dict:
    """What the engine answers the line ``body`` (with an id) as the daemon would send it."""
    async def main() -> bytes:
        server = Server(NoEngine(), writer=None)
        server.handle(json.dumps({"id": "r1", "op": "complete", **body}).encode())
        return server.outbox.get_nowait()
    return json.loads(asyncio.run(main()))


@pytest.mark.parametrize("body,message,param", [b for b in BAD if b[2] != "messages[0].role"])
def test_a_bad_request_gets_the_same_refusal_from_the_broker_and_the_engine(body, message,
                                                                            param):
    """Was: the broker allowed 4 stop strings and the engine 16, with other messages; a
    request the engine refused differently from the API."""
    chat = "messages" in body
    with pytest.raises(ApiError) as api:
        completion_request(body, chat, protocol.MAX_TOKENS)
    assert (api.value.status, api.value.message, api.value.param) == (400, message, param)
    answer = engine_refusal(body)
    assert answer == {"id": "r1", "error": message, "status": 400, "done": True}


@pytest.mark.parametrize("body,message,param", [
    b for b in BAD if b[2] != "messages[0].role" and "over this endpoint" not in b[1]])
def test_the_openai_route_refuses_as_the_engine_does(body, message, param):
    """The same, through the broker's HTTP route (an OpenAI 400 that reaches no replica)."""
    from aiohttp.test_utils import TestClient, TestServer

    from tests.serving_fakes import AnsweringSession, ready
    from tests.test_serving_hostile_api import api_for, post

    async def main():
        p1 = AnsweringSession("p1")
        api, serving, _ = api_for({"p1": p1})
        ready(serving, "p1", "r1")
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        async with TestClient(TestServer(api.app())) as client:
            status, answer = await post(client, path, {"model": "tiny", **body})
        assert p1.requests() == []
        return status, answer["error"]
    status, error = asyncio.run(main())
    assert (status, error["message"], error["param"]) == (400, message, param)
    assert engine_refusal(body)["error"] == message


def test_max_completion_tokens_is_refused_under_its_own_name():
    with pytest.raises(ApiError) as api:
        completion_request({"prompt": "x", "max_completion_tokens": 99}, False, 16)
    assert api.value.message == "max_completion_tokens 99 is over this endpoint's limit of 16"
    assert (api.value.param, api.value.code) == ("max_completion_tokens", "max_tokens_exceeded")


# -- answers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("answer", [
    Piece("hé"), Final(finish_reason="length", prompt_tokens=3, output_tokens=2, ttft_s=0.5,
                       tpot_s=0.01),
    Final(embeddings=[[0.5, -1.0]], prompt_tokens=2), Final.failed("too long", 400),
])
def test_answers_round_trip(answer):
    assert decode_answer(encode_answer(answer)) == answer
    line = json.loads(answer_line("r1", answer))
    assert line["id"] == "r1"
    assert decode_answer(answer_line(None, answer)) == answer


def test_answers_are_bounded_as_they_are_read():
    """What an engine writes is the job's code: every field is bounded, never trusted."""
    final = decode_answer(json.dumps({
        "done": 1, "finish_reason": "exploded", "prompt_tokens": 2**40, "output_tokens": -3,
        "ttft_s": float("nan"), "tpot_s": "x", "embeddings": [[1, float("inf")]]}).encode())
    assert final == Final(embeddings=None)
    error = decode_answer(b'{"done": true, "error": "' + b"e" * 5000 + b'", "status": 200}')
    assert error.status == 502 and len(error.error) == protocol.MAX_ERROR
    assert decode_answer(b'{"text": 5}') == Piece("")
    for line in (b"not json", b"[1]", b"[" * 100_000):
        with pytest.raises(Malformed):
            decode_answer(line)


def test_ready_line():
    line = json.loads(Ready("batch", "generate", 8, 256, "tiny").line())
    assert line == {"event": "ready", "engine": "batch", "task": "generate",
                    "max_concurrency": 8, "max_seq_len": 256, "model": "tiny"}
