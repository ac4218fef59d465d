"""The broker's store on SQLite and on PostgreSQL (broker/store/postgres.py), in the same run
on the same disk: durable money writes a second through the store's one writer (group
commit), under many concurrent writers.

    .venv/bin/python bench/pg_store.py [--writers 100] [--writes 20]

A write is an operator's credit (broker/money/ledger.py credit: a posting, its entries, the
account rows; one transaction, each acknowledged only once committed). SQLite runs with the
broker's synchronous=FULL; PostgreSQL is a throwaway cluster (tests/pg.py) with fsync and
synchronous_commit on, over a unix socket. Prints writes/s and latency p50/p99 for each and
the ledger's audit; the last line is one JSON object with the figures.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpumarket.broker.money import ledger
from gpumarket.broker.store.store import PgStore, Store
from bench import pg_bench
from tests import pg


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(store: Store, writers: int, writes: int) -> dict:
    latencies: list[float] = []

    async def writer(w: int) -> None:
        for n in range(writes):
            t = time.perf_counter()
            await store.write(ledger.credit, f"c{w}", 1_000, "client", "", "op", f"k{w}-{n}",
                              n)
            latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(writer(w) for w in range(writers)))
    elapsed = time.perf_counter() - t0
    problems = await store.read(ledger.audit)
    return {"writes_per_s": round(writers * writes / elapsed, 1),
            "p50_ms": round(pct(latencies, 0.5) * 1000, 2),
            "p99_ms": round(pct(latencies, 0.99) * 1000, 2),
            "writes_per_commit": round(store.grouped / max(store.groups, 1), 1),
            "audit_problems": len(problems)}


def main() -> None:
    parser = pg_bench.parser(__doc__)
    parser.add_argument("--writers", type=int, default=100)
    parser.add_argument("--writes", type=int, default=20)
    args = pg_bench.parse(parser)
    out = {"writers": args.writers, "writes": args.writes}
    cluster = pg.Cluster(durable=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, store in (("sqlite", Store(Path(tmp) / "broker.db")),
                                ("postgresql", PgStore(cluster.database()))):
                store.open()
                try:
                    out[name] = asyncio.run(run(store, args.writers, args.writes))
                finally:
                    store.close()
                print(f"{name:10s} {out[name]['writes_per_s']:>9,.1f} writes/s"
                      f"  p50 {out[name]['p50_ms']} ms  p99 {out[name]['p99_ms']} ms"
                      f"  {out[name]['writes_per_commit']} writes/commit"
                      f"  audit problems {out[name]['audit_problems']}")
    finally:
        cluster.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
