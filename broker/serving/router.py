"""The endpoints' request router (docs/serving.md), in memory: which replicas are ready and
how loaded, the requests in flight and those waiting for a free slot. A request goes to the
least-loaded ready replica (fewest in flight, then the lowest recent time per output token)
as an InferenceRequest over its provider's own session; the provider's InferenceChunks come
back as the engine's answer lines, read by the engine protocol (kinds/engine_protocol.py). A replica that goes away takes its requests
with it: those that had not streamed anything yet are tried on another replica, the rest end
in an error. What a provider sends is bounded and only counted for requests it was sent.

broker/serving/autoscaler.py keeps this in step with the database and decides the replica count."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from gpumarket.broker.serving.answer_samples import AnswerSamples
from gpumarket.broker.serving.request_shares import Hold, NoRoom, RequestShares
from gpumarket.broker.serving.rows import LiveEndpoint
from gpumarket.kinds import endpoint as endpoint_kind
from gpumarket.kinds.engine_protocol import (
    Answer, Complete, Final, Malformed, Request, decode_answer, encode_request,
)
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb

log = logging.getLogger(__name__)

MAX_BUFFER = 4 << 20        # an answer's bytes not yet a whole line
MAX_ANSWER = 64 << 20       # all of one answer's bytes
STATS_KEPT = 1000           # latest TTFT/TPOT samples per endpoint for `endpoint show`
RETRIES = 2                 # another replica for a request nothing was streamed for yet
MAX_REQUEST = (4 << 20) - (64 << 10)   # an InferenceRequest's body: under gRPC's 4 MiB
MAX_HELD_BYTES = 64 << 20   # request bodies held, over all endpoints (broker/serving/request_shares.py)
DEADLINE_TIMEOUTS = 4       # a request ends after this many request_timeouts in all
BENCH_AFTER = 3             # server errors in a row after which a replica is chosen last ...
BENCH_S = 30.0              # ... for this long
TPOT_WEIGHT = 0.2           # exponential average of a replica's time per output token


class Refused(Exception):
    """A request the endpoint cannot take now: HTTP ``status`` (429, 503), ``retry_after``
    seconds, and why."""

    def __init__(self, status: int, message: str, retry_after: int = 0) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


class Elsewhere(Refused):
    """No replica here, but another broker of the store holds a ready one now: the request
    is relayed there (broker/serving/relay.py), or, if it was relayed here, refused so that
    the broker that relayed it tries another."""

    def __init__(self, name: str) -> None:
        super().__init__(503, f"endpoint {name} has no ready replica on this broker")


@dataclass
class Replica:
    job_id: str
    epoch: int
    provider_id: str
    endpoint_id: str
    engine: str = ""
    task: str = ""
    max_concurrency: int = 1
    max_seq_len: int = 0
    in_flight: int = 0
    tpot_s: float = 0.0
    requests: int = 0
    draining: bool = False
    failures: int = 0           # server errors in a row
    benched_until: float = 0.0  # after BENCH_AFTER of them: chosen last until then
    usage: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # req, err, in, out
    fingerprinted: bool = False  # its answers are sampled and checked: every generate
                                 # replica's (fingerprints), an embed endpoint's (vectors)
    tokens_only: bool = False    # its answers commit to their token ids alone (vLLM's)

    def failed(self) -> None:
        self.failures += 1
        if self.failures >= BENCH_AFTER:
            self.benched_until = time.monotonic() + BENCH_S

    @property
    def lease_id(self) -> str:
        return f"{self.job_id}.{self.epoch}"


@dataclass
class Endpoint:
    id: str
    client_id: str
    name: str
    settings: dict
    created_at_ms: int = 0
    replicas: dict[str, Replica] = field(default_factory=dict)    # by replica job id
    waiting: deque = field(default_factory=deque)                 # futures of waiting requests
    in_flight: int = 0
    last_request: float = field(default_factory=time.monotonic)
    requests: int = 0
    errors: int = 0
    ttft: deque = field(default_factory=lambda: deque(maxlen=STATS_KEPT))
    tpot: deque = field(default_factory=lambda: deque(maxlen=STATS_KEPT))
    # What the other brokers of a shared store said of it (broker/serving/relay.py): their
    # ready replicas, their requests in flight or waiting, its last request there (monotonic)
    peer_ready: int = 0
    peer_load: int = 0
    peer_last_request: float = 0.0

    @property
    def queue_limit(self) -> int:
        s = self.settings
        return min(1024, max(16, 2 * s["max_concurrency"] * s["max_replicas"]))

    def ready(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.max_concurrency > 0]

    def best(self, tried: set[str] = frozenset()) -> Replica | None:
        """The ready replica with a free slot to send a request to: one it was not tried on
        yet, not failing, not draining, fewest in flight, then fastest (a replica not measured
        yet counts as the slowest measured)."""
        ready = self.ready()
        if any(r.job_id not in tried for r in ready):     # wait for one not tried yet
            ready = [r for r in ready if r.job_id not in tried]
        untried = [r for r in ready if r.in_flight < r.max_concurrency]
        if not untried:
            return None
        slowest = max((r.tpot_s for r in untried), default=0.0)
        now = time.monotonic()
        return min(untried, key=lambda r: (r.benched_until > now, r.draining, r.in_flight,
                                           r.tpot_s or slowest))

    def wake(self) -> None:
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_result(None)
                return


@dataclass(frozen=True)
class Limits:
    request_bytes: int
    max_tokens: int             # 0 for embeddings


@dataclass
class Pending:
    id: str
    endpoint: Endpoint
    replica: Replica
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    buffer: bytearray = field(default_factory=bytearray)
    received: int = 0
    pieces: int = 0
    max_pieces: int = 0        # a completion's pieces: at most one per token (and one spare)
    done: bool = False


class Serving:
    def __init__(self, sessions, metrics, queue_wait_s: float, cold_start_s: float,
                 request_timeout_s: float, max_held_bytes: int = MAX_HELD_BYTES,
                 answer_check_rate: float = 0.0) -> None:
        self.sessions = sessions
        self.metrics = metrics
        self.queue_wait_s = queue_wait_s
        self.cold_start_s = cold_start_s
        self.request_timeout_s = request_timeout_s
        self.endpoints: dict[str, Endpoint] = {}
        self.pending: dict[str, Pending] = {}
        self.want: set[str] = set()          # endpoints with a request waiting and no replica
        # Replicas that said they are ready (checked against the database), by (job, epoch):
        # kept until their lease ends, so that the next sync adds one its endpoint did not
        # know yet.
        self.announced: dict[tuple[str, int], tuple[str, gw.ReplicaReady]] = {}
        self.leftover: list[tuple] = []      # usage of replicas dropped since the last take
        # Request bodies held until their answer begins, shared fairly between clients
        # and their endpoints; what is over its share gives way when others need room.
        self.shares = RequestShares(max_held_bytes, self._evicted)
        # answers kept for a check of them (docs/verification.md), taken per settle window
        self.samples = AnswerSamples(answer_check_rate)
        self.kick = asyncio.Event()
        self.keys: dict[str, tuple[str | None, float]] = {}   # openai_api's key lookups
        self.keys_generation = 0             # bumped by forget_keys
        self._ids = itertools.count(1)
        self._prefix = secrets.token_hex(4)

    def forget_keys(self) -> None:
        """A key was revoked or an endpoint deleted: no cached lookup is used again (and
        none in flight is stored)."""
        self.keys.clear()
        self.keys_generation += 1

    # -- kept in step with the database by the autoscaler ---------------------------------

    def sync(self, live: list[LiveEndpoint]) -> None:
        """Take the serving endpoints and their live replicas as read from the database
        (serving/endpoints.live): forget what ended (its requests fail over), keep what is
        known."""
        seen = set()
        for row in live:
            seen.add(row.id)
            ep = self.endpoints.get(row.id)
            if ep is None:
                ep = self.endpoints[row.id] = Endpoint(row.id, row.client_id, row.name,
                                                       row.settings, row.created_at_ms)
            active = {(r.id, r.epoch): r.provider_id for r in row.replicas
                      if r.state == pb.JOB_STATE_RUNNING and r.provider_id}
            accelerators = {(r.id, r.epoch): r.accelerator or 0 for r in row.replicas}
            for job_id, replica in list(ep.replicas.items()):
                if (job_id, replica.epoch) not in active:
                    self.drop(replica, "the replica stopped")
            for key, (provider_id, ready) in list(self.announced.items()):
                if key in active and key[0] not in ep.replicas and \
                        active[key] == provider_id:
                    self._add(ep, provider_id, key[0], key[1], ready)
            for job_id, replica in ep.replicas.items():
                # from the spec and the lease's device class (vLLM's and the batch engine's
                # fallback too, judged by their tokens: kinds/endpoint.py)
                accelerator = accelerators.get((job_id, replica.epoch), 0)
                replica.fingerprinted = endpoint_kind.answers_sampled(
                    ep.settings, accelerator, replica.engine)
                replica.tokens_only = endpoint_kind.tokens_only(ep.settings, accelerator,
                                                                replica.engine)
        for key in list(self.announced):
            if not any(key[0] == r.id and key[1] == r.epoch
                       for row in live for r in row.replicas):
                del self.announced[key]
        for endpoint_id in list(self.endpoints):
            if endpoint_id not in seen:
                ep = self.endpoints.pop(endpoint_id)   # first: its requests are not retried
                for replica in list(ep.replicas.values()):
                    ep.replicas.pop(replica.job_id)
                    self._spill(replica)
                    self._fail_requests(replica, "the endpoint stopped serving")
                while ep.waiting:
                    fut = ep.waiting.popleft()
                    if not fut.done():
                        fut.set_exception(Refused(503, "the endpoint stopped serving"))

    def ready(self, provider_id: str, job_id: str, epoch: int, endpoint_id: str,
              ready: gw.ReplicaReady) -> None:
        """A replica's engine is loaded (checked against the database by the caller)."""
        self.announced[(job_id, epoch)] = (provider_id, ready)
        ep = self.endpoints.get(endpoint_id)
        if ep is not None:
            self._add(ep, provider_id, job_id, epoch, ready)

    def _add(self, ep: Endpoint, provider_id: str, job_id: str, epoch: int,
             ready: gw.ReplicaReady) -> None:
        endpoint_id = ep.id
        old = ep.replicas.get(job_id)
        if old is not None and old.epoch == epoch and old.provider_id == provider_id:
            return
        if old is not None:
            self.drop(old, "the replica was replaced")
        replica = Replica(job_id, epoch, provider_id, endpoint_id, ready.engine, ready.task,
                          max(1, min(ready.max_concurrency or 1,
                                     ep.settings["max_concurrency"])), ready.max_seq_len)
        ep.replicas[job_id] = replica
        self.want.discard(endpoint_id)
        for _ in range(replica.max_concurrency):
            ep.wake()

    def provider_gone(self, provider_id: str) -> None:
        """Its session closed: what it was answering is lost (its leases may still come back
        with a new session, and announce themselves ready again)."""
        for key in [k for k, (pid, _) in self.announced.items() if pid == provider_id]:
            del self.announced[key]
        for ep in self.endpoints.values():
            for replica in list(ep.replicas.values()):
                if replica.provider_id == provider_id:
                    self.drop(replica, "the replica's provider disconnected")

    def set_draining(self, provider_id: str, draining: bool) -> None:
        for ep in self.endpoints.values():
            for replica in ep.replicas.values():
                if replica.provider_id == provider_id:
                    replica.draining = draining

    def drop(self, replica: Replica, why: str) -> None:
        ep = self.endpoints.get(replica.endpoint_id)
        if ep is not None and ep.replicas.get(replica.job_id) is replica:
            del ep.replicas[replica.job_id]
            self._spill(replica)
        self._fail_requests(replica, why)

    def _fail_requests(self, replica: Replica, why: str) -> None:
        for p in list(self.pending.values()):
            if p.replica is replica and not p.done:
                self._finish(p, Final.failed(why, 503))

    # -- chunks from providers -------------------------------------------------------------

    def chunk(self, provider_id: str, chunk: gw.InferenceChunk) -> None:
        p = self.pending.get(chunk.request_id)
        if p is None or p.done or p.replica.provider_id != provider_id:
            return      # not a request this provider was sent (or it is over)
        p.received += len(chunk.data)
        if p.received > MAX_ANSWER or len(p.buffer) + len(chunk.data) > MAX_BUFFER:
            self._refuse(p, "the replica's answer is too large")
            return
        if b"\n" not in chunk.data and not chunk.last:   # more of a line: only new bytes
            p.buffer += chunk.data                      # are looked at
            return
        *lines, rest = chunk.data.split(b"\n")
        lines[0] = bytes(p.buffer) + lines[0]
        p.buffer = bytearray(rest)
        if chunk.last and rest:         # a last line without its newline
            lines.append(rest)
        for line in lines:
            try:
                message = decode_answer(line)
            except Malformed:
                self._refuse(p, "the replica sent a malformed answer")
                return
            if isinstance(message, Final):
                self._finish(p, message)
                return
            p.pieces += 1
            if p.pieces > p.max_pieces:
                self._refuse(p, "the replica sent more pieces than the request's max_tokens")
                return
            p.queue.put_nowait(message)
        if chunk.last:
            self._refuse(p, "the replica ended the answer early")

    def _refuse(self, p: Pending, why: str) -> None:
        """End a request whose replica broke the protocol: 502, and the engine stops on it."""
        self._finish(p, Final.failed(why, 502))
        self.cancel_on_provider(p)

    def _finish(self, p: Pending, message: Final) -> None:
        p.done = True
        p.queue.put_nowait(message)

    def cancel_on_provider(self, p: Pending) -> None:
        session = self.sessions.get(p.replica.provider_id)
        if session is not None:
            session.send(gw.BrokerMessage(infer_cancel=gw.InferenceCancel(
                request_id=p.id, job_id=p.replica.job_id, epoch=p.replica.epoch)))

    # -- requests ----------------------------------------------------------------------------

    async def _acquire(self, ep: Endpoint, hold: Hold, tried: set[str] = frozenset()) -> Replica:
        began = time.monotonic()
        while True:
            if hold.evicted:
                ep.wake()        # a slot it was woken for goes to the next waiter
                raise self._eviction(ep)
            if self.endpoints.get(ep.id) is not ep:
                raise Refused(503, f"endpoint {ep.name} stopped serving")
            replica = ep.best(tried)
            if replica is not None:
                replica.in_flight += 1
                ep.in_flight += 1
                return replica
            cold = not ep.ready()
            if cold and ep.peer_ready:
                raise Elsewhere(ep.name)
            limit = self.cold_start_s if cold else self.queue_wait_s
            left = began + limit - time.monotonic()
            if len(ep.waiting) >= ep.queue_limit:
                raise Refused(429, f"endpoint {ep.name} is at capacity: {len(ep.waiting)}"
                              " requests already wait; retry later", retry_after=1)
            if left <= 0:
                if cold:
                    raise Refused(503, f"endpoint {ep.name} has no ready replica: none became"
                                  f" ready within {self.cold_start_s:.0f} s", retry_after=5)
                raise Refused(429, f"endpoint {ep.name} is at capacity: no replica was free"
                              f" within {self.queue_wait_s:.0f} s", retry_after=1)
            if cold and ep.id not in self.want:
                self.want.add(ep.id)     # the autoscaler starts one now (scale from zero)
                self.kick.set()
            fut = asyncio.get_running_loop().create_future()
            ep.waiting.append(fut)
            hold.waiter = fut
            try:
                await asyncio.wait_for(fut, left)
            except TimeoutError:
                pass
            except BaseException:
                # Woken for a free slot but leaving (its caller went away): the slot goes
                # to the next waiter rather than waiting for a timeout to be noticed.
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    ep.wake()
                raise
            finally:
                hold.waiter = None
                if not fut.done():
                    fut.cancel()

    @staticmethod
    def _eviction(ep: Endpoint) -> Refused:
        return Refused(429, f"endpoint {ep.name} holds more than its share of the broker's"
                       " request memory while other clients need some; retry later",
                       retry_after=1)

    def _evicted(self, hold: Hold) -> None:
        """RequestShares took this request's bytes back for another endpoint's request: it
        ends now in a 429, whether it waits for a slot or a replica has it."""
        ep = self.endpoints.get(hold.endpoint_id)
        refusal = self._eviction(ep) if ep is not None else Refused(
            503, "the endpoint stopped serving")
        if hold.waiter is not None and not hold.waiter.done():
            hold.waiter.set_exception(refusal)
        p = hold.pending
        if p is not None and not p.done:
            self._finish(p, Final.failed(refusal.message, 429))
            self.cancel_on_provider(p)

    def _release(self, ep: Endpoint, replica: Replica) -> None:
        replica.in_flight = max(0, replica.in_flight - 1)
        ep.in_flight = max(0, ep.in_flight - 1)
        ep.wake()

    async def run(self, ep: Endpoint, request: Request) -> AsyncIterator[Answer]:
        """Serve one request: the engine's answer as it comes (Pieces, then one Final). A
        request nothing was streamed for yet is tried again
        on another replica when its replica goes away. Its body is held (within its
        endpoint's share, broker/serving/request_shares.py) until its answer begins; a request
        evicted meanwhile ends in a 429."""
        began = ep.last_request = time.monotonic()
        ep.requests += 1
        data = encode_request(request)
        if len(data) > MAX_REQUEST:
            raise Refused(413, f"the request is {len(data):,} bytes as the replica would get it,"
                          f" more than {MAX_REQUEST:,}")
        try:
            hold = self.shares.take(ep.id, ep.client_id, len(data), data)
        except NoRoom as exc:
            raise Refused(429, f"endpoint {ep.name}: {exc.message}; retry later",
                          retry_after=1) from exc
        limits = Limits(len(data), request.max_tokens if isinstance(request, Complete) else 0)
        # Drawn now, before a replica is chosen; its bytes kept to the answer only if it may
        # be sampled (answer_samples.py bounds what is kept).
        drawn = self.samples.wants(ep.id, ep.ready())
        sample = data if drawn is not False else None
        del data, request               # the hold has it, until the answer begins
        deadline = began + DEADLINE_TIMEOUTS * self.request_timeout_s
        attempts = self._attempts(ep, hold, limits, deadline, set(), began,
                                  (sample, bool(drawn)))
        try:
            async for message in attempts:
                yield message
        finally:
            await attempts.aclose()     # its cleanup now, not when it is collected
            self.shares.release(hold)

    async def _attempts(self, ep: Endpoint, hold: Hold, limits: "Limits", deadline: float,
                        tried: set[str], began: float,
                        sample: tuple[bytes | None, bool] = (None, False)
                        ) -> AsyncIterator[Answer]:
        first: float | None = None
        for attempt in range(RETRIES + 1):
            replica = await self._acquire(ep, hold, tried)
            tried.add(replica.job_id)
            p = Pending(f"{self._prefix}-{next(self._ids)}", ep, replica,
                        max_pieces=limits.max_tokens + 1)
            self.pending[p.id] = p
            hold.pending = p
            streamed = False
            try:
                session = self.sessions.get(replica.provider_id)
                if session is None:
                    self.drop(replica, "the replica's provider disconnected")
                else:
                    session.send(gw.BrokerMessage(infer=gw.InferenceRequest(
                        request_id=p.id, job_id=replica.job_id, epoch=replica.epoch,
                        body=hold.data)))
                while True:
                    wait = min(self.request_timeout_s, deadline - time.monotonic())
                    try:
                        message = await asyncio.wait_for(p.queue.get(), max(wait, 0))
                    except TimeoutError:
                        self.cancel_on_provider(p)
                        p.done = True
                        message = Final.failed(
                            f"the replica sent nothing for {self.request_timeout_s:.0f} s"
                            if wait > 0 else f"the request ran past its limit of"
                            f" {DEADLINE_TIMEOUTS * self.request_timeout_s:.0f} s", 504)
                    last = isinstance(message, Final)
                    if not last and first is None:
                        first = time.monotonic()
                    retry = (last and not streamed and attempt < RETRIES
                             and message.status == 503 and not hold.evicted)
                    if retry:
                        replica.failed()
                        break
                    if not last and not streamed:
                        streamed = True
                        self.shares.release(hold)   # no retry from here: the body is done
                    if last:
                        if message.error is None:      # (embeddings too: their vectors)
                            self.samples.offer(replica, sample[0], message, sample[1])
                        message = self._account(ep, replica, message, began, first, limits)
                    yield message
                    if last:
                        return
            finally:
                hold.pending = None
                self.pending.pop(p.id, None)
                if not p.done:         # the caller went away: the engine stops on it
                    p.done = True
                    self.cancel_on_provider(p)
                self._release(ep, replica)
        raise Refused(503, f"endpoint {ep.name}: the request failed on {RETRIES + 1} replicas")

    def _account(self, ep: Endpoint, replica: Replica, message: Final, began: float,
                 first: float | None, limits: "Limits") -> Final:
        """Count a finished request: its tokens for the replica's lease, its TTFT and TPOT as
        the broker saw them (from its arrival; between its first and last pieces). Returns
        the final with its token counts as counted."""
        now = time.monotonic()
        failed = message.error is not None
        replica.requests += 1
        replica.usage[0] += 1
        replica.usage[1] += failed
        if failed:
            ep.errors += 1
            if message.status >= 500:
                replica.failed()
        else:
            replica.failures = 0
            message = self._tokens(ep, replica, message, began, first, now, limits)
        if ep.replicas.get(replica.job_id) is not replica:
            self._spill(replica)    # dropped meanwhile: counted all the same
        return message

    def _tokens(self, ep: Endpoint, replica: Replica, message: Final, began: float,
                first: float | None, now: float, limits: "Limits") -> Final:
        # What the provider reports, bounded by what the request allows: no more output
        # tokens than its max_tokens, no more prompt tokens than it has bytes (and a margin
        # for a chat template's own).
        prompt = min(message.prompt_tokens, limits.request_bytes + 256)
        output = min(message.output_tokens, limits.max_tokens)
        replica.usage[2] += prompt
        replica.usage[3] += output
        ttft = (first if first is not None else now) - began
        ep.ttft.append(ttft)
        self.metrics.endpoint_ttft.labels(endpoint=ep.id).observe(ttft)
        self.metrics.endpoint_tokens.labels(endpoint=ep.id, type="prompt").inc(prompt)
        self.metrics.endpoint_tokens.labels(endpoint=ep.id, type="output").inc(output)
        if first is not None and output > 1:
            tpot = (now - first) / (output - 1)
            ep.tpot.append(tpot)
            self.metrics.endpoint_tpot.labels(endpoint=ep.id).observe(tpot)
            replica.tpot_s = tpot if not replica.tpot_s else (
                (1 - TPOT_WEIGHT) * replica.tpot_s + TPOT_WEIGHT * tpot)
        return replace(message, prompt_tokens=prompt, output_tokens=output)

    def _spill(self, replica: Replica) -> None:
        """Keep the usage of a replica no longer listed for the next take_usage."""
        if any(replica.usage):
            self.leftover.append((replica.lease_id, replica.endpoint_id, replica.job_id,
                                  replica.provider_id, *replica.usage))
            replica.usage = [0, 0, 0, 0]

    def take_usage(self) -> list[tuple]:
        """What replicas served since the last call, for endpoints.record_usage."""
        out, self.leftover = self.leftover, []
        for ep in self.endpoints.values():
            for r in ep.replicas.values():
                if any(r.usage):
                    out.append((r.lease_id, ep.id, r.job_id, r.provider_id, *r.usage))
                    r.usage = [0, 0, 0, 0]
        return out


def percentile(values, q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]
