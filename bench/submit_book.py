"""What sizing a submission's hold costs against 10,000 live offers (issue 36): the hold
(jobs/submit.hold: the cheapest offers that fit, timed) with the offer book built for each
submission, as every Submit RPC did before, against the Book the submissions share
(scheduler.recent_book: the last one built, while under a second old and its offers the
same). In process, over a real SQLite store, the offers' Templates made before the clock
starts (a broker has made them long before a burst of submissions).

    .venv/bin/python bench/submit_book.py [--offers 10000] [--holds 40] [--shared-holds 3000]

The shared Book's holds run for several seconds, so that its figure counts the Book built
again each second.

Prints each way's milliseconds a hold and holds a second, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import pg_bench  # noqa: E402
from gpumarket.broker.jobs import submit  # noqa: E402
from gpumarket.broker.market import scheduler  # noqa: E402
from gpumarket.broker.market.admission import Needs  # noqa: E402
from gpumarket.broker.state import BrokerState  # noqa: E402
from gpumarket.broker.store.store import Store  # noqa: E402
from gpumarket.proto.v1 import types_pb2 as pb  # noqa: E402


async def holds(state: BrokerState, count: int, fresh: bool) -> float:
    """Seconds for ``count`` holds in a row; ``fresh``: a Book built for each."""
    needs = Needs(kind=pb.JOB_KIND_TRAINING, gpus=1, min_memory_bytes=0,
                  accelerator=pb.ACCELERATOR_UNSPECIFIED, max_price_per_gpu_hour=10.0)
    began = time.perf_counter()
    for _ in range(count):
        book = await scheduler.offer_book(state) if fresh else None
        await submit.hold(state, needs, "client", 1, 0.0, book)
    return time.perf_counter() - began


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--offers", type=int, default=10_000)
    parser.add_argument("--holds", type=int, default=40, help="holds with a Book each")
    parser.add_argument("--shared-holds", type=int, default=3000,
                        help="holds sharing the recent Book")
    args = parser.parse_args()
    out = {"offers": args.offers, "holds": args.holds, "shared_holds": args.shared_holds}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = Store(root / "book.db")
        store.open()
        try:
            state = await pg_bench.simulated_market(root, store, args.offers)
            for name, fresh in (("fresh_book", True), ("recent_book", False),
                                ("fresh_book_again", True)):
                count = args.holds if fresh else args.shared_holds
                s = await holds(state, count, fresh)
                ms = s * 1000 / count
                out[f"ms_per_hold_{name}"] = round(ms, 2)
                print(f"{name}: {ms:.2f} ms a hold, {count / s:.0f} holds/s over {s:.1f} s"
                      f" ({count} holds, {args.offers} offers)", flush=True)
        finally:
            store.close()
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
