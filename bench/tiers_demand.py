"""bench/tiers.py's week: the providers that come and go, the clients, the jobs they submit
and the endpoints whose load spikes (bench/tiers.py's docstring: every assumption). A mixin
of tiers.Sim, whose event queue (``at``, ``after``) and broker state it drives."""

from __future__ import annotations

import math

from gpumarket import kinds
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.market import providers
from gpumarket.broker.market.admission import Needs, NewJob
from gpumarket.broker.money import ledger
from gpumarket.broker.serving import endpoints
from gpumarket.proto.envelope import seal
from gpumarket.proto.errors import GpumarketError
from gpumarket.proto.identity import Identity
from gpumarket.proto.v1 import types_pb2 as pb
from tiers_world import (GB, GPUS, HOUR_MS, MAX_PRICE, REF_TFLOPS, SETTLE_EVERY_MS,
                         TRUE_SLOPE, SimJob, SimProvider)


class Demand:
    """Set-up, churn, demand and serving load: the events the week is made of."""

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
        rows.sort(key=lambda r: (r.state != pb.JOB_STATE_QUEUED, -r.part))
        ended = await self.write(endpoints.retire, rows[0].id, "scale in", self.clock.ms)
        if ended is not None:
            self.state.stop_lease(ended.job_id, ended.epoch, ended.provider_id, "scale in")
        self.dirty = True
