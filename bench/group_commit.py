"""Group commit (broker/store/store.py): the broker's single SQLite writer with synchronous=FULL,
under many concurrent writers (heartbeats, signed calls' nonces, handshakes all write), with
writes committed one transaction each (MAX_GROUP = 1, the old writer) and grouped (the
default), in the same run, on the same disk.

    .venv/bin/python bench/group_commit.py [--writers 200] [--writes 20]

Each writer awaits its writes one after another, as a provider's heartbeats or a client's
calls do; a write is a heartbeat-like UPDATE plus a nonce INSERT. Prints writes/s and write
latency p50/p99 for each; the last line is one JSON object with the figures and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpumarket.broker.store import store as store_module


def setup(db, writers: int) -> None:
    db.execute("CREATE TABLE beats (id INTEGER PRIMARY KEY, at INTEGER)")
    db.execute("CREATE TABLE seen (signer TEXT, nonce BLOB, PRIMARY KEY (signer, nonce))")
    db.conn.executemany("INSERT INTO beats (id, at) VALUES (?, 0)", [(i,) for i in range(writers)])


def beat(db, writer: int, at: int) -> None:
    db.execute("UPDATE beats SET at = ? WHERE id = ?", [at, writer])
    db.execute("INSERT INTO seen (signer, nonce) VALUES (?, ?)", [str(writer), os.urandom(16)])


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def run(path: Path, writers: int, writes: int) -> dict:
    store = store_module.Store(path)
    store.open()
    await store.write(setup, writers)
    latencies: list[float] = []

    async def writer(i: int) -> None:
        for n in range(writes):
            began = time.perf_counter()
            await store.write(beat, i, n)
            latencies.append(time.perf_counter() - began)

    began = time.perf_counter()
    groups = store.groups
    await asyncio.gather(*(writer(i) for i in range(writers)))
    wall = time.perf_counter() - began
    commits = store.groups - groups
    store.close()
    return {"writes_per_s": writers * writes / wall, "p50_ms": pct(latencies, 0.5) * 1000,
            "p99_ms": pct(latencies, 0.99) * 1000, "commits": commits,
            "writes": writers * writes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writers", type=int, default=200)
    parser.add_argument("--writes", type=int, default=20)
    args = parser.parse_args()
    out = {}
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent.parent) as tmp:
        for name, group in (("one_per_commit", 1), ("grouped", store_module.MAX_GROUP)):
            saved, store_module.MAX_GROUP = store_module.MAX_GROUP, group
            try:
                out[name] = asyncio.run(run(Path(tmp) / f"{name}.db", args.writers,
                                            args.writes))
            finally:
                store_module.MAX_GROUP = saved
            f = out[name]
            print(f"{name}: {f['writes_per_s']:,.0f} writes/s, p50 {f['p50_ms']:.1f} ms,"
                  f" p99 {f['p99_ms']:.1f} ms, {f['writes']} writes in {f['commits']} commits",
                  flush=True)
    ratio = out["grouped"]["writes_per_s"] / out["one_per_commit"]["writes_per_s"]
    print(f"grouped / one per commit: {ratio:.1f}x the writes a second")
    print(json.dumps({"writers": args.writers, "writes_per_writer": args.writes,
                      "one_per_commit": out["one_per_commit"], "grouped": out["grouped"],
                      "throughput_ratio": round(ratio, 2)}))


if __name__ == "__main__":
    main()
