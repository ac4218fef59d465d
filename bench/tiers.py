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
                                    [--serving-reserve 12] [--[no-]serving-backup]

The code: this file drives the market (the event queue, the scheduler's pass, a provider's
side of a lease); tiers_world.py is the simulated world (clock, jobs, runs, providers),
tiers_demand.py the week (churn, demand, endpoints and their spikes), tiers_figures.py the
figures.

Prints its figures; the last line is one JSON object: interruptible_cost_ratio,
deadlines_met, lost_intervals_per_preemption, serving_wait_p99_s, the counts (among them
preemptions_undone: preempted leases whose devices went back to an interruptible job within
15 minutes, tiers_figures.undone_preemptions) and ledger_audit_ok, and colocated_ttft_p99_ratio: not simulated, measured with real processes
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpumarket.broker.config import BrokerConfig
from gpumarket.broker.jobs import preemption as preempt_rows
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.market import preemption, scheduler
from gpumarket.broker.server import install_reactions
from gpumarket.broker.serving import endpoints
from gpumarket.broker.state import BrokerState
from gpumarket.broker.store import blob_holdings
from gpumarket.broker.store.artifact_store import ArtifactStore
from gpumarket.broker.store.store import Store
from gpumarket.proto.errors import GpumarketError
from gpumarket.proto.identity import Identity
from gpumarket.proto.v1 import types_pb2 as pb
from tiers_demand import Demand
from tiers_figures import Figures, colocated
from tiers_world import (HOUR_MS, PASS_EVERY_MS, REF_TFLOPS, WRITE_BPS, Clock, Run, SimJob,
                         SimProvider, use_clock)


class Sim(Demand, Figures):
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
    parser.add_argument("--serving-backup", action=argparse.BooleanOptionalAction,
                        default=None, help="a replica preempts a second set of leases, the first"
                        " to yield its (preemption.SERVING_BACKUP; default: as built)")
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
    if args.serving_backup is not None:
        preemption.SERVING_BACKUP = args.serving_backup
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
