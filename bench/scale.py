"""How many providers one broker keeps up with (issue: many small jobs, the broker's write
path). Simulated providers speak the real protocol to a real broker process over TLS: each
opens a gateway session on one of a few shared channels with its own signed call token,
proves its key (hello, challenge, proof), sends a signed offer, and heartbeats every
--interval seconds. For each N in --providers, after every session is up:

- broker CPU (share of one core) and RSS, from /proc, over the measuring window;
- heartbeat lateness p99: how long past its interval a provider's last_seen is, read from
  the broker's database (what the broker recorded, not what was sent);
- signed calls (GetAccount: a token checked and its nonce written) p50/p99, one at a time,
  from a process of their own (not the simulator's event loop, which 10,000 sessions'
  heartbeats keep busy);
- submit -> lease p50/p99: a training job submitted, until a simulated provider holds its
  signed lease (then it is cancelled) — seen by the simulator's own loop, so its delays
  are in this figure;
- offers search (SearchOffers, anonymous, up to 1,000 listings) p50, from that process too;
- the reconnect storm: the broker is restarted and every provider reconnects at once
  (within a second); sessions refused (a handshake that failed or timed out) are counted.

    .venv/bin/python bench/scale.py [--providers 1000,5000,10000] [--interval 5]
                                    [--window 30] [--calls 200] [--jobs 20]

The simulator and the broker share this machine's cores. It stops at the first N whose
sessions do not all open. Prints per-N figures; the last line is one JSON object with the
figures of the largest N that ran: providers, broker_cpu_fraction, rss_mib,
signed_call_p99_ms, storm_refused (and the others, and every N's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sqlite3
import sys
import tempfile
import time
from collections import Counter
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
from tests.helpers import Marketplace, signed_offer, training_job  # noqa: E402

SESSION = "/gpumarket.v1.ProviderGateway/Session"
PROBE = r"""
import asyncio, json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from gpumarket.link.channel import Trust
from gpumarket.link.client import BrokerClient
from gpumarket.proto.identity import Identity
from gpumarket.proto.v1 import marketplace_pb2 as mp

async def main(address, pin, key, window, count):
    client = BrokerClient(address, Identity.load(Path(key)), trust=Trust(pin=pin))
    anonymous = BrokerClient(address, None, trust=Trust(pin=pin))
    await client.connect()
    await anonymous.connect()
    calls, searches = [], []
    deadline = time.perf_counter() + window
    while time.perf_counter() < deadline:
        began = time.perf_counter()
        await client.account(limit=1)
        calls.append(time.perf_counter() - began)
        await asyncio.sleep(max(0.0, window / count - (time.perf_counter() - began)))
    for _ in range(10):
        began = time.perf_counter()
        await anonymous.search_offers(mp.SearchOffersRequest(limit=1000))
        searches.append(time.perf_counter() - began)
    await client.close()
    await anonymous.close()
    print(json.dumps({"calls": calls, "searches": searches}))

asyncio.run(main(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]), int(sys.argv[6])))
"""
CHANNELS = 16


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered \
        else float("nan")


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Fleet:
    """N simulated providers on a few shared channels."""

    def __init__(self, identities: list[Identity], interval: float) -> None:
        self.identities = identities
        self.interval = interval
        self.channels: list[grpc.aio.Channel] = []
        self.broker_id = ""
        self.leases: dict[str, float] = {}      # job id -> when its lease arrived
        self.open = 0
        self.refused = 0
        self.why: Counter[str] = Counter()      # refusals, by what the broker said
        self.tasks: list[asyncio.Task] = []
        self.stop = asyncio.Event()

    async def connect(self, address: str, trust: Trust) -> None:
        for channel in self.channels:
            await channel.close()
        self.channels = []
        for _ in range(CHANNELS):
            opened = await open_channel(address, None, trust)
            self.channels.append(opened.channel)
            self.broker_id = opened.broker_id

    async def session(self, i: int, identity: Identity, spread: float) -> None:
        await asyncio.sleep(random.random() * spread)
        channel = self.channels[i % len(self.channels)]
        metadata = grpc.aio.Metadata((TOKEN_METADATA, call_token(identity, SESSION,
                                                                 self.broker_id, None)))
        call = gateway_pb2_grpc.ProviderGatewayStub(channel).Session(metadata=metadata)
        try:
            await call.write(gw.ProviderMessage(hello=gw.ProviderHello(
                public_key=identity.public_key, software_version="0.1.0")))
            challenge = await asyncio.wait_for(call.read(), 30)
            if challenge is grpc.aio.EOF or challenge.WhichOneof("msg") != "challenge":
                raise RuntimeError("no challenge")
            key = challenge.challenge.broker_public_key
            await call.write(gw.ProviderMessage(proof=seal(identity, gw.SessionProof(
                nonce=challenge.challenge.nonce, broker_public_key=key, at_ms=now_ms()))))
            welcome = await asyncio.wait_for(call.read(), 30)
            if welcome is grpc.aio.EOF or welcome.WhichOneof("msg") != "welcome":
                raise RuntimeError("no welcome")
            await call.write(gw.ProviderMessage(offer=signed_offer(identity)))
        except (grpc.aio.AioRpcError, RuntimeError, TimeoutError,
                asyncio.InvalidStateError) as exc:
            self.refused += 1
            self.why[f"{exc.code().name}: {exc.details()}" if isinstance(
                exc, grpc.aio.AioRpcError) else type(exc).__name__] += 1
            call.cancel()
            return
        self.open += 1
        reader = asyncio.create_task(self._read(call))
        try:
            await asyncio.sleep(random.random() * self.interval)
            while not self.stop.is_set():
                await call.write(gw.ProviderMessage(heartbeat=gw.Heartbeat(at_ms=now_ms())))
                try:
                    await asyncio.wait_for(self.stop.wait(), self.interval)
                except TimeoutError:
                    pass
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass
        finally:
            self.open -= 1
            reader.cancel()
            call.cancel()

    async def _read(self, call) -> None:
        try:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    return
                if message.WhichOneof("msg") == "lease":
                    lease = pb.Lease()
                    lease.ParseFromString(message.lease.payload)
                    self.leases.setdefault(lease.job_id, time.perf_counter())
        except (grpc.aio.AioRpcError, asyncio.CancelledError, asyncio.InvalidStateError):
            return

    def start(self, spread: float) -> None:
        self.stop = asyncio.Event()
        self.refused = 0
        self.why = Counter()
        self.tasks = [asyncio.create_task(self.session(i, ident, spread))
                      for i, ident in enumerate(self.identities)]

    async def end(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for channel in self.channels:
            await channel.close()
        self.channels = []


def lateness_p99(db_path: Path, interval: float) -> float:
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30)
    try:
        now = now_ms()
        ages = [(now - r[0]) / 1000 - interval for r in conn.execute(
            "SELECT last_seen_ms FROM providers WHERE online = 1").fetchall()]
    finally:
        conn.close()
    return max(0.0, pct(ages, 0.99))


async def measure(market: Marketplace, fleet: Fleet, n: int, args, job_file: Path) -> dict:
    pid = market.broker.proc.pid
    client = BrokerClient(market.address, market.identity(), trust=market.trust())
    await client.connect()
    try:
        # Signed calls and searches from a process of their own: this one's event loop is
        # busy with every simulated session's heartbeats, and would delay them.
        probe = await asyncio.create_subprocess_exec(
            sys.executable, "-c", PROBE, str(ROOT), market.address, market.broker_id,
            str(market.home / "client.key"), str(args.window), str(args.calls),
            stdout=asyncio.subprocess.PIPE)
        cpu0, t0 = proc_cpu_s(pid), time.perf_counter()
        late, cpu, rss = [], None, 0.0
        while probe.returncode is None:
            try:
                await asyncio.wait_for(probe.wait(), 3.0)
            except TimeoutError:
                pass
            if cpu is None and time.perf_counter() - t0 >= args.window:
                cpu = (proc_cpu_s(pid) - cpu0) / (time.perf_counter() - t0)
                rss = proc_rss_mib(pid)
            elif cpu is None:
                late.append(lateness_p99(market.root / "broker" / "broker.db", args.interval))
        if probe.returncode != 0:
            raise SystemExit(f"the probe failed (exit {probe.returncode})")
        probed = json.loads((await probe.stdout.read()).decode().strip().splitlines()[-1])
        calls, searches = probed["calls"], probed["searches"]
        if cpu is None:
            cpu = (proc_cpu_s(pid) - cpu0) / (time.perf_counter() - t0)
            rss = proc_rss_mib(pid)
        leases = []
        from gpumarket.client import jobfile
        from gpumarket.client.submit import build_spec, upload_inputs

        job = jobfile.load(job_file)
        refs = await upload_inputs(client, job)
        for _ in range(args.jobs):
            spec = build_spec(job, refs, now_ms())
            began = time.perf_counter()
            job_id = (await client.submit(seal(market.identity(), spec))).job_id
            while job_id not in fleet.leases and time.perf_counter() - began < 60:
                await asyncio.sleep(0.005)
            if job_id in fleet.leases:
                leases.append(fleet.leases[job_id] - began)
            await client.cancel(seal(market.identity(), mp.CancelOrder(job_id=job_id,
                                                                     at_ms=now_ms())))
    finally:
        await client.close()
    return {"providers": n, "broker_cpu_fraction": round(cpu, 3), "rss_mib": round(rss, 1),
            "heartbeat_lateness_p99_s": round(max(late) if late else float("nan"), 3),
            "signed_call_p50_ms": round(pct(calls, 0.5) * 1000, 2),
            "signed_call_p99_ms": round(pct(calls, 0.99) * 1000, 2),
            "submit_to_lease_p50_ms": round(pct(leases, 0.5) * 1000, 1),
            "submit_to_lease_p99_ms": round(pct(leases, 0.99) * 1000, 1),
            "leases_seen": len(leases),
            "offers_search_p50_ms": round(pct(searches, 0.5) * 1000, 1)}


async def one_n(root: Path, n: int, args) -> dict | None:
    (root / f"n{n}").mkdir()
    market = Marketplace(root / f"n{n}")
    extra = ("--heartbeat-interval", str(args.interval), "--lease-timeout",
             str(args.interval * 3), "--rate-limit", "0", "--log-level", "warning")
    market.start_broker(*extra, credit=100_000)
    fleet = Fleet([Identity.generate() for _ in range(n)], args.interval)
    try:
        await fleet.connect(market.address, market.trust())
        began = time.perf_counter()
        fleet.start(spread=min(30.0, n / 500))
        while fleet.open + fleet.refused < n and time.perf_counter() - began < 300:
            await asyncio.sleep(0.5)
        up_s = time.perf_counter() - began
        print(f"N={n}: {fleet.open} sessions open, {fleet.refused} refused, in {up_s:.1f} s",
              flush=True)
        if fleet.open < n:
            return None
        await asyncio.sleep(args.interval * 2)        # every provider has beaten twice
        figures = await measure(market, fleet, n, args, training_job(root / f"job{n}.toml"))
        # The storm: the broker restarts; every provider reconnects within a second.
        await fleet.end()
        market.broker.stop()
        market.start_broker(*extra, credit=0)
        await fleet.connect(market.address, market.trust())
        began = time.perf_counter()
        fleet.start(spread=1.0)
        while fleet.open + fleet.refused < n and time.perf_counter() - began < args.interval * 3:
            await asyncio.sleep(0.2)
        figures["storm_refused"] = fleet.refused + (n - fleet.open - fleet.refused)
        figures["storm_s"] = round(time.perf_counter() - began, 1)
        if fleet.why:
            # What the simulator saw, and what the broker logged: grpc's asyncio client
            # reports a stream the server ended while it was writing as INTERNAL ("Internal
            # error from Core"), whatever the server said; a call gRPC's core refused at its
            # backlog (proto/wire.py MAX_PENDING_CALLS) is never seen by the broker at all.
            said = Counter(line.split(": ", 2)[-1][:90] for line in
                           (market.root / "broker.log").read_text().splitlines()
                           if "refused" in line and "WARNING" in line)
            print(f"N={n}: storm refusals: " + "; ".join(
                f"{count} {why}" for why, count in fleet.why.most_common(3))
                + "; the broker logged: " + "; ".join(
                f"{count} {why}" for why, count in said.most_common(3)), flush=True)
        print(f"N={n}: " + ", ".join(f"{k} {v}" for k, v in figures.items() if k != "providers"),
              flush=True)
        return figures
    finally:
        await fleet.end()
        market.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--providers", default="1000,5000,10000")
    parser.add_argument("--interval", type=float, default=5.0, help="heartbeat seconds")
    parser.add_argument("--window", type=float, default=30.0, help="measuring seconds")
    parser.add_argument("--calls", type=int, default=200, help="signed calls in the window")
    parser.add_argument("--jobs", type=int, default=20, help="jobs submitted per N")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for n in [int(x) for x in args.providers.split(",")]:
            figures = asyncio.run(one_n(root, n, args))
            if figures is None:
                print(f"N={n}: not every session opened; stopping here", flush=True)
                break
            results.append(figures)
    largest = results[-1] if results else {"providers": 0}
    print(json.dumps({**largest, "all": results}))


if __name__ == "__main__":
    main()
