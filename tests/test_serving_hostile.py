"""An attacker's pass over endpoints (docs/serving.md), part 1: what a hostile API caller
or provider can make the broker's router (broker/serving/router.py) and its OpenAI-compatible API
(broker/serving/openai_api.py) do; test_serving_hostile_api.py has the API's own tests and
test_serving_hostile_scaling.py the autoscaler's, the endpoints' database code's and the
provider's engine link's.

Docstrings that start with "Fixed hole" describe a weakness the review found, now mended
(the test failed before the fix); the others pin behaviour that already held. Everything
runs in process, without a model: fake provider sessions (tests/serving_fakes.py) that
answer requests the way a hostile provider would, and aiohttp's test server for the API."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from gpumarket.broker.api.sessions import CHUNKS_PER_S
from gpumarket.broker.serving.router import Refused
from gpumarket.kinds.engine_protocol import Complete, Final
from gpumarket.proto.v1 import gateway_pb2 as gw



from tests.serving_fakes import (
    DONE, REQ, AnsweringSession, collect, ready, router,
)


# -- the router -----------------------------------------------------------------------------

def test_a_fast_failing_replica_draws_every_request_and_its_retries():
    """Fixed hole: routing is "fewest in flight, then lowest TPOT", and a retry picks again with the
    same rule. A replica that answers every request at once with a 503 (a hostile provider, or
    a broken one whose daemon answers "no such replica on this provider") always has 0 in
    flight and TPOT 0.0 (never measured), so it wins every pick, the request's two retries
    included: the request fails on "3 replicas" that were all the same one, while a healthy
    replica sits idle. One bad replica black-holes the endpoint (broker/serving/router.py:94 best(),
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
            messages = await asyncio.wait_for(collect(serving.run(ep, REQ)), 5)
        except Refused as exc:
            messages = [{"refused": exc.status, "message": exc.message}]
        assert len(bad.requests()) <= 1, (
            f"the failing replica got the request {len(bad.requests())} times, the healthy one"
            f" {len(good.requests())} times; the caller got {messages[-1]}")
        assert isinstance(messages[-1], Final) and messages[-1].error is None, messages
    asyncio.run(main())


def test_tiny_chunks_after_a_long_partial_line_stall_the_brokers_event_loop():
    """Fixed hole: Serving.chunk appends each chunk to the request's buffer and then splits the
    whole buffer and copies its rest (broker/serving/router.py:228-235), on the event loop. A
    provider sends a line just under MAX_BUFFER (4 MiB) without its newline, then one-byte
    chunks: each costs two 4 MiB copies and a scan, ~10 ms here, and the gateway allows
    20,000 chunks a second (bursts of 200,000) per provider. ~100 chunks a second from one
    provider, for one request it was sent, stall the broker's only event loop: every
    provider's heartbeats (leases then time out market-wide), every API call, every RPC."""
    async def main():
        serving, ep = router({"p1": AnsweringSession("p1", answer=None)})
        ready(serving, "p1", "r1")
        agen = serving.run(ep, REQ)
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
    (bounded by the request's max_tokens)", but broker/serving/router.py:373 (_count) takes any int
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
        await collect(serving.run(ep, Complete(prompt="hi", max_tokens=4)))
        (_, _, _, _, requests, _, prompt, output), = serving.take_usage()
        assert requests == 1
        assert output <= 4, f"usage recorded {output:,} output tokens for max_tokens=4"
        assert prompt <= 1 << 20, f"usage recorded {prompt:,} prompt tokens for a 2-char prompt"
    asyncio.run(main())


def test_a_replica_may_stream_without_bound_past_max_tokens():
    """Fixed hole: nothing bounds how many pieces one answer has but MAX_ANSWER (64 MiB of lines):
    for a max_tokens=4 request a provider sends 100,000 pieces (1.3 MB) and every one is
    parsed and queued (broker/serving/router.py:249, an unbounded asyncio.Queue). Each tiny line
    becomes a dict of ~200+ bytes: 64 MiB of ``{}`` lines is ~22 million queued dicts, several
    GB for one request while its HTTP client reads slowly."""
    async def main():
        serving, ep = router({"p1": AnsweringSession("p1", answer=None)})
        ready(serving, "p1", "r1")
        agen = serving.run(ep, Complete(prompt="hi", max_tokens=4))
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
    (broker/serving/router.py:327). Here request_timeout is 0.3 s and the request is still open
    after 2 s (ten timeouts)."""
    async def main():
        serving, ep = router({"p1": AnsweringSession("p1", answer=None)},
                             request_timeout_s=0.3)
        ready(serving, "p1", "r1")
        task = asyncio.create_task(collect(serving.run(ep, Complete(prompt="hi", max_tokens=4))))
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
    drops its replicas, so drop() (broker/serving/router.py:213) no longer finds the endpoint and
    leaves the replicas in the old Endpoint object. The in-flight request fails with the
    retryable 503 and run() retries it on the same old object: the request is sent again to
    the stopped replica (of a deleted endpoint), and its usage is counted on a replica no
    take_usage() will ever see."""
    async def main():
        p1 = AnsweringSession("p1", answer=None)
        serving, ep = router({"p1": p1})
        ready(serving, "p1", "r1")
        task = asyncio.create_task(collect(serving.run(ep, REQ)))
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
        task = asyncio.create_task(collect(serving.run(ep, Complete(prompt="hi", max_tokens=4))))
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
        assert messages == [Final(prompt_tokens=3, output_tokens=1)]
        assert serving.take_usage() == [("r1.1", "ep", "r1", "p1", 1, 0, 3, 1)]
    asyncio.run(main())


def test_a_replicas_claimed_concurrency_is_capped_by_the_endpoint():
    """Holds: a replica announcing max_concurrency 2**31-1 gets the endpoint's own."""
    serving, ep = router({"p1": AnsweringSession("p1")}, max_concurrency=3)
    ready(serving, "p1", "r1", concurrency=2**31 - 1)
    assert ep.replicas["r1"].max_concurrency == 3


def test_a_malformed_or_nested_answer_line_ends_only_that_request():
    """Holds for malformed lines (502 and a cancel). A line nested deeper than the JSON
    parser's recursion limit used to raise RecursionError out of Serving.chunk (at 9686dab
    only ValueError was caught), ending that provider's own session; both are now caught
    and taken as a malformed answer."""
    async def main():
        serving, ep = router({"p1": AnsweringSession("p1", answer=None)})
        ready(serving, "p1", "r1")
        agen = serving.run(ep, REQ)
        first = asyncio.create_task(agen.__anext__())
        await asyncio.sleep(0.05)
        rid = serving.sessions["p1"].requests()[0].request_id
        serving.chunk("p1", gw.InferenceChunk(request_id=rid, data=b"not json\n"))
        final = await first
        assert final.status == 502 and "malformed" in final.error
        await agen.aclose()
        with pytest.raises(RecursionError):
            json.loads(b"[" * 100_000)
    asyncio.run(main())
