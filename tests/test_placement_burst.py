"""A burst of submissions larger than a pass reads (placement.QUEUE_SCAN): the pass that read
its most and leased some wakes the placement loop again at once, with no submission to come
(issue 36: bench/ha.py's third pass waited a schedule interval, 1 s of 3); a pass that read
the whole queue does not."""

from __future__ import annotations

import asyncio

from bench import pg_bench
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.market import placement, scheduler
from gpumarket.broker.market.admission import Needs, NewJob
from gpumarket.broker.store.store import Store
from gpumarket.proto.envelope import seal
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import types_pb2 as pb


def test_a_pass_that_read_its_most_wakes_the_next_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(placement, "QUEUE_SCAN", 3)
    store = Store(tmp_path / "broker.db")
    store.open()
    try:
        woken = asyncio.run(passes(tmp_path, store, jobs_submitted=7))
    finally:
        store.close()
    # 3, 3 and 1 leased: the first two read three each (woken), the last the rest (not).
    assert woken == [(3, True), (3, True), (1, False)]


async def passes(root, store, jobs_submitted: int) -> list[tuple[int, bool]]:
    """Submit ``jobs_submitted`` jobs, then run passes until one leases nothing; return each
    leasing pass's (leases, whether it woke the loop)."""
    state = await pg_bench.simulated_market(root, store, 10)
    client = Identity.generate()
    spec = seal(client, pb.JobSpec(name="p", kind=pb.JOB_KIND_TRAINING)).SerializeToString()
    needs = Needs(kind=pb.JOB_KIND_TRAINING, gpus=1, min_memory_bytes=0,
                  accelerator=pb.ACCELERATOR_UNSPECIFIED, max_price_per_gpu_hour=10.0)
    for i in range(jobs_submitted):
        await store.write(jobs.submit, NewJob(
            id=f"job{i}", client_id=client.id, name="p", spec=spec, spec_sha256="0" * 64,
            needs=needs, expires_at_ms=now_ms() + 3_600_000, max_attempts=3,
            nonce=f"{i:032x}"), now_ms())
    out = []
    while True:
        seen = state.placement.seen()
        made = await scheduler.place_queued(state)
        if not made:
            return out
        out.append((made, state.placement.seen() != seen))
