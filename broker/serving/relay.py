"""Endpoints served on any broker of a shared store (docs/deploy.md, Two brokers on one
PostgreSQL store): an endpoint's replicas answer over their providers' sessions, and a
provider's session is on one broker; a request that reaches a broker holding no ready
replica of its endpoint is relayed, as it came (the client's own key, the same body), to
the OpenAI-compatible API of a broker that holds one, and the answer is streamed back.

How brokers find each other: each writes a row of ``serving_brokers`` every ``PASS_S`` (its
API's address, and which endpoints it holds ready replicas of, how many); each reads the
others' fresh rows on the same pass. The store, not NOTIFY, because a broker that starts
(or whose listening connection was down) must learn at once who serves what, and a broker
that dies must drop out by itself: its row stops being renewed and is ignored ``FRESH_S``
later. A relayed request carries ``RELAYED`` and is never relayed again: a broker that gets
one and holds no ready replica answers 503 at once with the code ``NOT_HERE`` (no waiting
for a replica), and the relaying broker tries the next peer, then serves the request itself
as it did before (waits for a replica of its own, then the router's own 503).

Usage, answer samples and their checks are recorded by the broker whose replica answered
(its router, broker/serving/router.py), never by the one that relayed: the relaying broker
only copies bytes. Since the autoscaler (which writes usage) runs on the leader only, a
broker that does not lead writes its own replicas' usage here, and keeps its router in step
with the store (``follow``).

What a peer sends back is bounded: the time to its answer's headers, the gap between two
pieces of a stream, the whole answer's bytes (as the router bounds a replica's)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import Counter

from gpumarket.broker.checks import verification
from gpumarket.broker.serving import endpoints
from gpumarket.broker.serving.request_shares import Hold, NoRoom
from gpumarket.broker.serving.router import DEADLINE_TIMEOUTS, MAX_ANSWER, Endpoint, Serving
from gpumarket.proto.jobspec import now_ms

log = logging.getLogger(__name__)

PASS_S = 1.0                # a broker's row is renewed, the others' read, this often
FRESH_S = 5.0               # a row not renewed for this long is a dead broker's
IDLE_TOLD_S = 3600.0        # an endpoint idle here longer is left out of this broker's row
SETTLED_S = 30.0            # a broker that does not lead reads who is past its warm-up this often
DOWN_S = 5.0                # a peer that could not be reached is skipped this long
CONNECT_S = 2.0             # to connect to a peer
MAX_ERROR = 64 << 10        # bytes of a peer's error answer (OpenAI's error object)
CHUNK = 64 << 10            # bytes read from a peer's stream at a time
RELAYED = "X-Gpumarket-Relayed"     # set on a relayed request: the holder that relayed it
NOT_HERE = "no_replica_here"        # a peer's 503 code: it holds no ready replica now
PASSED_HEADERS = ("Content-Type", "Retry-After", "Cache-Control")


# -- the directory, in the store ------------------------------------------------------------

def announce(db: Any, holder: str, url: str, served: dict[str, list[int]], now: int) -> None:
    """This broker serves its API at ``url``; ``served``: endpoint id -> [its ready replicas
    here, its requests in flight or waiting here, ms since its last request here], as of
    ``now`` (ms). Rows of brokers gone for an hour are
    removed on the way (a broker killed never withdraws its own)."""
    db.execute("DELETE FROM serving_brokers WHERE seen_ms < ?", [now - 3600_000])
    db.execute("INSERT INTO serving_brokers (holder, url, served, seen_ms) VALUES (?,?,?,?)"
               " ON CONFLICT(holder) DO UPDATE SET url = excluded.url,"
               " served = excluded.served, seen_ms = excluded.seen_ms",
               [holder, url, json.dumps(served, sort_keys=True), now])


def withdraw(db: Any, holder: str) -> None:
    """This broker stops: the others relay to it no more."""
    db.execute("DELETE FROM serving_brokers WHERE holder = ?", [holder])


def peers(db: Any, holder: str, fresh_since_ms: int) -> list[Peer]:
    """The other brokers whose rows were renewed since ``fresh_since_ms``."""
    found = []
    for other, url, served, _ in db.execute(
            "SELECT holder, url, served, seen_ms FROM serving_brokers WHERE holder != ?"
            " AND seen_ms >= ?", [holder, fresh_since_ms]):
        try:
            rows = {str(k): (int(v[0]), int(v[1]), int(v[2]))
                    for k, v in json.loads(served).items()}
        except (ValueError, TypeError, AttributeError, IndexError, KeyError):
            rows = {}
        found.append(Peer(other, url, {k: v[0] for k, v in rows.items() if v[0] > 0},
                          {k: v[1:] for k, v in rows.items()}))
    return found


@dataclass(frozen=True)
class Peer:
    holder: str
    url: str                    # http://HOST:PORT
    served: dict[str, int]      # endpoint id -> its ready replicas there
    load: dict[str, tuple[int, int]] = field(default_factory=dict)
    # endpoint id -> (requests in flight or waiting there, ms since its last request there)


def advertised_url(relay_url: str, listener: str) -> str:
    """Where the other brokers reach this one's API: ``relay_url`` if set, else the
    listener's HOST:PORT, a wildcard host replaced by this machine's name."""
    if relay_url:
        return relay_url.rstrip("/")
    host, _, port = listener.rpartition(":")
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.getfqdn()
    return f"http://{host}:{port}"


class PeerDown(Exception):
    """The peer could not be reached, or went away before its answer began."""


class Evicted(Exception):
    """The request's body gave way to another client's (broker/serving/request_shares.py)
    before the peer's answer began."""


# -- the relay ------------------------------------------------------------------------------

class Relay:
    """This broker's side of serving on any broker: ``run()`` keeps the directory (until
    cancelled; ``close()`` withdraws), ``forward()`` relays one request."""

    def __init__(self, state: Any, serving: Serving, url: str, registry=None) -> None:
        self.state = state
        self.serving = serving
        self.url = url
        cfg = state.config
        # A peer's answer begins once its replica's first piece came: it may wait for a
        # free slot, then the router's own limit on a request.
        self.headers_s = cfg.queue_wait_s + DEADLINE_TIMEOUTS * cfg.request_timeout_s
        self.gap_s = cfg.request_timeout_s + CONNECT_S
        self.write_s = cfg.body_timeout_s
        self.peers: list[Peer] = []
        self.down: dict[str, float] = {}        # url -> skipped until (monotonic)
        self.settled_at = -SETTLED_S                # when follow() last read past_warm_up
        self._client: aiohttp.ClientSession | None = None
        self.relayed = Counter("gpumarket_endpoint_relayed", "Endpoint requests this broker"
                               " relayed to another broker of its store, by outcome",
                               ["outcome"], registry=registry)

    # -- the directory --

    def served(self) -> dict[str, list[int]]:
        """What this broker tells the others of each endpoint its router knows that it
        serves, is asked for, or was asked for within IDLE_TOLD_S: [its ready replicas
        here, its requests in flight or waiting here, ms since its last request here]."""
        now = time.monotonic()
        return {ep.id: [len(ep.ready()), ep.in_flight + len(ep.waiting),
                        int((now - ep.last_request) * 1000)]
                for ep in self.serving.endpoints.values()
                if ep.ready() or ep.in_flight or ep.waiting
                or now - ep.last_request < IDLE_TOLD_S}

    def hear(self) -> None:
        """Put what the peers said on the router's endpoints: their ready replicas and load
        there (the leader's autoscaler counts them: broker/serving/autoscaler.py)."""
        now = time.monotonic()
        for ep in self.serving.endpoints.values():
            ep.peer_ready = sum(p.served.get(ep.id, 0) for p in self.peers
                                if self.down.get(p.url, 0.0) <= now)
            ep.peer_load = sum(p.load[ep.id][0] for p in self.peers if ep.id in p.load)
            idle = [p.load[ep.id][1] for p in self.peers if ep.id in p.load]
            ep.peer_last_request = now - min(idle) / 1000 if idle else 0.0
            if ep.peer_ready and not ep.ready():
                # Requests waiting here for a first replica go to the one there now.
                for waiter in ep.waiting:
                    if not waiter.done():
                        waiter.set_result(None)

    async def one_pass(self) -> None:
        """Renew this broker's row, read the others', and, while another broker leads (its
        autoscaler does it there), bring the router in step and write its usage."""
        store = self.state.store
        if self.state.epoch is None:
            await self.follow()
        await store.write(announce, self.state.holder, self.url, self.served(), now_ms())
        self.peers = await store.read(peers, self.state.holder,
                                      now_ms() - int(FRESH_S * 1000))
        self.hear()

    async def follow(self) -> None:
        """What the leader's autoscaler does for the replicas on this broker's sessions: the
        router in step with the store, their usage written, and which of their providers
        are past their warm-up (else each window keeps one more sampled answer here than
        on the leader)."""
        store = self.state.store
        self.serving.sync(await store.read(endpoints.live))
        if time.monotonic() - self.settled_at >= SETTLED_S:
            self.serving.samples.settled = await store.read(verification.past_warm_up)
            self.settled_at = time.monotonic()
        usage = self.serving.take_usage()
        if usage:
            try:
                await store.write(endpoints.record_usage, usage, now_ms())
            except BaseException:
                self.serving.leftover.extend(usage)     # written at the next pass
                raise

    async def run(self) -> None:
        while True:
            try:
                await self.one_pass()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("relay directory pass failed; retrying")
            await asyncio.sleep(PASS_S)

    async def close_client(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def close(self) -> None:
        """The broker stops: its connections to peers close, its row goes."""
        await self.close_client()
        try:
            await asyncio.wait_for(self.state.store.write(withdraw, self.state.holder),
                                   FRESH_S)
        except Exception as exc:    # noqa: BLE001 - its row goes stale by itself all the same
            log.warning("could not withdraw from serving_brokers: %s", exc)

    def candidates(self, endpoint_id: str) -> list[Peer]:
        """The live peers holding ready replicas of the endpoint, those with more first (in
        a random order among equals: relayed load spreads)."""
        now = time.monotonic()
        found = [p for p in self.peers if p.served.get(endpoint_id, 0) > 0
                 and self.down.get(p.url, 0.0) <= now]
        random.shuffle(found)
        return sorted(found, key=lambda p: -p.served[endpoint_id])

    # -- one request --

    def client(self) -> aiohttp.ClientSession:
        if self._client is None or self._client.closed:
            self._client = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_S),
                connector=aiohttp.TCPConnector(limit=0))
        return self._client

    async def forward(self, request: web.Request, ep: Endpoint, raw: bytes
                      ) -> web.StreamResponse | None:
        """Relay the request (its path, key and ``raw`` body) to a peer holding a ready
        replica of the endpoint, and answer the caller with the peer's answer. Returns None
        where no peer took it (none holds one, or none could be reached): the caller serves
        it itself. The body is held within the endpoint's share of the broker's request
        memory until the peer's answer begins, as the router holds one (a 429 where it has
        no room, or where it gives way to another client's meanwhile)."""
        found = self.candidates(ep.id)
        if not found:
            return None
        try:
            hold = self.serving.shares.take(ep.id, ep.client_id, len(raw))
        except NoRoom as exc:
            return _error(429, f"endpoint {ep.name}: {exc.message}; retry later", 1)
        try:
            for peer in found:
                try:
                    answer = await self._to(peer, request, raw, hold)
                except PeerDown as exc:
                    log.warning("relay to %s failed: %s; trying another", peer.url, exc)
                    self.down[peer.url] = time.monotonic() + DOWN_S
                    self.relayed.labels(outcome="peer_down").inc()
                    self.hear()     # its replicas no longer count here
                    continue
                except Evicted:
                    self.relayed.labels(outcome="evicted").inc()
                    return _error(429, f"endpoint {ep.name} holds more than its share of the"
                                  " broker's request memory while other clients need some;"
                                  " retry later", 1)
                if answer is not None:
                    self.relayed.labels(outcome="relayed").inc()
                    return answer
                self.relayed.labels(outcome="not_here").inc()
                peer.served.pop(ep.id, None)    # until its next row says otherwise
                self.hear()
            return None
        finally:
            self.serving.shares.release(hold)

    async def _to(self, peer: Peer, request: web.Request, raw: bytes, hold: Hold
                  ) -> web.StreamResponse | None:
        headers = {"Authorization": request.headers.get("Authorization", ""),
                   "Content-Type": "application/json", RELAYED: self.state.holder}
        # Until the answer begins, the hold's eviction (the router's _evicted sets the
        # exception of its waiter) ends the request.
        gate = hold.waiter = asyncio.get_running_loop().create_future()
        call = asyncio.ensure_future(self.client().post(peer.url + request.path, data=raw,
                                                        headers=headers))
        try:
            done, _ = await asyncio.wait({call, gate}, timeout=self.headers_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            hold.waiter = None
            if not call.done():
                call.cancel()       # its connection closes: the peer's handler ends
        if gate.done():
            gate.exception()
            if call.done() and not call.cancelled() and call.exception() is None:
                call.result().close()
            raise Evicted()
        if call not in done:
            raise PeerDown(f"no answer within {self.headers_s:.0f} s")
        if isinstance(exc := call.exception(), (aiohttp.ClientError, OSError, TimeoutError)):
            raise PeerDown(type(exc).__name__) from exc
        upstream = call.result()
        self.serving.shares.release(hold)       # the answer began: the body is done
        try:
            if upstream.status == 503 and upstream.headers.get(RELAYED) == NOT_HERE:
                return None
            if upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                return await self._stream(request, upstream)
            return await self._whole(upstream)
        finally:
            if upstream.content.at_eof():
                upstream.release()
            else:
                upstream.close()    # a stream the caller left is cut at the peer too

    async def _whole(self, upstream: aiohttp.ClientResponse) -> web.Response:
        limit = MAX_ANSWER if upstream.status == 200 else MAX_ERROR
        body = bytearray()
        try:
            async with asyncio.timeout(self.headers_s):
                while chunk := await upstream.content.read(CHUNK):
                    body += chunk
                    if len(body) > limit:
                        return _error(502, "the broker serving this endpoint sent too large"
                                      " an answer")
        except (aiohttp.ClientError, OSError, TimeoutError):
            return _error(502, "the broker serving this endpoint went away mid-answer")
        return web.Response(body=bytes(body), status=upstream.status,
                            headers=_passed(upstream))

    async def _stream(self, request: web.Request, upstream: aiohttp.ClientResponse
                      ) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, headers=_passed(upstream))
        await response.prepare(request)
        sent = 0
        while True:
            try:
                async with asyncio.timeout(self.gap_s):
                    chunk = await upstream.content.read(CHUNK)
            except (aiohttp.ClientError, OSError, TimeoutError):
                # The stream ends in an error the client sees, as the router's would.
                chunk = _event_error("the broker serving this endpoint went away"
                                     " mid-answer")
                await self._write(response, chunk)
                break
            if not chunk:
                break
            sent += len(chunk)
            if sent > MAX_ANSWER:
                await self._write(response, _event_error(
                    "the broker serving this endpoint sent too large an answer"))
                break
            if not await self._write(response, chunk):
                break       # the caller went away: leaving closes the peer's connection
        return response

    async def _write(self, response: web.StreamResponse, data: bytes) -> bool:
        try:
            async with asyncio.timeout(self.write_s):
                await response.write(data)
            return True
        except (ConnectionResetError, RuntimeError, TimeoutError):
            return False


def _passed(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: upstream.headers[k] for k in PASSED_HEADERS if k in upstream.headers}


def _error(status: int, message: str, retry_after: int = 0) -> web.Response:
    kind = "rate_limit_error" if status == 429 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": None,
                                        "code": None}}, status=status,
                             headers={"Retry-After": str(retry_after)} if retry_after else None)


def _event_error(message: str) -> bytes:
    return b"data: " + json.dumps({"error": {"message": message, "type": "server_error",
                                             "param": None, "code": None}}).encode() + b"\n\n"


def not_here(name: str) -> web.Response:
    """A relayed request's answer where this broker holds no ready replica: at once, so
    that the relaying broker tries another."""
    response = _error(503, f"endpoint {name} has no ready replica on this broker")
    response.headers[RELAYED] = NOT_HERE
    return response

