"""What the PostgreSQL benchmarks (bench/ha.py, bench/pg_round_trips.py, bench/pg_store.py)
share: the opening of their command line, the check that PostgreSQL is here (one line and
exit 1 where it is not), the CPU a throwaway cluster's server used (what a figure of
this 2-core machine's placements costs the server beside the broker's process), and a
broker's state with thousands of simulated providers connected (bench/submit_book.py too).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import pg  # noqa: E402


def parser(doc: str, offers: int | None = None, jobs: int | None = None
           ) -> argparse.ArgumentParser:
    """A benchmark's parser, described by its docstring's first paragraph; with ``--offers``
    (simulated providers' offers) and ``--jobs`` (jobs submitted at once) where given
    defaults."""
    out = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if offers is not None:
        out.add_argument("--offers", type=int, default=offers,
                         help="simulated providers' offers (default %(default)s)")
    if jobs is not None:
        out.add_argument("--jobs", type=int, default=jobs,
                         help="jobs submitted at once (default %(default)s)")
    return out


def parse(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The arguments; exits with one line where PostgreSQL or psycopg is missing."""
    args = parser.parse_args()
    why = pg.missing()
    if why:
        raise SystemExit(f"error: {why}")
    return args


def server_cpu_s(cluster: pg.Cluster) -> float:
    """CPU seconds (user + system) the cluster's postmaster and its live children have used
    so far, from /proc (0.0 where it cannot be read)."""
    try:
        postmaster = int((cluster.data / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    ticks = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            # Fields after the command's closing parenthesis: state, ppid, ..., utime, stime.
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry.name) == postmaster or int(fields[1]) == postmaster:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


async def simulated_market(root: Path, store, offers: int):
    """A broker's state over ``store`` with ``offers`` providers connected, each offering one
    CPU device for training (signed offers, stored and open in sessions whose outboxes nobody
    reads), and its offers' Templates made, as a live broker made them long before."""
    import asyncio

    from gpumarket.broker.config import BrokerConfig
    from gpumarket.broker.market import providers, scheduler
    from gpumarket.broker.state import BrokerState
    from gpumarket.broker.store.artifact_store import ArtifactStore
    from gpumarket.proto.envelope import open_envelope
    from gpumarket.proto.identity import Identity
    from gpumarket.proto.jobspec import now_ms
    from gpumarket.proto.v1 import types_pb2 as pb
    from tests.helpers import signed_offer

    state = BrokerState(BrokerConfig(data_dir=root, billing=False), Identity.generate(), store,
                        ArtifactStore(root / "artifacts", 1 << 20))
    made = [(k, signed_offer(k, kinds=(pb.JOB_KIND_TRAINING,)))
            for k in (Identity.generate() for _ in range(offers))]

    def connect_all(db) -> None:
        for key, env in made:
            parsed = pb.Offer.FromString(env.payload)
            providers.online(db, key.id, key.public_key, now_ms())
            providers.store_offer(db, key.id, env.SerializeToString(), parsed, now_ms())

    await store.write(connect_all)
    for key, env in made:
        session = state.sessions.open(key.id)
        session.offer, session.offer_envelope = open_envelope(env, pb.Offer)[0], env
        session.outbox = asyncio.Queue()        # unbounded: nobody reads it here
    await scheduler.offer_book(state)           # the Templates, made at the first pass
    return state
