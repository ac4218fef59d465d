"""Ledger benchmark: what settlement costs the broker's single writer, and how good the
calibrated runtime estimates under the holds are.

    .venv/bin/python bench/ledger.py [--checkpoints 400] [--jobs 8]

1. postings_per_s: credit postings, each its own transaction through Store.write (the one
   writer thread, WAL, synchronous=FULL), as the broker commits them.
2. settle_overhead_ratio: the median latency of a checkpoint's transaction (jobs.
   record_checkpoint through Store.write) with its settlement, over the same without it
   (ledger.settle replaced by a no-op), interleaved in the same run. Target <= 1.2.
   checkpoint_overhead_ratio: the same for the whole checkpoint as the broker's writer sees
   it: the upload of the checkpoint blob finishing (blob_holdings.record, its own transaction)
   and then the report (record_checkpoint).
3. quote_error_median: a real local marketplace (broker, one provider, real processes); the
   example training job (examples/data tiny-llama, steps cycling 60/120/240) is quoted with
   `gpumarket quote` before each submission, then run; error = |estimated / actual - 1| with
   actual the lease's wall time (start to receipt). The median over the jobs after the first
   three (once the provider has run a few of the kind). Target <= 0.5. The first job's error
   (quoted from the prior alone) is reported too.

Prints per-job lines, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs.job import LeaseTerms
from gpumarket.broker.market.admission import Needs, NewJob  # noqa: E402
from gpumarket.broker.money import ledger
from gpumarket.broker.server import install_reactions  # noqa: E402
from gpumarket.broker.store import blob_holdings
from gpumarket.broker.store.store import Store  # noqa: E402
from gpumarket.proto.v1 import types_pb2 as pb  # noqa: E402
from tests.helpers import Marketplace, training_job  # noqa: E402

SIZES = (60, 120, 240)


def _job(job_id: str) -> NewJob:
    needs = Needs(kind=pb.JOB_KIND_TRAINING, gpus=1, min_memory_bytes=0,
                  accelerator=pb.ACCELERATOR_UNSPECIFIED, max_price_per_gpu_hour=2.0)
    return NewJob(id=job_id, client_id="c", name=job_id, spec=pb.Envelope().SerializeToString(),
                  spec_sha256="0" * 64, needs=needs, expires_at_ms=10**13, max_attempts=5,
                  nonce=job_id.encode().hex(), hold=10**12, hold_basis="bench", fee_ppm=50_000,
                  enforce_funds=True)


async def store_figures(n: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="gpumarket-ledger-"))
    store = Store(root / "broker.db")
    store.open()
    try:
        t0 = time.perf_counter()
        for i in range(n):
            await store.write(ledger.credit, "c", 1, "client", "", "bench", f"k{i}", i)
        postings_per_s = n / (time.perf_counter() - t0)

        await store.write(ledger.credit, "c", 10**13, "client", "", "bench", "big", 0)
        sign = lambda lease: pb.Envelope(payload=lease.SerializeToString())  # noqa: E731
        for job_id in ("with", "without"):
            await store.write(jobs.submit, _job(job_id), 1)
            await store.write(jobs.create_lease, LeaseTerms(job_id, "p", (0,),
                              1.5, 60_000, 1), 2, sign)
            await store.write(jobs.mark_started, job_id, 1, "p", 3)
        real_settle = ledger.settle
        idle = ledger.Settlement(0, 0, 10**12)
        times: dict[str, list[float]] = {"with": [], "without": []}
        whole: dict[str, list[float]] = {"with": [], "without": []}
        for step in range(1, n + 1):
            for job_id in ("with", "without") if step % 2 else ("without", "with"):
                sha = f"{job_id}{step:010d}".ljust(64, "0")[:64]
                t0 = time.perf_counter()
                await store.write(blob_holdings.record, sha, 10, "p", step)
                ref = pb.ArtifactRef(name="ckpt.tar", sha256=sha, size_bytes=10)
                ledger.settle = real_settle if job_id == "with" else (lambda *a, **k: idle)
                try:
                    t = time.perf_counter()
                    await store.write(jobs.record_checkpoint, job_id, 1, "p", step, ref, 0.1,
                                      1_000 * step)
                    end = time.perf_counter()
                    times[job_id].append(end - t)
                    whole[job_id].append(end - t0)
                finally:
                    ledger.settle = real_settle
        problems = await store.read(ledger.audit)
        settles = await store.read(lambda db: db.execute(
            "SELECT count(*) FROM ledger_postings WHERE type = 'settle'").fetchone()[0])
    finally:
        store.close()
    with_ms = statistics.median(times["with"]) * 1000
    without_ms = statistics.median(times["without"]) * 1000
    whole_with = statistics.median(whole["with"]) * 1000
    whole_without = statistics.median(whole["without"]) * 1000
    print(f"single writer: {postings_per_s:,.0f} postings/s; checkpoint transaction p50"
          f" {with_ms:.3f} ms with settlement, {without_ms:.3f} ms without; upload record and"
          f" report p50 {whole_with:.3f} ms with, {whole_without:.3f} ms without"
          f" ({settles} settlements, audit {'ok' if not problems else problems})")
    return {"postings_per_s": round(postings_per_s, 1),
            "checkpoint_ms_with_settlement": round(with_ms, 3),
            "checkpoint_ms_without": round(without_ms, 3),
            "settle_overhead_ratio": round(with_ms / without_ms, 3),
            "checkpoint_overhead_ratio": round(whole_with / whole_without, 3)}


def quote_errors(n: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="gpumarket-quotes-"))
    market = Marketplace(root)
    rows = []
    try:
        market.start_broker()
        market.start_provider("p1", 1.0)
        market.wait_for_offers(1)
        for i in range(n):
            steps = SIZES[i % len(SIZES)]
            path = training_job(root / f"job{i}.toml", steps=steps, checkpoint_every=40)
            q = market.cli("quote", str(path), "--json")
            if q.returncode != 0:
                raise SystemExit(f"quote failed: {q.stderr}")
            best = json.loads(q.stdout)["candidates"][0]
            r = market.cli("submit", str(path))
            if r.returncode != 0:
                raise SystemExit(f"submit failed: {r.stderr}")
            job = market.wait_state(r.stdout.split()[0], "SUCCEEDED", "FAILED", timeout=600)
            if job["state"] != "SUCCEEDED":
                raise SystemExit(f"job failed: {job.get('error')}")
            (attempt,) = job["attempts"]
            actual = (int(attempt["ended_at_ms"]) - int(attempt["started_at_ms"])) / 1000
            est = best["estimated_s"]
            rows.append((steps, est, actual, abs(est / actual - 1)))
            print(f"job {i + 1}: {steps} steps, quoted {est:.1f}s ({best['estimate_basis']}),"
                  f" ran {actual:.1f}s, error {rows[-1][3]:.2f}")
    finally:
        market.close()
    later = [r[3] for r in rows[3:]] or [rows[-1][3]]
    return {"quote_error_first": round(rows[0][3], 3),
            "quote_error_median": round(statistics.median(later), 3),
            "quote_jobs": n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=int, default=400)
    ap.add_argument("--jobs", type=int, default=8)
    args = ap.parse_args()
    install_reactions()     # as the broker does when it starts
    figures = asyncio.run(store_figures(args.checkpoints))
    if args.jobs:
        figures.update(quote_errors(args.jobs))
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
