"""What security costs per call: the same broker process answers, in one run,

- anonymous `SearchOffers` calls (no token: the baseline),
- authenticated `ListJobs` calls (a signed call token per call: signature, checks, and the
  nonce written to SQLite),

first over TLS, then against a second broker started with --plaintext, each call waited for
before the next (latency, not throughput), with the rate limit off. The two methods do
different (small) work on an empty broker, so the token's own cost is also timed in-process:
`Authenticator.verify` on fresh tokens against a real SQLite store (signature check, the
checks, and the nonce written with synchronous=FULL).

    .venv/bin/python bench/calls.py [--calls 2000]

Prints the per-call times (mean, p50, p99) and the ratios token/anonymous and TLS/plaintext;
the last line is one JSON object of those figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BIN = Path(sys.executable).parent


def start_broker(data: Path, *extra: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([str(BIN / "gpumarket-broker"), "serve", "--listen", "127.0.0.1:0",
                             "--data-dir", str(data), "--rate-limit", "0", "--log-level",
                             "warning", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    info = data / "broker.json"
    deadline = time.monotonic() + 60
    while not info.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("bench: the broker did not start")
        time.sleep(0.1)
    return proc, json.loads(info.read_text())


async def timed(n: int, call) -> list[float]:
    for _ in range(min(50, n)):      # warm-up: connection, TLS handshake, caches
        await call()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await call()
        out.append(time.perf_counter() - t)
    return out


def summary(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"mean_ms": statistics.fmean(xs) * 1e3, "p50_ms": xs[len(xs) // 2] * 1e3,
            "p99_ms": xs[int(len(xs) * 0.99)] * 1e3}


async def measure(address: str, broker_id: str, calls: int) -> dict:
    from gpumarket.link.channel import Trust, open_channel
    from gpumarket.proto.identity import Identity
    from gpumarket.proto.v1 import marketplace_pb2 as mp
    from gpumarket.proto.v1 import marketplace_pb2_grpc

    me = Identity.generate()
    signed = await open_channel(address, me, Trust(pin=broker_id))
    anonymous = await open_channel(address, None, Trust(pin=broker_id))
    stub_signed = marketplace_pb2_grpc.MarketplaceStub(signed.channel)
    stub_anon = marketplace_pb2_grpc.MarketplaceStub(anonymous.channel)
    try:
        anon = await timed(calls, lambda: stub_anon.SearchOffers(mp.SearchOffersRequest(),
                                                                 timeout=30))
        token = await timed(calls, lambda: stub_signed.ListJobs(mp.ListJobsRequest(),
                                                                timeout=30))
    finally:
        await signed.channel.close()
        await anonymous.channel.close()
    return {"anonymous": summary(anon), "token": summary(token)}


async def verify_cost(tmp: Path, n: int) -> float:
    """Seconds per Authenticator.verify of a fresh token (in-process, real Store)."""
    import hashlib
    from types import SimpleNamespace

    from gpumarket.broker.api.auth import Authenticator
    from gpumarket.broker.config import BrokerConfig
    from gpumarket.broker.metrics import BrokerMetrics
    from gpumarket.broker.store.store import Store
    from gpumarket.link.channel import call_token
    from gpumarket.proto.identity import Identity

    store = Store(tmp / "verify.db")
    store.open()
    state = SimpleNamespace(config=BrokerConfig(data_dir=tmp, rate_limit_per_s=0), revoked=set(),
                            store=store, metrics=BrokerMetrics())
    auth = Authenticator(state, "broker", plaintext=False)
    me, method, body = Identity.generate(), "/gpumarket.v1.Marketplace/GetJob", b"\n\x02j1"
    tokens = [call_token(me, method, "broker", body) for _ in range(n)]
    digest = hashlib.sha256(body).digest()
    try:
        t = time.perf_counter()
        for raw in tokens:
            await auth.verify(method, raw, digest)
        return (time.perf_counter() - t) / n
    finally:
        store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    figures = {}
    with tempfile.TemporaryDirectory(prefix="gpumarket-bench-calls-") as tmp:
        for name, extra in (("tls", ()), ("plaintext", ("--plaintext",))):
            proc, info = start_broker(Path(tmp) / name, *extra)
            try:
                figures[name] = asyncio.run(measure(info["address"], info["broker_id"],
                                                    args.calls))
            finally:
                proc.terminate()
                proc.wait(30)
            for kind in ("anonymous", "token"):
                f = figures[name][kind]
                print(f"{name:9} {kind:9} mean {f['mean_ms']:.2f} ms  p50 {f['p50_ms']:.2f} ms"
                      f"  p99 {f['p99_ms']:.2f} ms  ({args.calls} calls)")
        per_token = asyncio.run(verify_cost(Path(tmp), args.calls))
    print(f"verify one call token in-process: {per_token * 1e3:.3f} ms")
    result = {
        "calls": args.calls,
        "verify_token_ms": round(per_token * 1e3, 3),
        **{f"{n}_{k}_{s}": round(figures[n][k][s], 3) for n in figures
           for k in ("anonymous", "token") for s in ("mean_ms", "p50_ms", "p99_ms")},
        "ratio_token_over_anonymous_tls": round(
            figures["tls"]["token"]["mean_ms"] / figures["tls"]["anonymous"]["mean_ms"], 3),
        "ratio_tls_over_plaintext_token": round(
            figures["tls"]["token"]["mean_ms"] / figures["plaintext"]["token"]["mean_ms"], 3),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
