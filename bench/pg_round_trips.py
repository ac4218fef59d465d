"""Round trips to PostgreSQL per durable placement: bench/ha.py's in-process placements (the
real submission and placement code, the leader's fenced passes) on a throwaway cluster, with
the store writer's waits for the server counted: statements sent outside a pipeline, and in
one (broker/store/postgres.py) each sync and each fetch that had to wait for its answer.

    .venv/bin/python bench/pg_round_trips.py [--offers 1000] [--jobs 500] [--held 0]

Counted from the first submission to the last lease committed, divided by the jobs; the
figure does not depend on the machine's load (the time each round trip takes does). The last
line is one JSON object.
"""

from __future__ import annotations

import asyncio
import collections
import json
import shutil
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import ha, pg_bench  # noqa: E402
from tests import pg  # noqa: E402

COUNT: collections.Counter = collections.Counter()
COUNTING = threading.Event()


def count_waits() -> None:
    """Wrap psycopg where the writer thread waits for the server."""
    import psycopg
    from psycopg import Cursor, Pipeline

    def writer() -> bool:
        return COUNTING.is_set() and threading.current_thread().name == "store-writer"

    execute = psycopg.Connection.execute

    def counted_execute(self, query, params=None, *args, **kwargs):
        if writer() and self._pipeline is None:
            COUNT["statement"] += 1
        return execute(self, query, params, *args, **kwargs)

    sync = Pipeline.sync

    def counted_sync(self):
        if writer():
            COUNT["sync"] += 1
        return sync(self)

    fetch = Cursor._fetch_pipeline

    def counted_fetch(self):
        if writer() and self._conn._pipeline and not self.pgresult:
            COUNT["fetch"] += 1
        return fetch(self)

    psycopg.Connection.execute = counted_execute
    Pipeline.sync = counted_sync
    Cursor._fetch_pipeline = counted_fetch


async def run(offers: int, jobs: int, held: int = 0) -> None:
    from gpumarket.broker.store.store import PgStore

    root = Path(tempfile.mkdtemp(prefix="gpumarket-rt-"))
    cluster = pg.Cluster(durable=True)
    store = PgStore(cluster.database())
    store.open()
    clock = ha.time.perf_counter

    def first_submission() -> float:     # placements() reads the clock as it submits
        COUNTING.set()
        return clock()

    ha.time.perf_counter = first_submission
    try:
        await ha.placements(store, root / "p", offers, jobs, fenced=True, held=held)
    finally:
        ha.time.perf_counter = clock
        COUNTING.clear()
        store.close()
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = pg_bench.parser(__doc__, offers=1000, jobs=500)
    parser.add_argument("--held", type=int, default=0,
                        help="units each job holds (bench/ha.py --held; default 0)")
    args = pg_bench.parse(parser)
    count_waits()
    asyncio.run(run(args.offers, args.jobs, args.held))
    total = sum(COUNT.values())
    print(f"{total} round trips for {args.jobs} placements ({dict(COUNT)}):"
          f" {total / args.jobs:.2f} a placement")
    print(json.dumps({"round_trips_per_placement": round(total / args.jobs, 2),
                      **{f"round_trips_{k}": v for k, v in COUNT.items()},
                      "jobs": args.jobs, "offers": args.offers}))


if __name__ == "__main__":
    main()
