"""The provider daemon: one session with the broker, one child process per leased job.

The session (hello → challenge → proof → welcome → offer, then heartbeats) is
reopened with backoff whenever it breaks; jobs keep running meanwhile, and the
final update of each job is kept until the broker says it has settled it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict

from gpumarket.proto import __version__
from gpumarket.proto.envelope import open_envelope, seal
from gpumarket.proto.errors import GpumarketError, Unavailable
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import kind_name, now_ms
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import gateway_pb2_grpc
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider.broker_link import ArtifactLink
from gpumarket.provider.config import ProviderConfig
from gpumarket.provider.executor import JobProcess, job_env
from gpumarket.provider.inventory import DeviceInfo
from gpumarket.provider.leases import Assignment, check_lease, refusal

log = logging.getLogger(__name__)

RUNNERS = {pb.JOB_KIND_TRAINING: "gpumarket.provider.runners.training"}


@dataclass(eq=False)
class RunningJob:
    assignment: Assignment
    workdir: Path
    process: JobProcess | None = None
    cancelled: bool = False
    last_progress: float = 0.0
    task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def key(self) -> tuple[str, int]:
        return self.assignment.lease.job_id, self.assignment.lease.epoch


class ProviderDaemon:
    def __init__(self, config: ProviderConfig, identity: Identity, devices: list[DeviceInfo],
                 benchmarks: dict[int, pb.Benchmark]) -> None:
        self.config = config
        self.identity = identity
        self.devices = devices
        self.benchmarks = benchmarks
        self.kinds = set(RUNNERS)
        self.jobs: dict[str, RunningJob] = {}
        self.unsettled: dict[tuple[str, int], gw.ProviderMessage] = {}
        self.outbox: asyncio.Queue | None = None
        self.broker_key: bytes | None = None
        self.stopping = asyncio.Event()
        self.channel: grpc.aio.Channel | None = None
        self.artifacts: ArtifactLink | None = None
        self.connected = asyncio.Event()

    # -- offer ---------------------------------------------------------------------------

    def offer(self) -> pb.Envelope:
        offer = pb.Offer(
            provider_id=self.identity.id,
            devices=[d.message(self.benchmarks.get(d.index)) for d in self.devices],
            price_per_gpu_hour=self.config.price_per_gpu_hour,
            kinds=sorted(self.kinds),
            software_version=__version__,
            created_at_ms=now_ms(),
        )
        return seal(self.identity, offer)

    def free_devices(self) -> set[int]:
        held = {i for j in self.jobs.values() for i in j.assignment.lease.device_indices}
        return {d.index for d in self.devices} - held

    # -- the session ---------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until stop() is called; then end every job."""
        self.channel = grpc.aio.insecure_channel(self.config.broker)
        self.artifacts = ArtifactLink(self.channel, self.config.rpc_timeout_s)
        backoff = 0.5
        try:
            while not self.stopping.is_set():
                began = time.monotonic()
                try:
                    await self._session()
                except grpc.aio.AioRpcError as exc:
                    log.warning("broker %s: %s (%s)", self.config.broker,
                                exc.details() or "no answer", exc.code().name)
                except GpumarketError as exc:
                    log.warning("broker %s: %s", self.config.broker, exc)
                finally:
                    self.outbox = None
                    self.connected.clear()
                if self.stopping.is_set():
                    break
                if time.monotonic() - began > 30:
                    backoff = 0.5
                delay = backoff * (1 + 0.2 * random.random())
                log.info("reconnecting in %.1fs", delay)
                try:
                    await asyncio.wait_for(self.stopping.wait(), delay)
                except TimeoutError:
                    pass
                backoff = min(backoff * 2, self.config.backoff_max_s)
        finally:
            await self._stop_jobs("provider is shutting down")
            await self.channel.close()

    def stop(self) -> None:
        self.stopping.set()

    async def _session(self) -> None:
        stub = gateway_pb2_grpc.ProviderGatewayStub(self.channel)
        call = stub.Session()
        try:
            await call.write(gw.ProviderMessage(hello=gw.ProviderHello(
                public_key=self.identity.public_key, software_version=__version__)))
            challenge = await call.read()
            if challenge is grpc.aio.EOF or challenge.WhichOneof("msg") != "challenge":
                raise Unavailable("broker closed the session during the handshake")
            key = challenge.challenge.broker_public_key
            proof = gw.SessionProof(nonce=challenge.challenge.nonce, broker_public_key=key,
                                    at_ms=now_ms())
            await call.write(gw.ProviderMessage(proof=seal(self.identity, proof)))
            welcome = await call.read()
            if welcome is grpc.aio.EOF or welcome.WhichOneof("msg") != "welcome":
                raise Unavailable("broker did not welcome this provider")
            self.broker_key = key
            log.info("connected to broker %s as provider %s", self.config.broker,
                     welcome.welcome.provider_id)
            outbox: asyncio.Queue = asyncio.Queue()
            outbox.put_nowait(gw.ProviderMessage(offer=self.offer()))
            for message in self.unsettled.values():
                outbox.put_nowait(message)
            self.outbox = outbox
            self.connected.set()
            interval = max(welcome.welcome.heartbeat_interval_ms, 200) / 1000
            tasks = [asyncio.create_task(self._write_loop(call, outbox)),
                     asyncio.create_task(self._heartbeat_loop(outbox, interval))]
            reader = asyncio.create_task(self._read_loop(call))
            stopper = asyncio.create_task(self.stopping.wait())
            try:
                done, _ = await asyncio.wait([reader, stopper, *tasks],
                                             return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if t is not stopper and t.exception() is not None:
                        raise t.exception()
            finally:
                for t in (reader, stopper, *tasks):
                    t.cancel()
        finally:
            call.cancel()

    async def _write_loop(self, call, outbox: asyncio.Queue) -> None:
        while True:
            await call.write(await outbox.get())

    async def _heartbeat_loop(self, outbox: asyncio.Queue, interval: float) -> None:
        while True:
            running = [gw.RunningLease(job_id=j, epoch=e) for j, e in
                       [job.key for job in self.jobs.values()]]
            outbox.put_nowait(gw.ProviderMessage(
                heartbeat=gw.Heartbeat(at_ms=now_ms(), running=running)))
            await asyncio.sleep(interval)

    async def _read_loop(self, call) -> None:
        while True:
            message = await call.read()
            if message is grpc.aio.EOF:
                raise Unavailable("broker ended the session")
            which = message.WhichOneof("msg")
            if which == "lease":
                self._start_job(message.lease)
            elif which == "cancel":
                await self._cancel(message.cancel)
            elif which == "settled":
                self._settled(message.settled)

    def send(self, message: gw.ProviderMessage) -> None:
        if self.outbox is not None:
            self.outbox.put_nowait(message)

    def _update(self, job: RunningJob, **fields) -> gw.ProviderMessage:
        job_id, epoch = job.key
        return gw.ProviderMessage(job_update=gw.JobUpdate(job_id=job_id, epoch=epoch, **fields))

    # -- jobs ----------------------------------------------------------------------------

    def _start_job(self, envelope: pb.Envelope) -> None:
        try:
            assignment = check_lease(
                envelope, broker_public_key=self.broker_key or b"",
                provider_id=self.identity.id, device_indices=self.free_devices(),
                kinds=self.kinds)
        except GpumarketError as exc:
            reason = refusal(exc)
            log.warning("refused a lease: %s", reason)
            self._refuse(envelope, reason)
            return
        lease = assignment.lease
        workdir = self.config.jobs_dir / f"{lease.job_id}.{lease.epoch}"
        job = RunningJob(assignment, workdir)
        self.jobs[lease.job_id] = job
        job.task = asyncio.create_task(self._run_job(job))
        log.info("job %s (%s) leased, attempt %d", lease.job_id,
                 kind_name(assignment.spec.kind), lease.attempt)

    def _refuse(self, envelope: pb.Envelope, reason: str) -> None:
        """Answer a lease that failed its checks; only a lease signed by the broker gets an
        answer, since an unsigned one names nothing we should act on."""
        try:
            lease, _ = open_envelope(envelope, pb.Lease)
        except GpumarketError:
            return
        if self.broker_key and envelope.signer_public_key == self.broker_key:
            self.send(gw.ProviderMessage(job_update=gw.JobUpdate(
                job_id=lease.job_id, epoch=lease.epoch,
                rejected=gw.JobRejected(reason=reason))))

    async def _run_job(self, job: RunningJob) -> None:
        a = job.assignment
        final: gw.ProviderMessage | None = None
        try:
            inputs = await self._fetch_inputs(job)
            if job.cancelled:
                return
            self._write_job_file(job, inputs)
            self.send(self._update(job, started=gw.JobStarted()))
            devices = [d for d in self.devices if d.index in set(a.lease.device_indices)]
            cuda = any(d.is_cuda for d in devices)
            limit = min(a.spec.max_runtime_s or self.config.max_runtime_s,
                        self.config.max_runtime_s)
            job.process = JobProcess(
                RUNNERS[a.spec.kind], job.workdir,
                job_env(job.workdir, ",".join(d.uuid for d in devices) if cuda else "", None),
                lambda report: self._on_report(job, report), limit, self.config.cancel_grace_s)
            outcome = await job.process.run()
            if job.cancelled:
                return
            if outcome.done is not None:
                final = self._update(job, receipt=await self._receipt(job, outcome))
                log.info("job %s succeeded in %.1fs", a.lease.job_id, outcome.wall_seconds)
            else:
                final = self._update(job, failed=gw.JobFailed(error=outcome.error))
                log.warning("job %s failed: %s", a.lease.job_id, outcome.error)
        except asyncio.CancelledError:
            raise
        except GpumarketError as exc:
            final = self._update(job, failed=gw.JobFailed(error=str(exc)))
            log.warning("job %s failed: %s", a.lease.job_id, exc)
        except Exception:
            log.exception("job %s failed in the provider", a.lease.job_id)
            final = self._update(job, failed=gw.JobFailed(error="provider error while running"))
        finally:
            if final is None:
                self._forget(job)
        self.unsettled[job.key] = final
        self.send(final)

    async def _fetch_inputs(self, job: RunningJob) -> dict[str, str]:
        inputs_dir = job.workdir / "inputs"
        inputs_dir.mkdir(parents=True, exist_ok=True)
        self.config.cache_dir.mkdir(parents=True, exist_ok=True)
        paths = {}
        for ref in job.assignment.spec.inputs:
            cached = self.config.cache_dir / ref.sha256
            if not cached.exists():
                await self._with_broker(lambda ref=ref, cached=cached:
                                        self.artifacts.download(ref, cached))
            target = inputs_dir / ref.name
            target.unlink(missing_ok=True)
            try:
                target.hardlink_to(cached)
            except OSError:
                shutil.copyfile(cached, target)
            paths[ref.name] = str(target)
        return paths

    async def _with_broker(self, call, attempts: int = 8):
        """Run an artifact call, waiting out short broker outages."""
        for i in range(attempts):
            try:
                return await call()
            except Unavailable:
                if i == attempts - 1:
                    raise
                await asyncio.sleep(min(2 ** i, 10))

    def _write_job_file(self, job: RunningJob, inputs: dict[str, str]) -> None:
        a = job.assignment
        devices = [d for d in self.devices if d.index in set(a.lease.device_indices)]
        spec = {
            "job_id": a.lease.job_id,
            "attempt": a.lease.attempt,
            "kind": kind_name(a.spec.kind),
            "params": MessageToDict(a.spec.training, preserving_proto_field_name=True),
            "inputs": inputs,
            "checkpoint_every": a.spec.training.checkpoint_every or a.lease.checkpoint_every,
            "device": "cuda" if any(d.is_cuda for d in devices) else "cpu",
            "resume_from": None,
        }
        (job.workdir / "job.json").write_text(json.dumps(spec, indent=2))

    async def _on_report(self, job: RunningJob, report: dict) -> None:
        event = report.get("event")
        if event == "progress":
            now = time.monotonic()
            step, total = int(report.get("step", 0)), int(report.get("total", 0))
            if now - job.last_progress < self.config.progress_interval_s and step < total:
                return
            job.last_progress = now
            metrics = {k: float(v) for k, v in (report.get("metrics") or {}).items()
                       if isinstance(v, (int, float))}
            self.send(self._update(job, progress=pb.Progress(step=step, total=total,
                                                             metrics=metrics)))
        elif event == "checkpoint":
            self.send(self._update(job, checkpoint=gw.CheckpointReport(
                step=int(report.get("step", 0)))))

    async def _receipt(self, job: RunningJob, outcome) -> pb.Envelope:
        a = job.assignment
        outputs = []
        out_dir = job.workdir / "outputs"
        for path in sorted(p for p in out_dir.iterdir() if p.is_file() and not p.is_symlink()):
            ref = await self._with_broker(lambda path=path: self.artifacts.upload(path, path.name))
            outputs.append(ref)
        metrics = {k: float(v) for k, v in (outcome.done.get("metrics") or {}).items()
                   if isinstance(v, (int, float))}
        receipt = pb.Receipt(
            job_id=a.lease.job_id, lease_id=a.lease.lease_id, attempt=a.lease.attempt,
            epoch=a.lease.epoch, provider_id=self.identity.id, spec_sha256=a.spec_sha256,
            outputs=outputs, wall_seconds=outcome.wall_seconds,
            device_seconds=outcome.wall_seconds * len(a.lease.device_indices),
            metrics=metrics, finished_at_ms=now_ms())
        return seal(self.identity, receipt)

    async def _cancel(self, cancel: gw.CancelLease) -> None:
        job = self.jobs.get(cancel.job_id)
        if job is None or job.key[1] != cancel.epoch:
            return
        log.info("job %s cancelled by the broker: %s", cancel.job_id, cancel.reason)
        job.cancelled = True
        self.unsettled.pop(job.key, None)
        if job.process is not None:
            await job.process.stop(cancel.reason)
        self._forget(job)

    def _settled(self, settled: gw.UpdateSettled) -> None:
        key = (settled.job_id, settled.epoch)
        self.unsettled.pop(key, None)
        job = self.jobs.get(settled.job_id)
        if job is not None and job.key == key:
            if not settled.accepted:
                log.warning("broker refused the result of job %s: %s", settled.job_id,
                            settled.reason)
            self._forget(job)

    def _forget(self, job: RunningJob) -> None:
        if self.jobs.get(job.key[0]) is job:
            del self.jobs[job.key[0]]
        shutil.rmtree(job.workdir, ignore_errors=True)

    async def _stop_jobs(self, reason: str) -> None:
        for job in list(self.jobs.values()):
            job.cancelled = True
            if job.process is not None:
                await job.process.stop(reason)
            if job.task is not None:
                job.task.cancel()
