"""Tiers over a simulated week (issue 35): the broker's real scheduler (placement passes,
deadline promotion, the preemption pass, lease expiry), its real store (a temporary SQLite
file) and its real ledger, driven in-process on a simulated clock by simulated providers.

What is simulated, and what each assumption is:

- **Providers** (``--providers``, 1-8 GPUs each, H100 to RTX 3090 at typical prices) come
  and go: online for an exponential while (mean 36 h; a fifth of them flaky, 6 h), offline
  for a mean of 4 h. A departure is abrupt: its leases are lost when they miss heartbeats
  (the lease timeout), and their work since the last checkpoint with them. Most providers
  sell interruptible at the default 40 % of their price; a quarter set their own share
  (30-60 %). Upload bandwidth to the broker: 2 Gb/s for most, 300 Mb/s for home rigs.
- **Demand**: on-demand (standard) training jobs (about 35 % of the devices), interruptible
  training jobs (about 45 %; 60 % of them give a deadline of 1.6-6x their expected run),
  and two endpoints whose replicas (serving tier) follow a base load with spikes (about two
  a day each: +4 to +12 replicas for 15-90 minutes, added one every 15 s as an autoscaler
  would, removed one a minute after).
- **A job runs** as the provider's runner would: a lease, a start-up (inputs, model), steps
  at the provider's speed, a checkpoint each interval the lease names (written, then
  uploaded; the broker records and settles it when the upload is done), a receipt at the end.
  Asked to yield (PreemptLease), it finishes its step, writes a checkpoint, exits, and its
  provider uploads it and releases the lease; a job that ignores the request
  (``--ignore-share``, a script that never asks ``task.checkpoint_due``) is stopped when the
  grace period is over and resumes from its last periodic checkpoint. Checkpoints are
  lognormal around 1.5 GB (0.1-30 GB), written at 1.5 GB/s.
- **The broker's side** is the real code: ``scheduler.place_queued`` (tier order,
  ``deadlines.promote_due``, ``preemption.preempt_for_waiting``), ``scheduler.expire``
  (heartbeats, lost leases, ``preemption.end_overdue``), and the domain calls a provider's
  updates reach (``jobs.mark_started``, ``record_progress``, ``record_checkpoint``,
  ``preemption.release``, ``jobs.succeed``; ``endpoints.add_replica``, ``retire``,
  ``mark_ready``, ``settle_running``). A pass runs after every change and every 60 s while
  jobs wait (the real loop: every 1 s). Spot checks are off (their own benchmark). The
  broker keeps a serving reserve of ``--serving-reserve`` devices (12, the largest spike;
  config serving_reserve, docs/tiers.md): standard jobs leave that many free or
  interruptible.
- **Cold start** of a serving replica (``--cold-start``, 40 s): an 8B model in bf16 (16 GB)
  read from the provider's cache at about 2 GB/s, plus an engine's start-up (CUDA graphs,
  KV cache sizing) of about half a minute. A replica's wait is queued to leased, read from
  the job events; the target is that wait's p99 during spikes <= cold start + 5 s.

    .venv/bin/python bench/tiers.py [--days 7] [--providers 20] [--seed 1] [--quick]
                                    [--serving-reserve 12]

Prints its figures; the last line is one JSON object: interruptible_cost_ratio,
deadlines_met, lost_intervals_per_preemption, serving_wait_p99_s, the counts and
ledger_audit_ok, and colocated_ttft_p99_ratio: not simulated, measured with real processes
by bench/colocated.py (an endpoint replica on one slice of this host's CPU, alone and beside
a training job on the other slice; ``--no-colocated`` and ``--quick`` leave it out).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import logging
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpumarket import kinds
from gpumarket.broker.config import BrokerConfig
from gpumarket.broker.jobs import preemption as preempt_rows
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.market import providers, scheduler
from gpumarket.broker.market.admission import Needs, NewJob
from gpumarket.broker.money import ledger
from gpumarket.broker.serving import endpoints
from gpumarket.broker.server import install_reactions
from gpumarket.broker.state import BrokerState
from gpumarket.broker.store import blob_holdings
from gpumarket.broker.store.artifact_store import ArtifactStore
from gpumarket.broker.store.store import Store
from gpumarket.proto import jobspec
from gpumarket.proto.envelope import seal
from gpumarket.proto.errors import GpumarketError
from gpumarket.proto.identity import Identity
from gpumarket.proto.v1 import types_pb2 as pb

HOUR_MS = 3_600_000
GB = 1e9
# name, GiB, dense bf16 TFLOP/s, standard price per GPU-hour, share of providers
GPUS = [("NVIDIA H100 80GB HBM3", 80, 990, 2.4, 0.2), ("NVIDIA A100-SXM4-80GB", 80, 312, 1.5, 0.2),
        ("NVIDIA L40S", 48, 362, 0.9, 0.2), ("NVIDIA GeForce RTX 4090", 24, 165, 0.4, 0.25),
        ("NVIDIA GeForce RTX 3090", 24, 71, 0.22, 0.15)]
REF_TFLOPS = 312           # a job's size is given in hours on an A100
TRUE_SLOPE = 2.5           # wall compute = 2.5 x work / benchmark FLOP/s (40 % of the matmul peak)
WRITE_BPS = 1.5 * GB       # checkpoint write to local disk
PASS_EVERY_MS = 60_000     # placement passes while jobs wait (the real loop: every 1 s)
SETTLE_EVERY_MS = 300_000  # replicas paid for their time (settle_running)
MAX_PRICE = 5.0


class Clock:
    """The simulated clock every broker module reads (their ``now_ms``)."""

    def __init__(self, start_ms: int) -> None:
        self.ms = start_ms

    def now_ms(self) -> int:
        return self.ms


def use_clock(clock: Clock) -> None:
    """Point every loaded gpumarket module's ``now_ms`` at the simulated clock."""
    real = jobspec.now_ms
    for name, module in list(sys.modules.items()):
        if name.startswith("gpumarket") and getattr(module, "now_ms", None) is real:
            module.now_ms = clock.now_ms


@dataclass
class SimJob:
    id: str
    client: str
    tier: str                      # as submitted: standard, interruptible, serving
    gpus: int
    steps: int
    ref_step_s: float              # seconds a step takes on the reference device
    ckpt_bytes: float
    start_s: float                 # a lease's start-up before its first step
    deadline_s: int = 0
    honours: bool = True           # checkpoints when asked to yield
    created_ms: int = 0
    endpoint: str = ""             # a replica's endpoint


@dataclass
class Run:
    """One lease of a job on a simulated provider."""

    job: SimJob
    epoch: int
    devices: tuple[int, ...]
    interval_s: float
    step_s: float
    start_step: int
    leased_ms: int
    alive: bool = True
    started: bool = False
    step_at: int = 0               # steps done when compute (re)started at compute_ms
    compute_ms: int = 0
    computing: bool = False
    committed: int = 0             # the newest checkpoint the broker recorded for this lease
    settled_ms: int = 0            # when that checkpoint was recorded
    preempted_ms: int = 0
    stop_step: int = -1

    def step_now(self, now: int) -> int:
        if not self.computing:
            return self.step_at
        return min(self.job.steps, self.step_at + int((now - self.compute_ms) / 1000
                                                       / self.step_s))


@dataclass
class SimProvider:
    identity: Identity
    name: str
    gpus: int
    tflops: float
    price: float
    share: float                   # interruptible price / price
    upload_bps: float
    speed: float                   # its own efficiency (x the class's)
    flaky: bool
    online: bool = False
    runs: dict[tuple[str, int], Run] = field(default_factory=dict)
    session: object = None

    @property
    def id(self) -> str:
        return self.identity.id


class Sim:
    def __init__(self, args, root: Path) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.clock = Clock(1_800_000_000_000)
        self.t0 = self.clock.ms
        self.end_ms = self.t0 + int(args.days * 24 * HOUR_MS)
        self.events: list = []
        self.seq = 0
        self.dirty = True
        self.next_pass = 0
        self.next_check = 0
        self.jobs: dict[str, SimJob] = {}
        self.providers: list[SimProvider] = []
        self.spikes: list[tuple[int, int]] = []
        self.lost_preempted: list[float] = []    # per preemption: lost work / its interval
        self.lost_churn: list[float] = []        # per lost lease
        self.refused = 0                         # provider updates the broker refused
        self.late_checkpoints = 0                # preemption checkpoints past grace + timeout
        store = Store(root / "broker.db")
        store.open()
        config = BrokerConfig(data_dir=root, serving_reserve=args.serving_reserve)
        self.state = BrokerState(config=config, identity=Identity.generate(), store=store,
                                 artifacts=ArtifactStore(root / "artifacts", 2**30))
        self.passes = 0

    # -- the event queue --------------------------------------------------------------------

    def at(self, when_ms: float, fn, *args) -> None:
        self.seq += 1
        heapq.heappush(self.events, (int(when_ms), self.seq, fn, args))

    def after(self, seconds: float, fn, *args) -> None:
        self.at(self.clock.ms + seconds * 1000, fn, *args)

    async def write(self, fn, *args):
        return await self.state.store.write(fn, *args)

    async def run(self) -> None:
        await self.setup()
        drain_until = self.end_ms + int(self.args.drain_days * 24 * HOUR_MS)
        day, began = 0, time.perf_counter()
        while self.events:
            if self.clock.ms >= self.t0 + (day + 1) * 24 * HOUR_MS:
                day += 1
                print(f"day {day}: {len(self.jobs)} jobs and replicas, {self.passes} passes,"
                      f" {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
            when, _, fn, args = heapq.heappop(self.events)
            if when > drain_until:
                break
            if when > self.clock.ms and self.dirty:
                await self.scheduler_pass()
            self.clock.ms = max(self.clock.ms, when)
            await fn(*args)
            if self.clock.ms >= self.next_check:        # past the demand: all done?
                self.next_check = self.clock.ms + 600_000
                if self.clock.ms >= self.end_ms and not await self.unfinished():
                    break
        self.clock.ms += 1
        await self.scheduler_pass()

    async def unfinished(self) -> bool:
        return bool(await self.state.store.read(lambda db: db.execute(
            "SELECT 1 FROM jobs WHERE kind = ? AND state IN (?, ?, ?) LIMIT 1",
            [pb.JOB_KIND_TRAINING, pb.JOB_STATE_QUEUED, pb.JOB_STATE_LEASED,
             pb.JOB_STATE_RUNNING]).fetchone()))

    async def scheduler_pass(self) -> None:
        """The scheduler's loop, once: heartbeats of the online providers, a placement
        pass, expiry; then what the broker sent each provider."""
        self.dirty = False
        self.passes += 1
        now = self.clock.ms
        for p in self.providers:
            if p.online:
                self.state.liveness.heard(p.id, list(p.runs), now)
        seen = self.state.placement.seen()
        await scheduler.place_queued(self.state)
        await scheduler.expire(self.state)
        if self.state.placement.seen() != seen:
            # Expiry requeued something: the real loop passes again at once.
            self.dirty = True
            self.at(now + 1, self.expiry)
        for p in self.providers:
            if p.session is not None:
                await self.read_outbox(p)
        if now >= self.next_pass:
            self.next_pass = now + PASS_EVERY_MS
            self.at(self.next_pass, self.tick)

    async def tick(self) -> None:
        """While jobs wait, the loop passes again (deadlines come closer meanwhile)."""
        if await self.state.store.read(lambda db: db.execute(
                "SELECT 1 FROM jobs WHERE state = ? LIMIT 1",
                [pb.JOB_STATE_QUEUED]).fetchone()):
            self.dirty = True

    # -- set-up: providers, clients, demand ------------------------------------------------

    async def setup(self) -> None:
        rng, a = self.rng, self.args
        for i in range(a.providers):
            name, gib, tflops, price, _ = rng.choices(GPUS, weights=[g[4] for g in GPUS])[0]
            p = SimProvider(Identity.generate(), name, rng.choice([1, 1, 1, 2, 2, 4, 8]),
                            tflops * 1e12, round(price * rng.uniform(0.85, 1.2), 3),
                            rng.uniform(0.3, 0.6) if rng.random() < 0.25 else 0.4,
                            (300e6 if rng.random() < 0.3 else 2e9) / 8,
                            rng.uniform(0.85, 1.15), rng.random() < 0.2)
            p.memory = gib
            self.providers.append(p)
            self.at(self.t0 + rng.uniform(0, 600_000), self.join, p)
        self.clients = [Identity.generate() for _ in range(12)]
        for c in self.clients:
            await self.write(ledger.credit, c.id, ledger.units(10**7), "client", "", "op",
                             f"credit-{c.id}", self.clock.ms)
        capacity = sum(p.gpus for p in self.providers) * 0.85
        # Arrival rates from the device-hours each share of the capacity buys:
        # standard jobs 35 %, interruptible 45 % (mean device-hours per job below).
        for tier, share, median_h in (("standard", 0.35, 1.5), ("interruptible", 0.45, 3.0)):
            mean_gpu_h = median_h * math.exp(0.6**2 / 2) * 1.45 * self.mean_slowdown()
            rate_per_h = capacity * share / mean_gpu_h
            self.at(self.t0 + 60_000, self.arrive, tier, rate_per_h, median_h)
        for e in range(2):
            await self.endpoint(f"ep{e}", self.clients[e])
        self.at(self.t0 + 2 * HOUR_MS, self.spike, "ep0", 10, 30 * 60_000)
        for ep in ("ep0", "ep1"):
            t = self.t0 + 3 * HOUR_MS
            while t < self.end_ms:
                t += rng.expovariate(2 / (24 * HOUR_MS))
                if t < self.end_ms - HOUR_MS:
                    self.at(t, self.spike, ep, rng.randint(4, 12),
                            rng.uniform(15, 90) * 60_000)

    def mean_slowdown(self) -> float:
        """How much longer than on the reference device a job runs on an average one."""
        weights = [g[4] for g in GPUS]
        return sum(w * REF_TFLOPS / g[2] for g, w in zip(GPUS, weights)) / sum(weights) \
            * 0.5   # the matcher prefers fast, cheap-per-work devices: about half of that

    def offer(self, p: SimProvider) -> pb.Offer:
        devices = [pb.Device(index=i, name=p.name, uuid=f"GPU-{p.id[:8]}-{i}",
                             accelerator=pb.ACCELERATOR_CUDA, memory_bytes=p.memory << 30,
                             compute_capability="9.0",
                             benchmark=pb.Benchmark(matmul_flops=p.tflops,
                                                    matmul_dtype="bf16"))
                   for i in range(p.gpus)]
        return pb.Offer(provider_id=p.id, devices=devices, price_per_gpu_hour=p.price,
                        interruptible_price_per_gpu_hour=round(p.price * p.share, 4),
                        kinds=[pb.JOB_KIND_TRAINING, pb.JOB_KIND_ENDPOINT],
                        engines=["transformers", "vllm"], created_at_ms=self.clock.ms,
                        software_version="0.1.0")

    async def join(self, p: SimProvider) -> None:
        now = self.clock.ms
        offer = self.offer(p)
        await self.write(providers.online, p.id, p.identity.public_key, now)
        await self.write(providers.store_offer, p.id, seal(p.identity, offer).SerializeToString(),
                         offer, now)
        p.row = await self.write(providers.session_started, p.id, now)
        p.session = self.state.sessions.open(p.id)
        p.session.offer = offer
        p.online = True
        self.dirty = True
        mean_h = 6 if p.flaky else 36
        self.after(self.rng.expovariate(1 / (mean_h * 3600)), self.leave, p)

    async def leave(self, p: SimProvider) -> None:
        """Gone without a word: its jobs stop; the broker loses their leases when they miss
        heartbeats."""
        now = self.clock.ms
        for run in p.runs.values():
            run.alive = False
            run.stop_step = run.step_now(now)
        self.gone = getattr(self, "gone", [])
        self.gone.extend(p.runs.values())
        p.runs = {}
        p.online = False
        self.state.sessions.close(p.session)
        p.session = None
        await self.write(providers.offline, p.id, now)
        await self.write(providers.session_ended, p.row, now, "gone")
        self.after(self.state.config.lease_timeout_s + 1, self.expiry)
        self.after(self.rng.expovariate(1 / (4 * 3600)), self.join, p)
        self.dirty = True

    async def expiry(self) -> None:
        self.dirty = True

    async def arrive(self, tier: str, rate_per_h: float, median_h: float) -> None:
        now = self.clock.ms
        if now >= self.end_ms:
            return
        self.after(self.rng.expovariate(rate_per_h / 3600), self.arrive, tier, rate_per_h,
                   median_h)
        rng = self.rng
        hours = min(48.0, median_h * math.exp(rng.gauss(0, 0.6)))
        gpus = rng.choices([1, 2, 4], weights=[0.7, 0.2, 0.1])[0]
        ref_step_s = rng.uniform(0.5, 3.0)
        steps = max(10, int(hours * 3600 / ref_step_s))
        ckpt = min(30 * GB, max(0.1 * GB, 1.5 * GB * math.exp(rng.gauss(0, 1.0))))
        job = SimJob(f"j{len(self.jobs) + 1}", rng.choice(self.clients).id, tier, gpus, steps,
                     ref_step_s, ckpt, rng.uniform(20, 90), created_ms=now,
                     honours=rng.random() >= self.args.ignore_share)
        if tier == "interruptible" and rng.random() < 0.6:
            expected_s = hours * 3600 * 2.0       # about what it takes on a typical device
            job.deadline_s = int(expected_s * rng.uniform(1.6, 6.0))
        self.jobs[job.id] = job
        # Its steps run on all its devices at once: the work of each, times their number.
        work = steps * ref_step_s * REF_TFLOPS * 1e12 / TRUE_SLOPE * gpus
        needs = Needs(kind=pb.JOB_KIND_TRAINING, gpus=gpus, min_memory_bytes=0,
                      accelerator=pb.ACCELERATOR_UNSPECIFIED, max_price_per_gpu_hour=MAX_PRICE,
                      work_flops=work, deadline_s=job.deadline_s, tier=tier)
        hold = ledger.units(MAX_PRICE * gpus * hours * 12 + 1)
        new = NewJob(id=job.id, client_id=job.client, name=job.id,
                     spec=pb.Envelope().SerializeToString(), spec_sha256="0" * 64,
                     needs=needs, expires_at_ms=now + 30 * 24 * HOUR_MS, max_attempts=100,
                     nonce=job.id.encode().hex(), hold=hold, hold_basis="bench",
                     fee_ppm=50_000, enforce_funds=True)
        await self.write(jobs.submit, new, now)
        self.dirty = True

    # -- serving ---------------------------------------------------------------------------

    async def endpoint(self, name: str, client: Identity) -> None:
        spec = pb.JobSpec(name=name, kind=endpoints.KIND, max_price_per_gpu_hour=MAX_PRICE)
        kinds.get(endpoints.KIND).write(spec, {"model_name": "m", "min_replicas": 2,
                                               "max_replicas": 32})
        needs = Needs(kind=endpoints.KIND, gpus=1, min_memory_bytes=0,
                      accelerator=pb.ACCELERATOR_UNSPECIFIED,
                      max_price_per_gpu_hour=MAX_PRICE, tier="serving")
        await self.write(endpoints.submit, NewJob(
            id=name, client_id=client.id, name=name,
            spec=seal(client, spec).SerializeToString(), spec_sha256="0" * 64, needs=needs,
            expires_at_ms=self.end_ms * 2, max_attempts=1000, nonce=name.encode().hex(),
            hold=ledger.units(10**6), hold_basis="bench", fee_ppm=50_000, enforce_funds=True),
            self.clock.ms)
        self.after(SETTLE_EVERY_MS / 1000, self.settle_replicas)

    async def settle_replicas(self) -> None:
        await self.write(endpoints.settle_running, self.clock.ms)
        if self.clock.ms < self.end_ms:
            self.after(SETTLE_EVERY_MS / 1000, self.settle_replicas)

    async def spike(self, ep: str, extra: int, length_ms: float) -> None:
        self.spikes.append((self.clock.ms, int(self.clock.ms + length_ms)))
        for i in range(extra):
            self.after(15 * i, self.scale_out, ep)
        for i in range(extra):
            self.at(self.clock.ms + length_ms + 60_000 * i, self.scale_in, ep)

    async def scale_out(self, ep: str) -> None:
        try:
            await self.write(endpoints.add_replica, ep, self.clock.ms, "load spike")
        except GpumarketError:
            return
        self.dirty = True

    async def scale_in(self, ep: str) -> None:
        rows = await self.state.store.read(endpoints.replicas, ep)
        if len(rows) <= 2:
            return
        # The one queued longest goes first, else the newest.
        rows.sort(key=lambda r: (r["state"] != pb.JOB_STATE_QUEUED, -r["part"]))
        ended = await self.write(endpoints.retire, rows[0]["id"], "scale in", self.clock.ms)
        if ended is not None:
            self.state.stop_lease(ended.job_id, ended.epoch, ended.provider_id, "scale in")
        self.dirty = True

    # -- a provider's side -----------------------------------------------------------------

    async def read_outbox(self, p: SimProvider) -> None:
        while not p.session.outbox.empty():
            message = p.session.outbox.get_nowait()
            if message is None:
                continue
            which = message.WhichOneof("msg")
            if which == "lease":
                lease = pb.Lease()
                lease.ParseFromString(message.lease.payload)
                self.take_lease(p, lease)
            elif which == "preempt_lease":
                run = p.runs.get((message.preempt_lease.job_id, message.preempt_lease.epoch))
                if run is not None:
                    self.preempt(p, run, message.preempt_lease.grace_s)
                # The real loop looks every second: it ends the lease on time if it has not.
                self.after(message.preempt_lease.grace_s
                           + self.state.config.lease_timeout_s + 1, self.expiry)
            elif which == "cancel":
                run = p.runs.pop((message.cancel.job_id, message.cancel.epoch), None)
                if run is not None:
                    run.alive = False
                    if run.preempted_ms:    # ended by the broker: it did not yield in time
                        if run.stop_step < 0:
                            run.stop_step = run.step_now(self.clock.ms)
                        self.note_lost(run, self.lost_preempted)

    def take_lease(self, p: SimProvider, lease: pb.Lease) -> None:
        job = self.jobs.get(lease.job_id)
        if job is None:             # an endpoint's replica
            ep = lease.job_id.split("-r")[0]
            job = self.jobs[lease.job_id] = SimJob(lease.job_id, "", "serving", 1, 0, 1.0, 0,
                                                   2.0, endpoint=ep)
        step_s = job.ref_step_s * (REF_TFLOPS * 1e12 / p.tflops) / p.speed \
            * self.rng.uniform(0.9, 1.1)
        start_step = 0
        if lease.HasField("resume_from"):
            start_step = int(lease.resume_from.name.split("-")[1])
        run = Run(job, lease.epoch, tuple(lease.device_indices),
                  lease.checkpoint_interval_s or 600.0, step_s, start_step, self.clock.ms,
                  step_at=start_step, committed=start_step)
        p.runs[(job.id, lease.epoch)] = run
        self.after(job.start_s, self.started, p, run)

    def live(self, p: SimProvider, run: Run) -> bool:
        return run.alive and p.runs.get((run.job.id, run.epoch)) is run

    async def report(self, fn, *args) -> bool:
        try:
            await self.write(fn, *args)
            return True
        except GpumarketError:
            self.refused += 1
            return False

    async def started(self, p: SimProvider, run: Run) -> None:
        if not self.live(p, run):
            return
        job = run.job
        if not await self.report(jobs.mark_started, job.id, run.epoch, p.id, self.clock.ms,
                                 run.start_step):
            return
        run.started = True
        run.settled_ms = self.clock.ms
        if job.endpoint:
            self.after(self.args.cold_start - job.start_s, self.ready, p, run)
            return
        run.computing, run.compute_ms = True, self.clock.ms
        self.plan(p, run)

    async def ready(self, p: SimProvider, run: Run) -> None:
        if self.live(p, run):
            await self.report(endpoints.mark_ready, run.job.id, run.epoch, p.id, "vllm",
                              self.clock.ms)

    def plan(self, p: SimProvider, run: Run) -> None:
        """The run's next event: its next checkpoint, or its end."""
        left = (run.job.steps - run.step_at) * run.step_s
        if left <= run.interval_s:
            self.after(left, self.finish, p, run)
        else:
            self.after(run.interval_s, self.checkpoint, p, run, False)

    def write_s(self, run: Run) -> float:
        return run.job.ckpt_bytes / WRITE_BPS

    async def checkpoint(self, p: SimProvider, run: Run, last: bool) -> None:
        """The job writes a checkpoint (compute pauses while it does); the provider uploads
        it; the broker records and settles it when the upload is done."""
        if not self.live(p, run) or run.preempted_ms and not last:
            return
        step = run.step_now(self.clock.ms)
        run.step_at, run.computing = step, False
        write = self.write_s(run)
        upload = run.job.ckpt_bytes / p.upload_bps
        self.after(write + upload, self.commit, p, run, step)
        if last:
            run.stop_step = step
            self.after(write + upload + 0.5, self.release, p, run)
        else:
            self.after(write, self.resume, p, run)

    async def resume(self, p: SimProvider, run: Run) -> None:
        if self.live(p, run) and not run.preempted_ms:
            run.computing, run.compute_ms = True, self.clock.ms
            self.plan(p, run)

    async def commit(self, p: SimProvider, run: Run, step: int) -> None:
        if not self.live(p, run) or step <= run.committed:
            return
        job, now = run.job, self.clock.ms
        sha = f"{job.id}.{step}".encode().hex().ljust(64, "0")[:64]
        size = int(job.ckpt_bytes)

        def stored(db):
            blob_holdings.record(db, sha, size, p.id, now)
            jobs.record_progress(db, job.id, run.epoch, p.id,
                                 pb.Progress(step=step, total=job.steps), now)
            return jobs.record_checkpoint(
                db, job.id, run.epoch, p.id, step,
                pb.ArtifactRef(name=f"ckpt-{step}", sha256=sha, size_bytes=size),
                self.write_s(run), now)

        if await self.report(stored):
            run.committed, run.settled_ms = step, now
        elif run.preempted_ms:
            self.late_checkpoints += 1

    def preempt(self, p: SimProvider, run: Run, grace_s: int) -> None:
        """PreemptLease: a job that honours it finishes its step and checkpoints; one that
        does not is stopped when the grace period is over."""
        if run.preempted_ms:
            return
        now = self.clock.ms
        run.preempted_ms = now
        if not run.started:         # still starting: it stops at once, nothing to save
            run.stop_step = run.start_step
            self.after(0.5, self.release, p, run)
            return
        if run.job.endpoint:
            return
        if not run.job.honours:
            step = run.step_now(now)
            run.step_at, run.computing = step, False
            run.stop_step = step
            self.after(grace_s, self.release, p, run)
            return
        # It stops at the end of the step it is in (or once its checkpoint is written).
        if run.computing:
            done = (now - run.compute_ms) / 1000 / run.step_s
            wait = (math.ceil(done) - done) * run.step_s if done % 1 else 0.0
        else:
            wait = self.write_s(run)
        if wait + self.write_s(run) > grace_s:
            run.stop_step = run.step_now(now + int(grace_s * 1000))
            run.step_at, run.computing = run.stop_step, False
            self.after(grace_s, self.release, p, run)     # stopped: its grace is over
            return
        self.after(wait, self.checkpoint, p, run, True)

    async def release(self, p: SimProvider, run: Run) -> None:
        if not self.live(p, run):
            return
        p.runs.pop((run.job.id, run.epoch), None)
        run.alive = False
        await self.report(preempt_rows.release, run.job.id, run.epoch, p.id,
                          "preempted by a higher tier", self.clock.ms)
        self.note_lost(run, self.lost_preempted)
        self.dirty = True

    def note_lost(self, run: Run, into: list[float]) -> None:
        """Work the lease did past the newest checkpoint the broker recorded from it (where
        its job resumes), in units of the lease's checkpoint interval."""
        if run.job.endpoint:
            return
        into.append(max(0, run.stop_step - run.committed) * run.step_s / run.interval_s)

    async def finish(self, p: SimProvider, run: Run) -> None:
        if not self.live(p, run) or run.preempted_ms:
            return
        run.step_at, run.computing = run.job.steps, False
        self.after(5 + run.job.ckpt_bytes / 10 / p.upload_bps, self.receipt, p, run)

    async def receipt(self, p: SimProvider, run: Run) -> None:
        if not self.live(p, run):
            return
        job = run.job
        metrics = {} if run.start_step else {
            "train_seconds": (self.clock.ms - run.leased_ms) / 1000 - job.start_s}
        receipt = pb.Receipt(job_id=job.id, epoch=run.epoch, provider_id=p.id,
                             metrics=metrics)
        envelope = pb.Envelope(payload=receipt.SerializeToString())
        p.runs.pop((job.id, run.epoch), None)
        run.alive = False
        now = self.clock.ms

        def ended(db):
            jobs.record_progress(db, job.id, run.epoch, p.id,
                                 pb.Progress(step=job.steps, total=job.steps), now)
            jobs.succeed(db, job.id, run.epoch, p.id, envelope.SerializeToString(), now)

        await self.report(ended)
        self.dirty = True

    # -- the figures -----------------------------------------------------------------------

    async def figures(self) -> dict:
        for run in getattr(self, "gone", []):
            self.note_lost(run, self.lost_churn)
        return await self.state.store.read(self._figures)

    def _figures(self, db) -> dict:
        price = {p.id: p.price for p in self.providers}
        # Interruptible jobs' money, from the ledger's settle postings: what they paid, and
        # what the same device-time would have cost at their providers' standard prices.
        inter = {j.id for j in self.jobs.values() if j.tier == "interruptible"}
        paid = on_demand = 0.0
        for job_id, provider_id, lease_id, seconds, entries in db.execute(
                "SELECT job_id, provider_id, lease_id, seconds, entries FROM ledger_postings"
                " WHERE type = 'settle'"):
            if job_id not in inter:
                continue
            charged = -json.loads(entries)[ledger.escrow(job_id)]
            devices = len(json.loads(db.execute("SELECT device_indices FROM leases WHERE id = ?",
                                                [lease_id]).fetchone()[0]))
            paid += charged
            on_demand += ledger.units(price[provider_id]) * devices * seconds / 3600
        # Each job's settled segments chain from 0 to its end, each step paid once.
        chained = double_paid = 0
        for job_id in inter:
            steps = [(r[0], r[1]) for r in db.execute(
                "SELECT step_from, step_to FROM ledger_postings WHERE type = 'settle'"
                " AND job_id = ? ORDER BY seq", [job_id])]
            covered = 0
            for a, b in steps:
                if a < covered and b > a:
                    double_paid += 1
                covered = max(covered, b)
            chained += covered == self.jobs[job_id].steps
        rows = {r[0]: r for r in db.execute(
            "SELECT id, state, updated_at_ms, created_at_ms FROM jobs WHERE kind = ?",
            [pb.JOB_KIND_TRAINING])}
        ended = {r[0]: r[1] for r in db.execute(
            "SELECT job_id, max(at_ms) FROM events WHERE type = 'succeeded' GROUP BY job_id")}
        with_deadline = [j for j in self.jobs.values() if j.deadline_s]
        met = [j for j in with_deadline if j.id in ended
               and ended[j.id] <= j.created_ms + j.deadline_s * 1000]
        succeeded = sum(1 for r in rows.values() if r[1] == pb.JOB_STATE_SUCCEEDED)
        for j in [j for j in with_deadline if j not in met][:3]:     # what happened to them
            print(f"missed its deadline: {j.id}, {j.gpus} GPUs, deadline {j.deadline_s} s,"
                  f" {j.steps} steps", file=sys.stderr)
            for at, type_, message in db.execute(
                    "SELECT at_ms, type, message FROM events WHERE job_id = ? AND type NOT IN"
                    " ('progress', 'checkpoint') ORDER BY seq", [j.id]):
                print(f"  +{(at - j.created_ms) / 1000:8.0f} s {type_}: {message[:150]}",
                      file=sys.stderr)
        # Replica waits: each time a replica is queued (added, or requeued after a lost
        # lease) until its next lease, from the job events.
        waits, spike_waits, long_waits = [], [], []
        queued_at: dict[str, int] = {}
        for job_id, at, type_ in db.execute(
                "SELECT e.job_id, e.at_ms, e.type FROM events e JOIN jobs j ON j.id = e.job_id"
                " WHERE j.kind = ? AND j.parent_id IS NOT NULL ORDER BY e.seq",
                [endpoints.KIND]):
            if type_ in ("submitted", "requeued"):
                queued_at[job_id] = at
            elif type_ == "leased" and job_id in queued_at:
                since = queued_at.pop(job_id)
                wait = (at - since) / 1000
                waits.append(wait)
                if any(a <= since <= b for a, b in self.spikes):
                    spike_waits.append(wait)
                    if wait > self.args.cold_start + 5:
                        long_waits.append((wait, job_id, since, at))
        for wait, job_id, since, at in sorted(long_waits, reverse=True)[:3]:
            print(f"replica {job_id} waited {wait:.0f} s; meanwhile:", file=sys.stderr)
            for j, when, type_, message in db.execute(
                    "SELECT job_id, at_ms, type, message FROM events WHERE at_ms BETWEEN ? AND ?"
                    " AND (job_id = ? OR type IN ('preempting', 'requeued', 'leased'))"
                    " ORDER BY seq LIMIT 12", [since, at, job_id]):
                print(f"  +{(when - since) / 1000:6.0f} s {j} {type_}: {message[:110]}",
                      file=sys.stderr)
        lease_states = dict(db.execute("SELECT state, count(*) FROM leases GROUP BY state"))
        # How busy the market was over the simulated days: device-hours leased per tier
        # (as submitted) over device-hours online.
        gpus = {p.id: p.gpus for p in self.providers}
        online = sum((min(end or self.end_ms, self.end_ms) - start) * gpus[pid]
                     for pid, start, end in db.execute(
                         "SELECT provider_id, started_ms, ended_ms FROM provider_sessions"
                         " WHERE started_ms < ?", [self.end_ms]))
        leased: dict[str, float] = {}
        for job_id, devices, start, end in db.execute(
                "SELECT job_id, device_indices, issued_at_ms, ended_at_ms FROM leases"
                " WHERE issued_at_ms < ?", [self.end_ms]):
            tier = self.jobs[job_id].tier if job_id in self.jobs else "serving"
            leased[tier] = leased.get(tier, 0.0) + len(json.loads(devices)) * (
                min(end or self.end_ms, self.end_ms) - start)
        promotions = db.execute("SELECT count(*) FROM events WHERE type = 'promoted'"
                                ).fetchone()[0]
        problems = ledger.audit(db)
        return {
            "interruptible_cost_ratio": round(on_demand / paid, 3) if paid else None,
            "deadlines_met": round(len(met) / len(with_deadline), 4) if with_deadline else None,
            "lost_intervals_per_preemption": round(
                sum(self.lost_preempted) / len(self.lost_preempted), 4)
            if self.lost_preempted else 0.0,
            "serving_wait_p99_s": round(pct(spike_waits, 0.99), 1),
            "cold_start_s": self.args.cold_start,
            "jobs": len(rows), "jobs_succeeded": succeeded,
            "standard_jobs": sum(1 for j in self.jobs.values() if j.tier == "standard"),
            "interruptible_jobs": len(inter), "with_deadline": len(with_deadline),
            "preemptions": lease_states.get("preempted", 0), "promotions": promotions,
            "leases_lost": lease_states.get("lost", 0),
            "lost_intervals_per_lost_lease": round(
                sum(self.lost_churn) / len(self.lost_churn), 4) if self.lost_churn else 0.0,
            "lost_intervals_max_preemption": round(max(self.lost_preempted, default=0.0), 3),
            "late_preemption_checkpoints": self.late_checkpoints,
            "interruptible_paid_to_end": chained, "steps_paid_twice": double_paid,
            "replica_leases": len(waits), "serving_wait_p50_s": round(pct(spike_waits, 0.5), 1),
            "serving_wait_max_s": round(max(spike_waits, default=0.0), 1),
            "serving_wait_p99_all_s": round(pct(waits, 0.99), 1),
            "spikes": len(self.spikes), "passes": self.passes,
            **{f"busy_share_{tier}": round(leased.get(tier, 0.0) / online, 3)
               for tier in ("standard", "interruptible", "serving")},
            "updates_refused": self.refused,
            "ledger_audit_ok": not problems, "ledger_problems": problems[:5],
        }


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] if ordered \
        else 0.0


async def simulate(args) -> dict:
    # The store's file in memory where the machine has a tmpfs: the bench measures the
    # market's rules, not this machine's fsync.
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as tmp:
        sim = Sim(args, Path(tmp))
        use_clock(sim.clock)
        try:
            began = time.perf_counter()
            await sim.run()
            out = await sim.figures()
            out["simulated_days"] = round((sim.clock.ms - sim.t0) / (24 * HOUR_MS), 2)
            out["wall_s"] = round(time.perf_counter() - began, 1)
            return out
        finally:
            sim.state.store.close()


def colocated() -> dict:
    """``colocated_ttft_p99_ratio`` from its real-process run (bench/colocated.py: an
    endpoint replica on one slice of this host's CPU, its TTFT p99 alone and while a training
    job runs on the other slice), with the figures beside it and the host's load."""
    import subprocess

    done = subprocess.run([sys.executable, str(ROOT / "bench" / "colocated.py")],
                          capture_output=True, text=True, timeout=1800, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        print(f"colocated run failed: {(done.stderr or done.stdout).strip()[-500:]}",
              file=sys.stderr)
        return {"colocated_ttft_p99_ratio": None}
    figures = json.loads(lines[-1])
    return {"colocated_ttft_p99_ratio": figures["colocated_ttft_p99_ratio"],
            "colocated": {k: v for k, v in figures.items()
                          if k != "colocated_ttft_p99_ratio"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--days", type=float, default=7.0, help="simulated days of demand")
    parser.add_argument("--drain-days", type=float, default=3.0,
                        help="simulated days after that for the jobs in flight to end")
    parser.add_argument("--providers", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cold-start", type=float, default=40.0,
                        help="a serving replica's cold start, seconds (the target's base)")
    parser.add_argument("--serving-reserve", type=int, default=12,
                        help="the broker's serving_reserve: devices standard jobs leave free"
                             " or interruptible for replicas (12: the largest spike; 0: none)")
    parser.add_argument("--ignore-share", type=float, default=0.05,
                        help="share of jobs that ignore a preemption's checkpoint request")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: half a day, 12 providers, no colocated run")
    parser.add_argument("--no-colocated", action="store_true",
                        help="leave out colocated_ttft_p99_ratio (bench/colocated.py: real"
                             " processes, about two minutes)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)     # the broker's own lines: lost leases, ...
    if args.quick:
        args.days, args.drain_days, args.providers = 0.5, 1.0, 12
        args.no_colocated = True
    install_reactions()     # as the broker does when it starts
    out = asyncio.run(simulate(args))
    if not args.no_colocated:
        out.update(colocated())
    width = max(len(k) for k in out)
    for key, value in out.items():
        print(f"{key:<{width}}  {value}")
    targets = (("interruptible_cost_ratio", ">=", 2.0), ("deadlines_met", ">=", 1.0),
               ("lost_intervals_per_preemption", "<=", 1.0),
               ("serving_wait_p99_s", "<=", args.cold_start + 5),
               *((("colocated_ttft_p99_ratio", "<=", 1.2),) if not args.no_colocated else ()))
    for key, op, bound in targets:
        value = out[key]
        ok = value is not None and (value >= bound if op == ">=" else value <= bound)
        print(f"target {key} {op} {bound:g}: {value} ({'met' if ok else 'NOT met'})")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
