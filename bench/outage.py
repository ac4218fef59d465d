"""Broker outages: how soon a client is back once the broker listens again, and whether a
running lease survives.

1. gRPC channels (in-process health servers on loopback, all runs at once): a call a second
   while the server is down for --down seconds, then the seconds from the server listening
   again to the first call that succeeds, for a channel with gRPC's default reconnect backoff
   and for one with the options of link/channel.py (RECONNECT_OPTIONS).
2. A marketplace (real broker and provider processes, default lease settings): a `script`
   job runs; the broker is killed (SIGKILL) --outages times, each time down --down seconds
   and restarted on the same address and data directory; the seconds from the broker's
   "listening" log line to the provider's "connected" one, and whether the job kept its
   first lease.

    .venv/bin/python bench/outage.py [--down 60] [--runs 3] [--outages 2]

Prints a line per run and per outage, then one JSON line: channel_back_s_default and
channel_back_s_capped (one figure per run), provider_back_s (per outage), lease_kept.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # noqa: E402

from gpumarket.link.channel import RECONNECT_OPTIONS  # noqa: E402
from tests.helpers import Marketplace, free_port, wait_until  # noqa: E402
from tests.test_outages import WAITER, stamped  # noqa: E402


async def _server(port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def channel_back_s(options, down: float) -> float:
    """Seconds from the server's return to the first call that succeeds."""
    port = free_port()
    server = await _server(port)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        await server.stop(None)
        gone = time.monotonic()
        while time.monotonic() - gone < down:       # a client trying once a second
            try:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(1)
        server = await _server(port)
        back = time.monotonic()
        try:
            while True:
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    return time.monotonic() - back
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.1)
        finally:
            await server.stop(None)


async def channels(down: float, runs: int) -> dict[str, list[float]]:
    kinds = {"default": (), "capped": RECONNECT_OPTIONS}
    jobs = {name: [channel_back_s(opts, down) for _ in range(runs)]
            for name, opts in kinds.items()}
    out = {}
    for name, coros in jobs.items():
        out[name] = [round(s, 2) for s in await asyncio.gather(*coros)]
        print(f"channel ({name}): back {out[name]} s after the server listened again",
              flush=True)
    return out


def marketplace(root: Path, down: float, outages: int) -> tuple[list[float], bool]:
    market = Marketplace(root)
    port = free_port()
    back: list[float] = []
    try:
        market.start_broker(listen=f"127.0.0.1:{port}")
        assert market.cli("keys", "init").returncode == 0
        market.start_provider("p1", 1.0, "--kinds", "script")
        market.wait_for_offers(1)
        (root / "waiter.py").write_text(WAITER)
        (root / "job.toml").write_text(f'kind = "script"\nname = "outage"\nmax_price = 2.0\n'
                                       f'[script]\ncode = "{root / "waiter.py"}"\n')
        r = market.cli("submit", str(root / "job.toml"))
        assert r.returncode == 0, r.stderr
        job_id = r.stdout.split()[0]
        wait_until(lambda: int(market.job(job_id)["progress"].get("step", 0)) > 0,
                   "the job to run", timeout=120, interval=0.3)
        provider = market.provider_id("p1")
        for n in range(outages):
            market.broker.stop(signal.SIGKILL)
            time.sleep(down)                  # the outage itself
            market.start_broker(listen=f"127.0.0.1:{port}", credit=0)
            log = market.broker.text
            listening = stamped(log(), "listening on", after=time.time() - 30)
            connected = wait_until(lambda: stamped(log(), f"provider {provider} connected",
                                                   after=listening),
                                   "the provider", timeout=120, interval=0.2)
            back.append(round(connected - listening, 2))
            print(f"outage {n + 1}: down {down:.0f} s; provider back {back[-1]} s after the"
                  " broker listened", flush=True)
        (root / "p1" / "jobs" / f"{job_id}.1" / "go").write_text("go")
        job = wait_until(lambda: ((j := market.job(job_id))["state"] in ("SUCCEEDED", "FAILED")
                                  or j["attempt"] > 1) and j, "the job to end", timeout=120)
        kept = job["state"] == "SUCCEEDED" and job["attempt"] == 1
        print(f"job {job['state']}, attempt {job['attempt']}", flush=True)
        return back, kept
    finally:
        market.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--down", type=float, default=60.0, help="seconds each outage lasts")
    parser.add_argument("--runs", type=int, default=3, help="channels of each kind")
    parser.add_argument("--outages", type=int, default=2, help="broker kills in one run")
    args = parser.parse_args()
    figures = asyncio.run(channels(args.down, args.runs))
    with tempfile.TemporaryDirectory(prefix="gpumarket-outage-") as tmp:
        back, kept = marketplace(Path(tmp), args.down, args.outages)
    print(json.dumps({"down_s": args.down, "channel_back_s_default": figures["default"],
                      "channel_back_s_capped": figures["capped"], "provider_back_s": back,
                      "lease_kept": kept}))


if __name__ == "__main__":
    main()
