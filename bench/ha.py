"""Two brokers on one PostgreSQL store (issue 36): failover under load, and durable placements
a second on PostgreSQL beside SQLite.

    .venv/bin/python bench/ha.py [--kills 10] [--providers 40] [--rate 4] [--leader-ttl 3]
                                 [--offers 10000] [--jobs 2000] [--held 0]

**Failover.** A throwaway PostgreSQL cluster (tests/pg.py, fsync on), two broker processes
on it sharing the market's key and blobs, simulated providers (the real protocol over TLS:
handshake, signed offer, heartbeats listing the leases they hold; each takes the leases it is
sent and holds them until cancelled) spread over both brokers and given both addresses, and
a client given both addresses that submits a stream of signed training jobs (``--rate`` a
second) and cancels each ``--hold`` seconds after submitting it, so leases are always
running. ``--kills`` times: the leader is SIGKILLed; ``failover_s`` is from the kill to the
first lease committed after it (by the new leader: the old one is dead), then the killed
broker is started again on its port. At the end: ``double_leases`` (pairs of leases of one
job whose lifetimes overlap, from the ``leases`` table), ``lost_acknowledged`` (submissions
the client was answered for that the store does not hold).

**Durable placements.** In process, on the real placement code and store: ``--offers``
simulated providers' offers (sessions held in memory, as the broker holds them; no gRPC),
``--jobs`` jobs submitted at once, and the leader's placement passes (fenced writes, on
PostgreSQL; a pass, then a wait for the next submission, as the broker's loop) until every
job's lease is committed: jobs / seconds from the first submission to the last lease
committed, on PostgreSQL and on SQLite in the same run. The offers' Templates
(market/offers.KeptOffers) are made before the clock starts.

The last line is one JSON object with the figures and the machine's load.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from gpumarket.link.channel import Trust, call_token, open_channel  # noqa: E402
from gpumarket.link.client import BrokerClient  # noqa: E402
from gpumarket.proto.envelope import seal  # noqa: E402
from gpumarket.proto.identity import Identity  # noqa: E402
from gpumarket.proto.jobspec import now_ms  # noqa: E402
from gpumarket.proto.v1 import gateway_pb2 as gw  # noqa: E402
from gpumarket.proto.v1 import gateway_pb2_grpc  # noqa: E402
from gpumarket.proto.v1 import marketplace_pb2 as mp  # noqa: E402
from gpumarket.proto.v1 import types_pb2 as pb  # noqa: E402
from gpumarket.proto.wire import TOKEN_METADATA  # noqa: E402
from bench import pg_bench  # noqa: E402
from tests import pg  # noqa: E402
from tests.helpers import (BIN, Marketplace, Process, free_port, signed_offer,  # noqa: E402
                           training_job, wait_until)

SESSION = "/gpumarket.v1.ProviderGateway/Session"


# -- failover -----------------------------------------------------------------------------

class Sim:
    """Simulated providers, each moving to the next broker address when its session breaks."""

    def __init__(self, identities: list[Identity], addresses: list[str], pin: str,
                 interval: float) -> None:
        self.identities = identities
        self.addresses = addresses
        self.trust = Trust(pin=pin)
        self.pin = pin
        self.interval = interval
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.stop = asyncio.Event()
        self.leases = 0
        self.kicks: dict[int, asyncio.Event] = {}
        self.moved: dict[int, int] = {}        # provider -> the address index it goes to next
        # (job, epoch) -> (when it arrived, ms; the broker address of the session it came on)
        self.received: dict[tuple[str, int], tuple[int, str]] = {}

    async def channel(self, address: str, fresh: bool) -> grpc.aio.Channel:
        if fresh and address in self.channels:
            await self.channels.pop(address).close()
        if address not in self.channels:
            self.channels[address] = (await open_channel(address, None, self.trust, 5)).channel
        return self.channels[address]

    async def provider(self, i: int, identity: Identity) -> None:
        at, fresh = i, False
        running: set[tuple[str, int]] = set()
        self.kicks[i] = kick = asyncio.Event()
        stopping = asyncio.create_task(self.stop.wait())
        while not self.stop.is_set():
            address = self.addresses[at % len(self.addresses)]
            kick.clear()
            kicked = asyncio.create_task(kick.wait())
            session = asyncio.create_task(self.connected(address, fresh, identity, running))
            done, _ = await asyncio.wait({session, stopping, kicked},
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in (session, kicked):
                task.cancel()
            await asyncio.gather(session, kicked, return_exceptions=True)
            fresh = session in done and session.exception() is not None
            at = self.moved.pop(i, at + 1)
            await asyncio.sleep(0.2 + random.random() * 0.3)
        stopping.cancel()

    async def connected(self, address: str, fresh: bool, identity: Identity,
                        running: set) -> None:
        await self.session(await self.channel(address, fresh), identity, running, address)

    def rebalance(self, address: str) -> None:
        """Every other provider ends its session and opens one on ``address`` (providers
        stay where they moved after a kill: without this, all end on one broker)."""
        target = self.addresses.index(address)
        for i in range(0, len(self.identities), 2):
            if i in self.kicks:
                self.moved[i] = target
                self.kicks[i].set()

    async def session(self, channel, identity: Identity, running: set, address: str) -> None:
        metadata = grpc.aio.Metadata((TOKEN_METADATA, call_token(identity, SESSION, self.pin,
                                                                 None)))
        call = gateway_pb2_grpc.ProviderGatewayStub(channel).Session(metadata=metadata)
        try:
            await asyncio.wait_for(call.write(gw.ProviderMessage(hello=gw.ProviderHello(
                public_key=identity.public_key, software_version="0.1.0",
                reconnect_within_ms=2_000))), 10)
            challenge = await asyncio.wait_for(call.read(), 10)
            await asyncio.wait_for(call.write(gw.ProviderMessage(proof=seal(
                identity, gw.SessionProof(
                    nonce=challenge.challenge.nonce,
                    broker_public_key=challenge.challenge.broker_public_key,
                    at_ms=now_ms())))), 10)
            welcome = await asyncio.wait_for(call.read(), 10)
            if welcome is grpc.aio.EOF or welcome.WhichOneof("msg") != "welcome":
                raise RuntimeError("no welcome")
            await asyncio.wait_for(call.write(gw.ProviderMessage(
                offer=signed_offer(identity))), 10)
            reader = asyncio.create_task(self.read(call, running, address))
            try:
                while not self.stop.is_set() and not reader.done():
                    # Bounded: a write to a stream its broker no longer reads would wait
                    # for ever (a real provider writes and reads in tasks of their own).
                    await asyncio.wait_for(call.write(gw.ProviderMessage(
                        heartbeat=gw.Heartbeat(at_ms=now_ms(), running=[
                            gw.RunningLease(job_id=j, epoch=e) for j, e in running]))), 5)
                    await asyncio.wait({reader}, timeout=self.interval)
                if reader.done() and reader.exception():
                    raise reader.exception()
            finally:
                reader.cancel()
        finally:
            call.cancel()

    async def read(self, call, running: set, address: str) -> None:
        while True:
            message = await call.read()
            if message is grpc.aio.EOF:
                raise RuntimeError("session ended")
            which = message.WhichOneof("msg")
            if which == "lease":
                lease = pb.Lease.FromString(message.lease.payload)
                self.received.setdefault((lease.job_id, lease.epoch), (now_ms(), address))
                if (lease.job_id, lease.epoch) in running:
                    continue
                running.clear()         # one device: what it ran is over
                running.add((lease.job_id, lease.epoch))
                self.leases += 1
                await asyncio.wait_for(call.write(gw.ProviderMessage(job_update=gw.JobUpdate(
                    job_id=lease.job_id, epoch=lease.epoch, started=gw.JobStarted()))), 5)
            elif which == "cancel":
                running.discard((message.cancel.job_id, message.cancel.epoch))

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()


class Stream:
    """A client submitting signed jobs to both brokers and cancelling each after a while."""

    def __init__(self, market: Marketplace, address: str, rate: float, hold_s: float) -> None:
        self.market = market
        self.address = address
        self.rate = rate
        self.hold_s = hold_s
        self.acknowledged: list[str] = []
        self.failed = 0
        self.stop = asyncio.Event()

    async def run(self, job_file: Path) -> None:
        from gpumarket.client import jobfile
        from gpumarket.client.submit import build_spec, upload_inputs

        identity = self.market.identity()
        client = BrokerClient(self.address, identity, 10, Trust(pin=self.market.broker_id))
        await client.connect()
        job = jobfile.load(job_file)
        refs = await upload_inputs(client, job)
        pending: list[tuple[float, str]] = []
        try:
            while not self.stop.is_set():
                began = time.monotonic()
                try:
                    spec = build_spec(job, refs, now_ms())
                    spec.nonce = os.urandom(16)
                    self.acknowledged.append((await client.submit(seal(identity, spec))).job_id)
                    pending.append((began, self.acknowledged[-1]))
                    while pending and pending[0][0] < began - self.hold_s:
                        _, job_id = pending.pop(0)
                        await client.cancel(seal(identity, mp.CancelOrder(job_id=job_id,
                                                                          at_ms=now_ms())))
                except Exception:       # noqa: BLE001 - no broker answered: not acknowledged
                    self.failed += 1
                    await client.close()
                    try:
                        await client.connect()
                    except Exception:   # noqa: BLE001
                        pass
                await asyncio.sleep(max(0.0, 1 / self.rate - (time.monotonic() - began)))
        finally:
            await client.close()


async def ended(tasks: list[asyncio.Task], within_s: float) -> None:
    """Wait for ``tasks`` to end; those still running after ``within_s`` are shown (where
    they wait) and cancelled."""
    _, late = await asyncio.wait(tasks, timeout=within_s)
    for task in late:
        print(f"still running after {within_s:.0f} s, cancelled:", file=sys.stderr)
        task.print_stack(file=sys.stderr)
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def query(url: str, sql: str, params=()) -> list[tuple]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


def start_broker(root: Path, name: str, port: int, url: str, args) -> tuple[Process, dict]:
    data = root / name
    info = data / "broker.json"
    info.unlink(missing_ok=True)
    proc = Process([str(BIN / "gpumarket-broker"), "serve", "--listen", f"127.0.0.1:{port}",
                    "--data-dir", str(data), "--no-verify", "--store", url, "--leader-ttl",
                    str(args.leader_ttl), "--lease-timeout", str(args.lease_timeout),
                    "--heartbeat-interval", "1", "--rate-limit", "0", "--max-queued-jobs",
                    "10000", "--log-level", "warning"], root / f"{name}.log",
                   {**os.environ, "GPUMARKET_HOME": str(root / "client-home")})
    try:
        wait_until(lambda: info.exists() or not proc.alive(), f"broker {name}", 120)
        if not proc.alive():
            raise SystemExit(f"broker {name} did not start:\n{proc.text()[-3000:]}")
        return proc, json.loads(info.read_text())
    except BaseException:
        proc.stop(timeout=30)       # not yet the caller's to stop
        raise


async def failover(root: Path, cluster: pg.Cluster, args) -> dict:
    """The failover figures; every broker process it started is stopped before it returns
    or raises (a kill no broker took over from, an interrupt): none outlives the run and
    its cluster, as three did once, found long after, their store gone."""
    market = Marketplace(root)
    brokers: dict[str, tuple[Process, dict]] = {}
    try:
        return await kill_leaders(root, cluster, args, market, brokers)
    finally:
        for proc in [market.broker, *(proc for proc, _ in brokers.values())]:
            if proc is not None:
                proc.stop(timeout=30)


async def kill_leaders(root: Path, cluster: pg.Cluster, args, market: Marketplace,
                       brokers: dict[str, tuple[Process, dict]]) -> dict:
    """Two brokers (``brokers``, by name), the providers and the client's stream; kill the
    leader ``args.kills`` times; return the figures."""
    url = cluster.database()
    ports = [free_port(), free_port()]
    market.start_broker("--store", url, "--leader-ttl", str(args.leader_ttl),
                        "--lease-timeout", str(args.lease_timeout), "--heartbeat-interval", "1",
                        "--rate-limit", "0", "--max-queued-jobs", "10000",
                        listen=f"127.0.0.1:{ports[0]}", credit=1_000_000)
    brokers["broker"] = (market.broker,
                         json.loads((root / "broker" / "broker.json").read_text()))
    (root / "broker-b").mkdir(mode=0o700)
    shutil.copy2(root / "broker" / "broker.key", root / "broker-b" / "broker.key")
    (root / "broker-b" / "artifacts").symlink_to(root / "broker" / "artifacts")
    brokers["broker-b"] = start_broker(root, "broker-b", ports[1], url, args)
    addresses = [brokers["broker"][1]["address"], brokers["broker-b"][1]["address"]]
    sim = Sim([Identity.generate() for _ in range(args.providers)], addresses,
              market.broker_id, 1.0)
    providers = [asyncio.create_task(sim.provider(i, ident))
                 for i, ident in enumerate(sim.identities)]
    stream = Stream(market, ",".join(addresses), args.rate, args.hold)
    submitting = asyncio.create_task(stream.run(training_job(root / "job.toml")))
    times: list[float] = []
    leaders = [(0, addresses[0])]       # (from, ms; the leader's address): a leads first
    try:
        await asyncio.sleep(args.steady)
        # The client uploads its inputs before it submits (seconds on a loaded machine): a
        # kill before its first acknowledged submission would find nothing to place, or end
        # its stream in the upload.
        deadline = time.monotonic() + 120
        while not stream.acknowledged:
            if submitting.done():
                raise SystemExit(f"the client's stream ended: {submitting.exception()!r}")
            if time.monotonic() > deadline:
                raise SystemExit("no submission acknowledged within 120 s")
            await asyncio.sleep(0.1)
        for kill in range(args.kills):
            holder = query(url, "SELECT holder FROM leadership WHERE role = 'scheduler'")[0][0]
            name = next(n for n, (_, info) in brokers.items() if info["holder"] == holder)
            proc = brokers[name][0]
            killed_ms = now_ms()
            proc.stop(signal.SIGKILL)
            first = None
            deadline = time.monotonic() + 120
            while first is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                first = query(url, "SELECT min(issued_at_ms) FROM leases WHERE"
                              " issued_at_ms > %s", (killed_ms,))[0][0]
            if first is None:
                raise SystemExit(f"kill {kill + 1}: no lease within 120 s of the kill")
            times.append((first - killed_ms) / 1000)
            leaders.append((killed_ms, addresses[1] if name == "broker" else addresses[0]))
            print(f"kill {kill + 1}: {name} (the leader) SIGKILLed; first placement by the new"
                  f" leader after {times[-1]:.2f} s", flush=True)
            port = ports[0] if name == "broker" else ports[1]
            brokers[name] = await asyncio.to_thread(start_broker, root, name, port, url, args)
            sim.rebalance(brokers[name][1]["address"])      # half the providers go there
            await asyncio.sleep(args.steady)
    finally:
        stream.stop.set()
        sim.stop.set()
        await ended([submitting, *providers], 60)
        await sim.close()
    held = {r[0] for r in query(url, "SELECT id FROM jobs")}
    lost = [j for j in stream.acknowledged if j not in held]
    overlapping = query(url, """
        SELECT count(*) FROM leases a JOIN leases b ON a.job_id = b.job_id AND a.id < b.id
        WHERE b.issued_at_ms < coalesce(a.ended_at_ms, 9223372036854775807)
          AND a.issued_at_ms < coalesce(b.ended_at_ms, 9223372036854775807)""")[0][0]
    total = query(url, "SELECT count(*) FROM leases")[0][0]
    # From a lease's write to its provider: on a session on the leader (sent directly), and
    # on the other broker (relayed by a notice, or found by that broker's poll).
    direct, relayed = [], []
    for job_id, epoch, issued in query(url, "SELECT job_id, epoch, issued_at_ms FROM leases"):
        if (job_id, epoch) in sim.received:
            got, address = sim.received[(job_id, epoch)]
            leader = [a for since, a in leaders if since <= issued][-1]
            (direct if address == leader else relayed).append(got - issued)
    return {"failover_s": round(statistics.mean(times), 2),
            "failover_s_max": round(max(times), 2), "kills": len(times),
            "double_leases": overlapping, "lost_acknowledged": len(lost),
            "acknowledged": len(stream.acknowledged), "submit_failures": stream.failed,
            "leases": total,
            "lease_delivery_ms_direct_p50": pct(direct, 0.5),
            "lease_delivery_ms_relayed_p50": pct(relayed, 0.5),
            "lease_delivery_ms_relayed_p99": pct(relayed, 0.99),
            "leases_relayed": len(relayed)}


def pct(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


# -- durable placements --------------------------------------------------------------------

async def placements(store, root: Path, offers: int, count: int, fenced: bool,
                     cluster: pg.Cluster | None = None, held: int = 0) -> dict:
    """Durable placements a second (``rate``) and what each cost in CPU (ms): this process's
    (``cpu_ms``: the submissions, the passes, the writer) and, given the store's
    ``cluster``, its server's (``server_cpu_ms``); on a loaded machine the CPU a placement
    costs moves less than the rate. ``held``: the units each job holds (0: none, no
    posting; a real submission holds its bound, a posting in the ledger)."""
    from gpumarket.broker.jobs import transitions as jobs
    from gpumarket.broker.market import scheduler
    from gpumarket.broker.market.admission import Needs, NewJob
    from gpumarket.broker.store import leadership

    state = await pg_bench.simulated_market(root, store, offers)
    leader = state
    if fenced:
        epoch = await store.write(leadership.take, "bench", now_ms(), 600_000)
        leader = scheduler.as_leader(state, epoch)
    client = Identity.generate()
    spec = seal(client, pb.JobSpec(name="p", kind=pb.JOB_KIND_TRAINING)).SerializeToString()
    needs = Needs(kind=pb.JOB_KIND_TRAINING, gpus=1, min_memory_bytes=0,
                  accelerator=pb.ACCELERATOR_UNSPECIFIED, max_price_per_gpu_hour=10.0)

    def job(i: int) -> NewJob:
        return NewJob(id=f"job{i:06d}", client_id=client.id, name="p", spec=spec,
                      spec_sha256="0" * 64, needs=needs, expires_at_ms=now_ms() + 3_600_000,
                      max_attempts=3, nonce=f"{i:032x}", hold=held, hold_basis="bench")

    def leased(db) -> int:
        return db.execute("SELECT count(*) FROM leases").fetchone()[0]

    # A broker makes each offer's Template (market/offers.KeptOffers) at the first pass after
    # its provider connected, long before a burst of submissions: so here too.
    await scheduler.offer_book(leader)
    server = pg_bench.server_cpu_s(cluster) if cluster else 0.0
    cpu = time.process_time()
    began = time.perf_counter()
    async def submitted(i: int) -> None:
        await store.write(jobs.submit, job(i), now_ms())
        state.placement.notify()        # as the Marketplace servicer does after a submission

    submits = asyncio.gather(*(submitted(i) for i in range(count)))
    while True:     # the placement loop's turns (scheduler.repeat): a pass, then a change
        seen = state.placement.seen()
        await scheduler.place_queued(leader)
        if submits.done() and await store.read(leased) >= count:
            break
        await state.placement.wait(state.config.schedule_interval_s, since=seen)
    await submits
    elapsed = time.perf_counter() - began
    out = {"rate": count / elapsed, "cpu_ms": (time.process_time() - cpu) * 1000 / count}
    if cluster:
        out["server_cpu_ms"] = (pg_bench.server_cpu_s(cluster) - server) * 1000 / count
    return out


async def durable(root: Path, cluster: pg.Cluster, args) -> dict:
    from gpumarket.broker.store.store import PgStore, Store

    out = {}
    for name in ("postgresql", "sqlite"):
        store = PgStore(cluster.database()) if name == "postgresql" \
            else Store(root / f"place-{name}.db")
        store.open()
        try:
            got = await placements(store, root / f"place-{name}", args.offers, args.jobs,
                                   fenced=name == "postgresql",
                                   cluster=cluster if name == "postgresql" else None,
                                   held=args.held)
        finally:
            store.close()
        out[f"durable_placements_per_s_{name}"] = round(got["rate"], 1)
        out[f"cpu_ms_per_placement_{name}"] = round(got["cpu_ms"], 3)
        server = ""
        if "server_cpu_ms" in got:
            out["server_cpu_ms_per_placement_postgresql"] = round(got["server_cpu_ms"], 3)
            server = f", server {got['server_cpu_ms']:.2f}"
        print(f"{name}: {got['rate']:.0f} durable placements/s ({args.jobs} jobs, {args.offers}"
              f" offers); CPU ms a placement: this process {got['cpu_ms']:.2f}{server}",
              flush=True)
    return out


def main() -> None:
    parser = pg_bench.parser(__doc__, offers=10_000, jobs=2_000)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--providers", type=int, default=40)
    parser.add_argument("--rate", type=float, default=4.0, help="submissions a second")
    parser.add_argument("--hold", type=float, default=4.0, help="seconds before each cancel")
    parser.add_argument("--leader-ttl", type=float, default=3.0)
    parser.add_argument("--lease-timeout", type=float, default=15.0)
    parser.add_argument("--steady", type=float, default=4.0,
                        help="seconds of the stream before each kill")
    parser.add_argument("--held", type=int, default=0,
                        help="units each in-process placement's job holds (default 0: no"
                             " ledger posting; a real submission holds its bound)")
    args = pg_bench.parse(parser)
    # A SIGTERM (``timeout``, a CI runner's cancel) ends the run as an exception does, through
    # the ``finally``s that stop its brokers and then its cluster.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="gpumarket-ha-"))
    cluster = pg.Cluster(durable=True)
    try:
        figures = asyncio.run(failover(root / "failover", cluster, args)) \
            if (root / "failover").mkdir() is None and args.kills else {}
        (root / "place").mkdir()
        figures.update(asyncio.run(durable(root / "place", cluster, args)))
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    figures["durable_placements_per_s"] = figures["durable_placements_per_s_postgresql"]
    figures["load_before"] = [round(x, 2) for x in load_before]
    figures["load_after"] = [round(x, 2) for x in os.getloadavg()]
    figures["cores"] = os.cpu_count()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
