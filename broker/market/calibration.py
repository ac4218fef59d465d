"""How long a job really takes on a provider, learned from its receipts.

The matcher ranks offers by the benchmark's speed (corrected by throughput achieved on real
jobs), which says nothing of what a lease costs in wall time: starting the runner, loading the
model and data, checkpoints, uploads. A hold needs the wall time. So each lease records the
job's work at the provider's benchmark speed (``raw_s``: work / (benchmark FLOP/s x devices);
0 when the work is unknown) and each uninterrupted success adds a sample (raw_s, seconds from
start to receipt). Per provider and kind, the last ``WINDOW`` samples are fitted as

    seconds = overhead_s + slope x raw_s

(least squares where the jobs differ in size; where they are all alike, the prior's overhead
is kept and the slope set so that the fit runs through their mean). A provider without samples
borrows those of its device class (every provider of the same accelerator, for that kind), and
with none there either starts from ``PRIOR``. No grpc here.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlite_utils import Database

from gpumarket.broker.jobs.job import Job
from gpumarket.broker.market.admission import Needs
from gpumarket.proto.v1 import types_pb2 as pb

WINDOW = 20
MAX_OVERHEAD_S = 3600.0   # a fit beyond these is a provider's stalling, not a job's cost
MAX_SLOPE = 100.0
# Per device class: (overhead_s, slope). Measured here (2-core CPU, the example training job):
# about 6 s of start-up and 3x the benchmark-speed time; CUDA assumed alike until measured.
PRIOR = {pb.ACCELERATOR_CPU: (6.0, 3.0), pb.ACCELERATOR_CUDA: (20.0, 3.0)}
CLASS_NAMES = {pb.ACCELERATOR_CPU: "CPU", pb.ACCELERATOR_CUDA: "CUDA"}


@dataclass(frozen=True)
class Model:
    overhead_s: float
    slope: float
    samples: int
    basis: str

    def seconds(self, raw_s: float) -> float:
        return (min(self.overhead_s, MAX_OVERHEAD_S)
                + min(self.slope, MAX_SLOPE) * max(raw_s, 0.0))


def prior(accelerator: int) -> Model:
    overhead, slope = PRIOR.get(accelerator, PRIOR[pb.ACCELERATOR_CUDA])
    return Model(overhead, slope, 0,
                 f"the {CLASS_NAMES.get(accelerator, 'CUDA')} prior (no receipts yet)")


def fit(samples: list[tuple[float, float]], base: Model, basis: str) -> Model:
    """Fit (raw_s, seconds) samples; ``base`` gives the overhead where sizes do not vary."""
    if not samples:
        return base
    n = len(samples)
    mx = sum(x for x, _ in samples) / n
    my = sum(y for _, y in samples) / n
    var = sum((x - mx) ** 2 for x, _ in samples)
    if n >= 3 and mx > 0 and var > (0.2 * mx) ** 2 * n:
        slope = sum((x - mx) * (y - my) for x, y in samples) / var
        overhead = my - slope * mx
        if slope > 0 and overhead >= 0:
            return Model(overhead, slope, n, basis)
    overhead = min(base.overhead_s, my)
    slope = (my - overhead) / mx if mx > 0 else base.slope
    return Model(overhead, slope, n, basis)


def _samples(db: Database, where: str, args: list) -> list[tuple[float, float]]:
    return [(r[0], r[1]) for r in db.execute(
        f"SELECT raw_s, seconds FROM runtime_samples WHERE {where} ORDER BY id DESC LIMIT ?",
        [*args, WINDOW]).fetchall()]


def models(db: Database, providers: dict[str, int], kind: int) -> dict[str, Model]:
    """The calibrated model of each provider (id -> its device class) for jobs of ``kind``."""
    classes: dict[int, Model] = {}
    out = {}
    for pid, accel in providers.items():
        if accel not in classes:
            found = _samples(db, "accelerator = ? AND kind = ?", [accel, kind])
            name = CLASS_NAMES.get(accel, "CUDA")
            classes[accel] = fit(found, prior(accel),
                                 f"{len(found)} receipts of {name} providers")
        own = _samples(db, "provider_id = ? AND kind = ?", [pid, kind])
        out[pid] = fit(own, classes[accel], f"{len(own)} receipts of its own") if own \
            else classes[accel]
    return out


def record(db: Database, job: Job, lease: dict, now: int) -> None:
    """A lease succeeded: keep its (raw_s, wall seconds) if it ran the job whole, uninterrupted."""
    if lease["start_step"] or lease["started_at_ms"] is None or not lease["accelerator"]:
        return
    db["runtime_samples"].insert({
        "provider_id": lease["provider_id"], "kind": job.kind,
        "accelerator": lease["accelerator"], "raw_s": lease["raw_runtime_s"],
        "seconds": (now - lease["started_at_ms"]) / 1000, "at_ms": now})


def record_throughput(db: Database, job: Job, provider_id: str, receipt: pb.Receipt,
                       now: int) -> None:
    """Keep the speed this provider achieved on a whole job (FLOP/s per device), so the
    matcher can prefer it over the benchmark's claim. Only uninterrupted attempts count."""
    seconds = receipt.metrics.get("train_seconds", 0.0)
    needs = Needs.from_json(job.needs)
    if needs.work_flops <= 0 or seconds <= 0 or receipt.metrics.get("resumed_from_step", 0):
        return
    achieved = needs.work_flops / seconds / max(1, needs.gpus)
    row = db.execute("SELECT flops_per_device, samples FROM throughput WHERE provider_id = ?"
                     " AND kind = ?", [provider_id, job.kind]).fetchone()
    if row is None:
        db["throughput"].insert({"provider_id": provider_id, "kind": job.kind,
                                 "flops_per_device": achieved, "samples": 1, "updated_ms": now})
    else:
        value = 0.7 * row[0] + 0.3 * achieved
        db.execute("UPDATE throughput SET flops_per_device = ?, samples = ?, updated_ms = ?"
                   " WHERE provider_id = ? AND kind = ?",
                   [value, row[1] + 1, now, provider_id, job.kind])
