"""An attacker's pass over endpoints (docs/serving.md), part 2: the autoscaler
(broker/serving/autoscaler.py), the endpoints' database rules (broker/serving/endpoints.py: ready, money,
crash loops) on a real SQLite store, and the provider's link to its engine child
(provider/replica.py) over a real socket pair. Docstrings that start with "Fixed hole"
describe a weakness the review found, now mended."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from dataclasses import replace

import pytest

from gpumarket import kinds
from gpumarket.broker.api.sessions import CHUNKS_PER_S, ProviderSession
from gpumarket.broker.jobs import endings
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs.job import LeaseTerms
from gpumarket.broker.jobs import views
from gpumarket.broker.market.admission import Needs, NewJob
from gpumarket.broker.metrics import BrokerMetrics
from gpumarket.broker.money import ledger
from gpumarket.broker.serving import endpoints
from gpumarket.broker.serving.autoscaler import Autoscaler, Decision, Watch, decide
from gpumarket.broker.serving.router import Endpoint, Refused, Serving
from gpumarket.broker.serving.rows import LiveReplica
from gpumarket.kinds.engine_protocol import Final, encode_request
from gpumarket.proto.envelope import seal
from gpumarket.proto.errors import FailedPrecondition, InvalidArgument
from gpumarket.proto.identity import Identity
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider.replica import EngineLink



from tests.serving_fakes import (
    REQ, RUNNING, SETTINGS, AnsweringSession, collect, ready, router,
)


# -- the autoscaler ---------------------------------------------------------------------------

def replica_row(i: int, state: int = RUNNING, ready_: bool = True) -> LiveReplica:
    return LiveReplica(f"r{i}", i, state, epoch=1, provider_id=f"p{i}",
                       progress_step=int(ready_))


def test_a_replica_that_never_becomes_ready_is_never_replaced():
    """Fixed: a replica not ready within cold_start of its lease is lost (Autoscaler._late)
    and leased again elsewhere. Was: a replica whose provider reports it started but never ready (a
    hostile provider,
    or an engine stuck loading) counts as live for min_replicas, blocks scale-out as "still
    starting" (broker/serving/autoscaler.py:93) and, while requests keep arriving, is never idle
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
    stopped = []
    state = SimpleNamespace(store=store, metrics=BrokerMetrics(), sessions={},
                            config=SimpleNamespace(cold_start_s=300.0),
                            stop_lease=lambda *lease: stopped.append(lease))
    ep = Endpoint("ep", "c1", "tiny", {**SETTINGS, "min_replicas": 1, "max_replicas": 3})
    scaler = Autoscaler(state, Serving({}, BrokerMetrics(), 1, 1, 1))
    fresh = replace(replica_row(1, ready_=False), lease_id="r1.1", issued_at_ms=now_ms())
    stale = replace(replica_row(2, ready_=False), lease_id="r2.1",
                    issued_at_ms=now_ms() - 301_000)
    served = replace(replica_row(3), lease_id="r3.1", issued_at_ms=now_ms() - 10**9)
    assert asyncio.run(scaler._late(ep, [fresh, stale, served]))
    assert [(fn.__name__, args[0]) for fn, args in store.calls] == [("lose_lease", "r2.1")]
    assert [lease[:2] for lease in stopped] == [("r2", 1)]     # its provider is told to stop it


def test_scale_in_races_a_request_routed_to_the_victim_meanwhile():
    """Fixed hole (low): decide() picks a victim while nothing is in flight, but apply() awaits the
    database (endpoints.retire) before it drops the replica from the router
    (broker/serving/autoscaler.py:172-178). A request that arrives in between is routed to the victim,
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
        request = asyncio.create_task(collect(serving.run(ep, REQ)))
        await retiring
        try:
            outcome = (await request)[-1]
        except Refused as exc:
            outcome = Final.failed(exc.message, exc.status)
        # Fixed: the victim leaves the router before the awaited write, so the request is not
        # sent to it; it waits for a new replica instead (a 503 here: cold_start is 0.3 s).
        assert not p1.requests(), f"sent to the retiring replica: {outcome}"
        assert outcome.status == 503 or outcome.error is None, outcome
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
    jobs.create_lease(db, LeaseTerms(job_id, provider, (0,),
                      1.0, 60_000, 0), now, lambda lease_: seal(BROKER, lease_))
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
    count PAUSED replicas as live (broker/serving/autoscaler.py:58), so it adds min_replicas new ones;
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
        assert [r.state for r in rows] == [pb.JOB_STATE_PAUSED] * 2
        ep = Endpoint("ep", CLIENT.id, "tiny", (await store.read(endpoints.live))[0].settings)
        d = decide(ep, rows, Watch(last_change=0.0), 1.0, wanted=False)
        for _ in range(d.add):
            await w(endpoints.add_replica, "ep", hour, d.add_why)
        await w(jobs.top_up, "ep", CLIENT.id, ledger.units(100.0), hour + 1)
        live = [r for r in await store.read(endpoints.replicas, "ep")
                if r.state != pb.JOB_STATE_PAUSED]
        assert len(live) <= 2, f"{len(live)} live replicas for max_replicas 2: {live}"
    asyncio.run(main())


def test_one_provider_failing_three_new_replicas_fails_a_serving_endpoint(store):
    """Fixed hole: crash_loop (broker/serving/endpoints.py:116) fails the whole endpoint once its three
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
            await w(endings.fail, replica, 1, "p9", "engine crashed", 10 * n + 2)
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


def infer(request_id: str, body: bytes = encode_request(REQ)) -> gw.InferenceRequest:
    return gw.InferenceRequest(request_id=request_id, job_id="r1", epoch=1, body=body)


def chunks_for(sent: list[gw.ProviderMessage], request_id: str) -> list[gw.InferenceChunk]:
    return [m.chunk for m in sent if m.chunk.request_id == request_id]


def test_an_engine_line_nested_too_deep_wedges_the_link():
    """Fixed hole: EngineLink._handle catches only ValueError from json.loads
    (provider/replica.py:57 at 9686dab); a line of 100,000 ``[`` raises RecursionError, which kills
    the
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
    broker/api/gateway.py:104). At 9686dab the daemon has no limit at all; the working tree adds
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
