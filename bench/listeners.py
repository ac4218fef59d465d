"""An outsider's connection flood against the endpoints' API port, and what the broker's other
clients see meanwhile (issue 30, item 6; docs/security.md, Listeners).

One broker (TLS, `--api` and `--http` on, default limits, the open-file limit this machine
gives a process) and, in three phases of `--seconds` each:

- baseline: no flood;
- one peer: a separate process opens `--connections` (20,000) connections to the API port
  from 127.0.0.1 at once, each sending a partial request line and nothing more, and re-opens
  every one the broker closes (at most `--reopen-rate` a second), trying to hold them all;
- many peers: `--many` connections (default: a quarter more than the broker's open-file
  limit, 25,000 here) from `--peers` (100) addresses 127.0.0.2 ..., so that the per-peer cap
  does not bind and the API listener's share of descriptors does (a broker without that
  share runs out of descriptors here).

Meanwhile another client makes signed gRPC calls (`ListJobs`, a fresh call token each): one
every 50 ms on a channel it keeps, and one every 0.5 s on a new connection (TCP, TLS and the
call: what a CLI command does). Prints, per phase, those calls' p50/p99 and failures, the
API connections the broker held (`gpumarket_connections{listener="api"}`, sampled), the
connections the attacker opened and saw closed, and how much the broker's log grew; the
last line is one JSON object of those figures.

    .venv/bin/python bench/listeners.py [--connections 20000] [--seconds 30]

The attacker is as many processes as the open-file limit needs (10,000 connections each at
most); the broker keeps the limit this machine gives a process.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import resource
import select
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BIN = Path(sys.executable).parent
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)   # Linux
PER_PROCESS = 10_000         # connections one attacker process holds at most
PARTIAL = b"POST /v1/chat/completions HTTP/1.1\r\nHost: api\r\nAuthorization: Bearer gm-"


# -- the attacker (its own process) ---------------------------------------------------------

def attack(port: int, connections: int, sources: list[str], seconds: float,
           reopen_rate: float) -> dict:
    """Open ``connections`` to 127.0.0.1:``port`` spread over ``sources``, send each a partial
    request, keep re-opening those the broker closes; returns what it saw."""
    ep = select.epoll()
    socks: dict[int, tuple[socket.socket, str]] = {}
    opened = closed = failed = 0
    per_source = {s: 0 for s in sources}
    quota = connections // len(sources)

    def open_one(source: str) -> None:
        nonlocal opened, failed
        s = socket.socket()
        s.setblocking(False)
        try:
            # The port is chosen at connect, not at bind (which searches the port range
            # and grows slow with tens of thousands of ports in use).
            s.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            s.bind((source, 0))
            err = s.connect_ex(("127.0.0.1", port))
        except OSError:
            s.close()
            failed += 1
            return
        if err not in (0, errno.EINPROGRESS):
            s.close()
            failed += 1
            return
        socks[s.fileno()] = (s, source)
        per_source[source] += 1
        ep.register(s.fileno(), select.EPOLLOUT | select.EPOLLIN | select.EPOLLRDHUP)
        opened += 1

    def drop(fd: int) -> None:
        nonlocal closed
        s, source = socks.pop(fd)
        ep.unregister(fd)
        s.close()
        per_source[source] -= 1
        closed += 1

    began = time.monotonic()
    for source in sources:                      # the first wave: all at once
        for _ in range(quota):
            open_one(source)
    first_wave = time.monotonic() - began
    reopened, credit, last = 0, 0.0, time.monotonic()
    while time.monotonic() - began < seconds:
        for fd, ev in ep.poll(0.05):
            s, _ = socks[fd]
            if ev & (select.EPOLLERR | select.EPOLLHUP | select.EPOLLRDHUP):
                drop(fd)
            elif ev & select.EPOLLIN:
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    drop(fd)
            elif ev & select.EPOLLOUT:
                try:
                    s.send(PARTIAL)
                except OSError:
                    drop(fd)
                    continue
                ep.modify(fd, select.EPOLLIN | select.EPOLLRDHUP)
        now = time.monotonic()
        credit = min(reopen_rate, credit + (now - last) * reopen_rate)
        last = now
        for source in sources:
            while per_source[source] < quota and credit >= 1:
                open_one(source)
                reopened += 1
                credit -= 1
    held = len(socks)
    for s, _ in socks.values():
        s.close()
    return {"opened": opened, "reopened": reopened, "closed_by_broker": closed,
            "connect_failed": failed, "open_at_end": held,
            "first_wave_s": round(first_wave, 2)}


# -- the broker and the other client ------------------------------------------------------------

def start_broker(data: Path, nofile: tuple[int, int]) -> tuple[subprocess.Popen, dict, Path]:
    log = data.parent / "broker.log"

    def limits() -> None:                       # the machine's own limit, not the bench's
        resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

    proc = subprocess.Popen([str(BIN / "gpumarket-broker"), "serve", "--listen", "127.0.0.1:0",
                             "--data-dir", str(data), "--api", "127.0.0.1:0", "--http",
                             "127.0.0.1:0", "--no-verify"],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            preexec_fn=limits)
    info = data / "broker.json"
    deadline = time.monotonic() + 60
    while not info.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("bench: the broker did not start:\n" + log.read_text())
        time.sleep(0.1)
    return proc, json.loads(info.read_text()), log


def api_connections(http: str) -> float:
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith('gpumarket_connections{listener="api"}'):
                return float(line.rsplit(" ", 1)[1])
    return -1.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")


async def other_client(info: dict, seconds: float) -> dict:
    """Signed calls from another client for ``seconds``: kept channel and new connections."""
    from gpumarket.link.channel import Trust, open_channel
    from gpumarket.proto.identity import Identity
    from gpumarket.proto.v1 import marketplace_pb2 as mp
    from gpumarket.proto.v1 import marketplace_pb2_grpc

    me = Identity.generate()
    trust = Trust(pin=info["broker_id"])
    kept = await open_channel(info["address"], me, trust)
    stub = marketplace_pb2_grpc.MarketplaceStub(kept.channel)
    await stub.ListJobs(mp.ListJobsRequest(), timeout=30)
    out = {"kept": [], "fresh": [], "kept_failed": 0, "fresh_failed": 0, "api_held": [],
           "metrics_failed": 0}
    end = time.monotonic() + seconds

    async def on_kept() -> None:
        while time.monotonic() < end:
            t = time.perf_counter()
            try:
                await stub.ListJobs(mp.ListJobsRequest(), timeout=10)
                out["kept"].append(time.perf_counter() - t)
            except Exception:       # noqa: BLE001 (a failure is a figure here)
                out["kept_failed"] += 1
            await asyncio.sleep(0.05)

    async def on_fresh() -> None:
        while time.monotonic() < end:
            t = time.perf_counter()
            try:
                opened = await asyncio.wait_for(open_channel(info["address"], me, trust), 10)
                async with opened.channel as channel:
                    await marketplace_pb2_grpc.MarketplaceStub(channel).ListJobs(
                        mp.ListJobsRequest(), timeout=10)
                out["fresh"].append(time.perf_counter() - t)
            except Exception:       # noqa: BLE001
                out["fresh_failed"] += 1
            await asyncio.sleep(0.5)

    async def sample() -> None:
        while time.monotonic() < end:
            try:
                out["api_held"].append(await asyncio.to_thread(api_connections, info["http"]))
            except OSError:             # the HTTP side did not answer: a figure too
                out["metrics_failed"] += 1
            await asyncio.sleep(1)

    await asyncio.gather(on_kept(), on_fresh(), sample())
    await kept.channel.close()
    return out


def attackers(info: dict, args, connections: int,
              sources: list[str]) -> list[subprocess.Popen]:
    """The attacker's processes: each takes its part of the connections (and of the sources,
    or all of one source), at most PER_PROCESS connections."""
    k = -(-connections // PER_PROCESS)
    parts = [sources[i::k] for i in range(k)] if len(sources) >= k else [sources] * k
    return [subprocess.Popen(
        [sys.executable, __file__, "--attacker", info["api"].rsplit(":", 1)[1],
         str(connections // k), ",".join(part), str(args.seconds + 2),
         str(args.reopen_rate / k)], stdout=subprocess.PIPE, text=True) for part in parts]


def phase(name: str, info: dict, log: Path, args, connections: int = 0,
          sources: list[str] | None = None) -> dict:
    size = log.stat().st_size
    procs = attackers(info, args, connections, sources) if sources else []
    if procs:
        time.sleep(2)                           # the first wave is in
    seen = asyncio.run(other_client(info, args.seconds))
    flood: dict = {}
    for proc in procs:
        for key, value in json.loads(proc.communicate(timeout=120)[0]).items():
            flood[key] = max(flood.get(key, 0), value) if key == "first_wave_s" \
                else flood.get(key, 0) + value
    text = log.read_text(errors="replace")[size:]
    result = {
        "kept_p50_ms": round(pct(seen["kept"], 0.5), 2),
        "kept_p99_ms": round(pct(seen["kept"], 0.99), 2),
        "kept_calls": len(seen["kept"]), "kept_failed": seen["kept_failed"],
        "new_connection_p50_ms": round(pct(seen["fresh"], 0.5), 2),
        "new_connection_p99_ms": round(pct(seen["fresh"], 0.99), 2),
        "new_connection_calls": len(seen["fresh"]), "new_connection_failed": seen["fresh_failed"],
        "api_connections_held_max": max(seen["api_held"], default=0),
        "metrics_failed": seen["metrics_failed"],
        "log_growth_bytes": log.stat().st_size - size,
        "log_tracebacks": text.count("Traceback"), "connections": connections,
        **{f"attacker_{k}": v for k, v in flood.items()}}
    print(f"{name:10} signed calls on a kept channel p50 {result['kept_p50_ms']} ms p99"
          f" {result['kept_p99_ms']} ms ({result['kept_calls']}, {result['kept_failed']}"
          f" failed); on a new connection p50 {result['new_connection_p50_ms']} ms p99"
          f" {result['new_connection_p99_ms']} ms ({result['new_connection_calls']},"
          f" {result['new_connection_failed']} failed); API connections held <="
          f" {result['api_connections_held_max']:.0f}; log +{result['log_growth_bytes']} B",
          flush=True)
    if flood:
        print(f"{'':10} attacker: {flood}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--peers", type=int, default=100)
    parser.add_argument("--many", type=int, default=0,
                        help="connections from --peers addresses [default: 1.25 x the"
                        " broker's open-file limit]")
    parser.add_argument("--reopen-rate", type=float, default=1000.0,
                        help="connections a second the attacker re-opens at most")
    parser.add_argument("--attacker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    machine = resource.getrlimit(resource.RLIMIT_NOFILE)
    if args.attacker:
        port, n, sources, seconds, rate = args.attacker
        resource.setrlimit(resource.RLIMIT_NOFILE, (machine[1], machine[1]))
        print(json.dumps(attack(int(port), int(n), sources.split(","), float(seconds),
                                float(rate))))
        return
    if machine[1] < PER_PROCESS + 512:
        raise SystemExit(f"bench: the hard open-file limit is {machine[1]}; the attacker needs"
                         f" {PER_PROCESS + 512} a process")
    peers = [f"127.0.0.{2 + i % 250}" if i < 250 else f"127.0.{1 + i // 250}.{2 + i % 250}"
             for i in range(args.peers)]
    with tempfile.TemporaryDirectory() as tmp:
        proc, info, log = start_broker(Path(tmp) / "broker", machine)
        try:
            plan = [line.split(": ", 1)[1] for line in log.read_text().splitlines()
                    if "open files:" in line]
            print(f"broker: {plan[0] if plan else 'no descriptor plan (a broker before it)'}",
                  flush=True)
            results = {"seconds": args.seconds, "reopen_rate": args.reopen_rate,
                       "peers": args.peers, "broker_open_file_limit": machine[0]}
            results["baseline"] = phase("baseline", info, log, args)
            results["one_peer"] = phase("one peer", info, log, args, args.connections,
                                        ["127.0.0.1"])
            results["many_peers"] = phase("many peers", info, log, args,
                                          args.many or machine[0] * 5 // 4, peers)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
