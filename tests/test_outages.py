"""A broker outage loses no running lease: providers probe a broker that went away and
reconnect as soon as it listens again (on a new channel), and a restarted broker keeps each
lease as long as its provider said it takes to come back. Units for the backoff and the
probe, the broker's restart wait on a real SQLite store, and one real-process outage of 60 s
with default lease settings."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import sqlite3
import subprocess
import time
from datetime import datetime

import pytest

from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs.job import LeaseTerms
from gpumarket.broker.jobs import views
from gpumarket.broker.market import providers
from gpumarket.proto.envelope import seal
from gpumarket.proto.errors import Unavailable
from gpumarket.proto.identity import Identity
from gpumarket.provider import session as ps
from gpumarket.provider.config import ProviderConfig
from tests.helpers import BIN, Marketplace, free_port, wait_until
from tests.test_broker_domain import new_job

# No job here is of a kind that keeps a warm runner (training): providers start without
# one (tests/helpers.py, Marketplace.warm).
WARM_PROVIDERS = False

# -- the provider's backoff and probe ---------------------------------------------------------


def test_backoff_doubles_to_its_bound_with_jitter_and_resets():
    lowest = ps.Backoff(0.5, 30.0, rng=lambda: 0.0)
    assert [lowest.next() for _ in range(9)] == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    lowest.reset()
    assert lowest.next() == 0.5
    highest = ps.Backoff(0.5, 30.0, rng=lambda: 1.0)
    waits = [highest.next() for _ in range(9)]
    assert waits[0] == pytest.approx(0.6) and max(waits) == pytest.approx(36.0)
    # What a provider tells the broker: its longest wait, jitter included.
    assert ps.reconnect_within_ms(ProviderConfig(broker="b:1", data_dir=".")) == 36_000


class Probe:
    """A broker that answers probes as ``answers`` says, one after another (the last
    repeats); it remembers when it was probed."""

    def __init__(self, *answers: bool) -> None:
        self.answers = list(answers)
        self.at: list[float] = []

    async def __call__(self) -> bool:
        self.at.append(asyncio.get_running_loop().time())
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def retry(probe, delay: float, probe_max_s: float = 0.2, stopping=None):
    async def go():
        loop = asyncio.get_running_loop()
        began = loop.time()
        back = await ps.wait_to_retry(delay, probe, stopping or asyncio.Event(), probe_max_s,
                                      rng=lambda: 0.0, probe_first_s=0.05)
        return back, loop.time() - began

    return asyncio.run(go())


def test_a_broker_seen_back_is_tried_at_once():
    probe = Probe(False, False, False, True)
    back, waited = retry(probe, delay=60.0)
    assert back and len(probe.at) == 4
    assert waited < 30.0            # not the backoff's 60 s (0.05 + 0.1 + 0.2 here)


def test_an_unreachable_broker_is_probed_on_a_bounded_backoff_until_the_delay_ends():
    probe = Probe(False)
    back, waited = retry(probe, delay=1.5, probe_max_s=0.2)
    assert not back and waited >= 1.5
    gaps = [b - a for a, b in zip(probe.at, probe.at[1:])]
    assert gaps[0] < gaps[1] < gaps[2]                   # 0.05, 0.1, 0.2, ...
    assert len(gaps) >= 6 and max(gaps) < 1.0            # never the whole delay at once


def test_a_broker_up_but_refusing_is_not_probed_again():
    """The session failed while the broker answers (it refused or ended it): the provider
    waits out its backoff instead of trying again on every probe."""
    probe = Probe(True)
    back, waited = retry(probe, delay=0.5)
    assert not back and waited >= 0.5 and len(probe.at) == 1


def test_stopping_ends_the_wait():
    async def go():
        stopping = asyncio.Event()
        asyncio.get_running_loop().call_later(0.1, stopping.set)
        began = asyncio.get_running_loop().time()
        back = await ps.wait_to_retry(60.0, Probe(False), stopping, 0.2)
        return back, asyncio.get_running_loop().time() - began

    back, waited = asyncio.run(go())
    assert not back and waited < 30.0


def test_the_probe_is_a_tcp_connect():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert asyncio.run(ps.reachable("127.0.0.1", port, 5.0))
    assert not asyncio.run(ps.reachable("127.0.0.1", port, 5.0))   # nobody listens now


def test_an_artifact_call_waits_out_an_outage_without_using_up_its_tries(tmp_path):
    """A call that ran into a broker outage is tried again once a session is open again,
    however long that took, and that try is not counted; failures with a session open are."""
    session = ps.BrokerSession(ProviderConfig(broker="127.0.0.1:1", data_dir=tmp_path),
                               Identity.generate(), peer=None)
    calls: list[int] = []

    async def go():
        stopping = asyncio.Event()
        session.connected.set()
        session.sessions_opened = 1

        async def call(_artifacts):
            calls.append(session.sessions_opened)
            if len(calls) == 1:      # the broker goes away under the first try ...
                session.connected.clear()
                asyncio.get_running_loop().call_later(0.8, reopen)
                raise Unavailable("cannot reach the broker")
            return "stored"

        def reopen():                # ... and a session opens again later
            session.sessions_opened += 1
            session.connected.set()

        first = await session.with_broker(call, stopping, attempts=1)

        async def refused(_artifacts):
            calls.append(-1)
            raise Unavailable("the broker's store is unavailable")

        with pytest.raises(Unavailable):
            await session.with_broker(refused, stopping, attempts=2)
        stopping.set()
        session.connected.clear()
        with pytest.raises(Unavailable, match="stopping"):
            await session.with_broker(refused, stopping)
        return first

    assert asyncio.run(go()) == "stored"
    assert calls == [1, 2, -1, -1]


def test_a_channel_that_lost_its_broker_is_replaced(tmp_path):
    """After a session ended, a channel still connected is kept; one that lost its broker
    is dropped, so the next try opens a new one instead of failing on the old one's last
    error until gRPC's own reconnect backoff runs out."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from gpumarket.link.channel import Trust, open_channel

    async def go():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        session = ps.BrokerSession(
            ProviderConfig(broker=f"plaintext://127.0.0.1:{port}", data_dir=tmp_path),
            Identity.generate(), peer=None)
        session.channel = (await open_channel(session.config.broker, None, Trust())).channel
        await health_pb2_grpc.HealthStub(session.channel).Check(
            health_pb2.HealthCheckRequest(), timeout=30)
        ready = session.channel
        session._drop_channel()
        kept = session.channel is ready
        await server.stop(None)
        while ready.get_state() == grpc.ChannelConnectivity.READY:
            await asyncio.wait_for(ready.wait_for_state_change(
                grpc.ChannelConnectivity.READY), 30)
        session._drop_channel()
        await asyncio.gather(*session._closing)
        return kept, session.channel

    kept, after = asyncio.run(go())
    assert kept and after is None


def test_a_watch_resumes_after_an_outage_and_gives_up_only_after_a_long_one(monkeypatch):
    """A watched stream that breaks with UNAVAILABLE is reopened after the last event shown,
    the watcher told once an outage; only an outage longer than OUTAGE_WAIT_S ends it."""
    import grpc

    from gpumarket.link import client as link_client

    def unavailable():
        return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                    grpc.aio.Metadata(), "Connection refused")

    class Event:
        def __init__(self, seq):
            self.seq = seq

    def stream_of(script):
        """open_stream: each call opens the next stream of ``script``: events, then an
        outage (raise) or the end."""
        opened = []

        def open_stream(cursor):
            opened.append(cursor)
            events, breaks = script[min(len(opened), len(script)) - 1]

            class Stream:
                async def __aiter__(self):
                    for seq in events:
                        if seq > cursor:
                            yield Event(seq)
                    if breaks:
                        raise unavailable()

                def cancel(self):
                    pass
            return Stream()
        return open_stream, opened

    async def watch(open_stream, told):
        broker = link_client.BrokerClient("127.0.0.1:1")
        return [e.seq async for e in broker._resuming(open_stream, lambda e: (e,), 0,
                                                      told.append)]

    open_stream, opened = stream_of([([1, 2], True), ([], True), ([1, 2, 3], False)])
    told: list[str] = []
    assert asyncio.run(watch(open_stream, told)) == [1, 2, 3]
    assert opened == [0, 2, 2] and len(told) == 1 and "reconnecting" in told[0]

    monkeypatch.setattr(link_client, "OUTAGE_WAIT_S", 0.5)
    open_stream, opened = stream_of([([1], True), ([], True)])
    with pytest.raises(Unavailable, match="cannot reach the broker"):
        asyncio.run(watch(open_stream, []))
    assert opened == [0, 1]          # the second try came 1 s into the outage: past 0.5 s


# -- the broker's wait after a restart ---------------------------------------------------------


def test_a_restarted_broker_waits_for_each_provider_as_long_as_it_said(store):
    broker, client = Identity.generate(), Identity.generate()
    timeout = 15_000
    said = {"p1": 36_000, "p2": 0, "p3": 10**9, "p4": 1_000}   # p2: an older provider

    async def scenario():
        w = store.write
        for n, (pid, ms) in enumerate(said.items(), 1):
            await w(providers.online, pid, b"key", 1, ms)
            await w(jobs.submit, new_job(client, f"j{n}", nonce=f"{n:032x}"), 1)
            await w(jobs.create_lease, LeaseTerms(f"j{n}", pid, (0,),
                    1.0, 60_000, 10), 2, lambda lease: seal(broker, lease))
        stored = await store.read(lambda db: dict(db.execute(
            "SELECT id, reconnect_within_ms FROM providers").fetchall()))
        await w(providers.after_restart)
        now = 10**12
        kept = await w(providers.renew_all_leases, now, timeout)

        async def lost_by(ms: int) -> set[str]:
            overdue = await store.read(views.overdue_leases, now + ms - timeout)
            return {lease_id.split(".")[0] for lease_id in overdue}

        return stored, kept, {ms: await lost_by(ms) for ms in
                              (14_999, 15_001, 45_999, 46_001, 309_999, 310_001)}

    stored, kept, lost = asyncio.run(scenario())
    assert stored == {"p1": 36_000, "p2": 0, "p3": providers.MAX_RECONNECT_MS, "p4": 1_000}
    assert kept == 4
    assert lost[14_999] == set()
    assert lost[15_001] == {"j4"}                  # said 1 s: the lease timeout still holds
    assert lost[45_999] == {"j4"}
    assert lost[46_001] == {"j1", "j2", "j4"}      # 36 s (said, or unsaid) + 10 s margin
    assert lost[309_999] == {"j1", "j2", "j4"}
    assert lost[310_001] == {"j1", "j2", "j3", "j4"}   # bounded: 5 min + 10 s


def test_the_first_heartbeat_after_a_restart_brings_a_lease_back_to_the_usual_timeout(store):
    broker, client = Identity.generate(), Identity.generate()

    async def scenario():
        w = store.write
        await w(providers.online, "p1", b"key", 1, 36_000)
        await w(jobs.submit, new_job(client), 1)
        await w(jobs.create_lease, LeaseTerms("j1", "p1", (0,),
                1.0, 60_000, 10), 2, lambda lease: seal(broker, lease))
        await w(providers.renew_all_leases, 10**12, 15_000)
        await w(providers.heartbeats, {"p1": 10**12 + 2_000}, {"p1": [("j1", 1)]})
        return await store.read(views.overdue_leases, 10**12 + 2_000 + 1)

    assert asyncio.run(scenario()) == ["j1.1"]


# -- a real outage -----------------------------------------------------------------------------

# Waits for the file the test writes beside its outputs, reporting progress meanwhile; gives
# up after 10 minutes so that a failed test leaves nothing running.
WAITER = """
import time
from pathlib import Path

from gpumarket.provider.runners import task

out = task.output_dir()
go = out.parent / "go"
began = time.monotonic()
step = 0
while not go.exists():
    if time.monotonic() - began > 600:
        raise SystemExit("nobody said go")
    step += 1
    task.progress(step, 100_000)
    time.sleep(0.5)
(out / "done.txt").write_text("went on through the outage")
"""

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def stamped(log: str, pattern: str, after: float = 0.0) -> float | None:
    """The time of the first line of ``log`` matching ``pattern`` stamped at or after
    ``after`` (logging's asctime, local time, as seconds since the epoch)."""
    for line in log.splitlines():
        m = STAMP.match(line)
        if m and re.search(pattern, line):
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if at >= after:
                return at
    return None


@pytest.mark.e2e
def test_a_running_lease_survives_a_60s_broker_outage(tmp_path):
    """Broker killed (SIGKILL) with a lease running, down 60 s, restarted on the same
    address and data directory with the default lease timeout and heartbeats: the provider
    is back within 5 s of the broker listening, the job succeeds on its first attempt, and
    a client watching it all along sees it succeed."""
    market = Marketplace(tmp_path)
    port = free_port()
    try:
        market.start_broker(listen=f"127.0.0.1:{port}")
        assert market.cli("keys", "init").returncode == 0
        market.start_provider("p1", 1.0, "--kinds", "script")
        market.wait_for_offers(1)
        code = tmp_path / "waiter.py"
        code.write_text(WAITER)
        job_file = tmp_path / "job.toml"
        job_file.write_text(f'kind = "script"\nname = "outage"\nmax_price = 2.0\n'
                            f'[script]\ncode = "{code}"\n')
        watcher = subprocess.Popen([str(BIN / "gpumarket"), "submit", str(job_file), "--watch"],
                                   env=market.env, stdout=subprocess.PIPE,
                                   stderr=open(tmp_path / "watch.err", "w"), text=True)
        job_id = watcher.stdout.readline().strip()
        assert re.fullmatch(r"[0-9a-f]{16}", job_id), job_id
        workdir = market.root / "p1" / "jobs" / f"{job_id}.1"
        wait_until(lambda: int(market.job(job_id)["progress"].get("step", 0)) > 0,
                   "the job to run", timeout=120, interval=0.3)
        provider = market.provider_id("p1")
        db = sqlite3.connect(tmp_path / "broker" / "broker.db")
        said = db.execute("SELECT reconnect_within_ms FROM providers WHERE id = ?",
                          [provider]).fetchone()
        db.close()
        assert said == (36_000,)                         # the provider's hello said so

        market.broker.stop(signal.SIGKILL)
        # The outage itself, not a wait: at least 60 s, longer by the restart's own time (a
        # loaded machine's, unbounded here: the lease is kept from the broker's return).
        time.sleep(60.0)
        market.start_broker(listen=f"127.0.0.1:{port}", credit=0)
        log = lambda: market.broker.text()  # noqa: E731
        restarted = stamped(log(), r"listening on", after=time.time() - 30)
        assert restarted is not None, log()
        back = wait_until(lambda: stamped(log(), rf"provider {provider} connected",
                                          after=restarted),
                          "the provider to reconnect", timeout=60, interval=0.2)
        assert back - restarted < 5.0, f"the provider came back {back - restarted:.1f}s" \
                                       " after the broker listened"
        # The lease is still the provider's: told to go on, the job finishes.
        (workdir / "go").write_text("go")
        job = wait_until(lambda: ((j := market.job(job_id))["state"] in ("SUCCEEDED", "FAILED")
                                  or j["attempt"] > 1) and j,
                         "the job to end", timeout=120, interval=0.3)
        assert job["state"] == "SUCCEEDED", job
        assert job["attempt"] == 1
        assert [a["outcome"] for a in job["attempts"]] == ["succeeded"]
        out, _ = watcher.communicate(timeout=120)
        assert watcher.returncode == 0, out
        assert "reconnecting" in out and "SUCCEEDED" in out, out
        assert "requeued" not in out and "lost" not in out.replace("lost the broker", ""), out
        assert "Traceback" not in market.providers["p1"].text()
    finally:
        market.close()
