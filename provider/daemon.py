"""The provider daemon: one session with the broker, one child process per leased job.

The session (hello → challenge → proof → welcome → offer, then heartbeats) is reopened
with backoff whenever it breaks; jobs keep running meanwhile. Each job's checkpoints are
packed, uploaded and reported as they appear; its final update is kept (in memory and in
the journal) until the broker says it has settled it. SIGTERM drains: every job
checkpoints now, uploads, and gives its lease back before the daemon exits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path, PurePosixPath

import grpc

from gpumarket.link.artifacts import ArtifactsClient
from gpumarket.link.channel import open_channel
from gpumarket.link.gateway import GatewaySession
from gpumarket.proto.envelope import open_envelope, seal
from gpumarket.proto.tls import Untrusted
from gpumarket.proto.errors import GpumarketError, Unavailable
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import (
    LOG_LINE_CHARS, LOG_LINES_PER_UPDATE, kind_name, now_ms, required_model,
)
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider import checkpoints, jobfiles, recovery, sandbox
from gpumarket.provider.cgroups import CgroupError, CgroupHost, Limits
from gpumarket.provider.config import ProviderConfig
from gpumarket.provider.executor import JobProcess, job_env, pid_runs_in, read_reports
from gpumarket.provider.job_uids import UidRange, UidRangeError, claim
from gpumarket.provider.inventory import DeviceInfo, inference_engines, local_models
from gpumarket.provider.journal import Journal
from gpumarket.provider.leases import check_lease, refusal, runner_config
from gpumarket.provider.offering import build_offer
from gpumarket.provider.running import RunningJob
from gpumarket.provider.warm_pool import WarmPool

log = logging.getLogger(__name__)

RUNNERS = {pb.JOB_KIND_TRAINING: "gpumarket.provider.runners.training",
           pb.JOB_KIND_GENERATE: "gpumarket.provider.runners.generate",
           pb.JOB_KIND_EMBED: "gpumarket.provider.runners.embed",
           pb.JOB_KIND_RENDER: "gpumarket.provider.runners.render"}
WARM_KINDS = {pb.JOB_KIND_TRAINING}   # one idle runner each: training resumes fastest


class ProviderDaemon:
    def __init__(self, config: ProviderConfig, identity: Identity, devices: list[DeviceInfo],
                 benchmarks: dict[int, pb.Benchmark]) -> None:
        self.config = config
        self.identity = identity
        self.devices = devices
        self.benchmarks = benchmarks
        self.engines = inference_engines(any(d.is_cuda for d in devices))
        self.kinds = set(RUNNERS) & set(config.kinds)
        if "cycles" not in self.engines:
            self.kinds.discard(pb.JOB_KIND_RENDER)
        self.jobs: dict[str, RunningJob] = {}
        self.unsettled: dict[tuple[str, int], gw.ProviderMessage] = {}
        self.outbox: asyncio.Queue | None = None
        self.broker_key: bytes | None = None
        self.stopping = asyncio.Event()
        self.draining = False
        self.channel: grpc.aio.Channel | None = None
        self.artifacts: ArtifactsClient | None = None
        self.journal = Journal(config.data_dir / "journal.db")
        self._background: set[asyncio.Task] = set()
        self.warm = WarmPool(config.jobs_dir, config.warm_runners)
        self.isolation: dict = {}
        self.uids: UidRange | None = None
        self.cgroups: CgroupHost | None = None

    # -- offer ---------------------------------------------------------------------------

    def offer(self) -> pb.Envelope:
        return build_offer(self.config, self.identity, self.devices, self.benchmarks,
                           self.kinds, self.engines, self.runs_code())

    def runs_code(self) -> bool:
        """Whether this provider runs jobs' own code (a model's remote code): only if its
        operator allows it, and only where the host isolates such a job fully, unless the
        operator opted in to weaker isolation."""
        if not self.config.policy.allow_remote_code:
            return False
        return self.config.unisolated_code or not sandbox.missing_for_code(self.isolation)

    def free_devices(self) -> set[int]:
        held = {i for j in self.jobs.values() for i in j.devices}
        return {d.index for d in self.devices} - held

    # -- lifetime ------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until stopped (after a drain, or at once by stop()); then end every job."""
        if self.config.isolate:
            await asyncio.to_thread(self._prepare_isolation)
        await self._recover()
        for kind in self.kinds:
            await self._refill_warm(kind)
        backoff = 0.5
        try:
            while not self.stopping.is_set():
                began = time.monotonic()
                try:
                    if self.channel is None:
                        await self._connect()
                    await self._session()
                except Untrusted:
                    raise   # not the broker this provider trusts: stop, loudly
                except GpumarketError as exc:
                    log.warning("broker %s: %s", self.config.broker, exc)
                finally:
                    self.outbox = None
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
            if self.channel is not None:
                await self.channel.close()
            self.journal.close()

    def _prepare_isolation(self) -> None:
        """Claim this daemon's job uids and control-group directory, then try every
        protection for real; say what is missing, and what that turns off."""
        if os.geteuid() == 0:
            try:
                self.uids = claim(self.identity.id, self.config.job_uid_pool)
            except UidRangeError as exc:
                log.warning("no job uid range: %s", exc)
            try:
                self.cgroups = CgroupHost.detect(f"gpumarket-{self.identity.id[:16]}")
            except CgroupError as exc:
                log.warning("no job cgroups: %s", exc)
        self.isolation = sandbox.prepare_host(self.config.data_dir, self.config.jobs_dir,
                                              self.uids, self.cgroups)
        log.info("job isolation: %s", sandbox.summary(self.isolation))
        missing = sandbox.missing_for_code(self.isolation)
        if self.config.policy.allow_remote_code and missing:
            if self.config.unisolated_code:
                log.warning("jobs' own code runs without: %s (unisolated_code = true)",
                            ", ".join(missing))
            else:
                log.warning("jobs' own code (remote code) is refused: this host gives no %s"
                            " (gpumarket-provider doctor; unisolated_code = true to run it"
                            " anyway)", ", ".join(missing))

    async def _connect(self) -> None:
        """Open the channel: TLS to the broker key this provider trusts (pinned by
        ``broker_key``, else remembered on first use in DATA_DIR/known_brokers)."""
        opened = await open_channel(self.config.broker, self.identity, self.config.trust(),
                                    min(self.config.rpc_timeout_s, 10.0))
        self.channel = opened.channel
        self.artifacts = ArtifactsClient(self.channel, self.config.broker,
                                         self.config.rpc_timeout_s)

    def stop(self) -> None:
        """Stop now: jobs are killed and their leases lapse."""
        self.stopping.set()

    def request_drain(self) -> None:
        self._spawn(self.drain())

    async def drain(self) -> None:
        """Checkpoint every job now, upload, give the leases back, then stop."""
        if self.draining:
            return
        self.draining = True
        log.info("draining %d jobs: checkpoint, upload, release", len(self.jobs))
        self.send(gw.ProviderMessage(heartbeat=gw.Heartbeat(
            at_ms=now_ms(), running=[gw.RunningLease(job_id=j, epoch=e)
                                     for j, e in (job.key for job in self.jobs.values())],
            draining=True)))
        for job in list(self.jobs.values()):
            if job.process is not None:
                job.process.request_drain()
        tasks = [j.task for j in self.jobs.values() if j.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.drain_timeout_s)
        deadline = time.monotonic() + 15
        while self.unsettled and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.unsettled:
            log.warning("%d job updates were not acknowledged before exit", len(self.unsettled))
        self.stopping.set()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- the session ---------------------------------------------------------------------

    async def _session(self) -> None:
        session = await GatewaySession.open(self.channel, self.identity, self.config.broker)
        try:
            key = session.broker_public_key
            if self.broker_key and key != self.broker_key:
                log.warning("the broker's key changed since the last session")
            self.broker_key = key
            welcome = session.welcome
            log.info("connected to broker %s as provider %s", self.config.broker,
                     welcome.provider_id)
            outbox: asyncio.Queue = asyncio.Queue()
            outbox.put_nowait(gw.ProviderMessage(offer=self.offer()))
            for job in self.jobs.values():
                if job.checkpoint_report is not None:
                    outbox.put_nowait(job.checkpoint_report)
            for message in self.unsettled.values():
                outbox.put_nowait(message)
            self.outbox = outbox
            interval = max(welcome.heartbeat_interval_ms, 200) / 1000
            tasks = [asyncio.create_task(self._write_loop(session, outbox)),
                     asyncio.create_task(self._heartbeat_loop(outbox, interval)),
                     asyncio.create_task(self._read_loop(session)),
                     asyncio.create_task(self.stopping.wait())]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if not t.cancelled() and t.exception() is not None:
                        raise t.exception()
            finally:
                for t in tasks:
                    t.cancel()
        finally:
            session.close()

    async def _write_loop(self, session: GatewaySession, outbox: asyncio.Queue) -> None:
        while True:
            await session.send(await outbox.get())

    async def _heartbeat_loop(self, outbox: asyncio.Queue, interval: float) -> None:
        while True:
            running = [gw.RunningLease(job_id=j, epoch=e) for j, e in
                       [job.key for job in self.jobs.values()]]
            outbox.put_nowait(gw.ProviderMessage(heartbeat=gw.Heartbeat(
                at_ms=now_ms(), running=running, draining=self.draining)))
            await asyncio.sleep(interval)

    async def _read_loop(self, session: GatewaySession) -> None:
        while True:
            message = await session.receive()
            if message is None:
                raise Unavailable("broker ended the session")
            which = message.WhichOneof("msg")
            if which == "lease":
                await self._start_job(message.lease)
            elif which == "cancel":
                await self._cancel(message.cancel)
            elif which == "settled":
                await self._settled(message.settled)

    def send(self, message: gw.ProviderMessage) -> None:
        if self.outbox is not None:
            self.outbox.put_nowait(message)

    def _update(self, job: RunningJob, **fields) -> gw.ProviderMessage:
        job_id, epoch = job.key
        return gw.ProviderMessage(job_update=gw.JobUpdate(job_id=job_id, epoch=epoch, **fields))

    # -- accepting a lease ---------------------------------------------------------------

    async def _start_job(self, envelope: pb.Envelope) -> None:
        try:
            if self.draining:
                raise Unavailable("provider is draining")
            assignment = check_lease(
                envelope, broker_public_key=self.broker_key or b"",
                provider_id=self.identity.id, device_indices=self.free_devices(),
                kinds=self.kinds, engines=self.engines,
                models=frozenset(local_models(self.config.models_dir)),
                policy=self.config.policy, runs_code=self.runs_code())
        except GpumarketError as exc:
            reason = refusal(exc)
            log.warning("refused a lease: %s", reason)
            self._refuse(envelope, reason)
            return
        lease = assignment.lease
        workdir = self.config.jobs_dir / f"{lease.job_id}.{lease.epoch}"
        job = RunningJob(assignment, workdir)
        self.jobs[lease.job_id] = job
        await asyncio.to_thread(self.journal.add, lease.job_id, lease.epoch,
                                envelope.SerializeToString(), str(workdir))
        job.task = asyncio.create_task(self._run_job(job))
        log.info("job %s (%s) leased, attempt %d", lease.job_id,
                 kind_name(assignment.spec.kind), lease.attempt)

    def _refuse(self, envelope: pb.Envelope, reason: str) -> None:
        """Answer a lease that failed its checks; only one signed by the broker gets an
        answer, since anything else names nothing we should act on."""
        try:
            lease, _ = open_envelope(envelope, pb.Lease)
        except GpumarketError:
            return
        if self.broker_key and envelope.signer_public_key == self.broker_key:
            self.send(gw.ProviderMessage(job_update=gw.JobUpdate(
                job_id=lease.job_id, epoch=lease.epoch,
                rejected=gw.JobRejected(reason=reason))))

    # -- running a job -------------------------------------------------------------------

    def _process(self, job: RunningJob, warm: asyncio.subprocess.Process | None = None
                 ) -> JobProcess:
        a = job.assignment
        devices = self._devices_of(job)
        cuda = any(d.is_cuda for d in devices)
        limit = min(a.spec.max_runtime_s or self.config.max_runtime_s, self.config.max_runtime_s)
        env = job_env(job.workdir, ",".join(d.uuid for d in devices) if cuda else "", None)
        quota = int(self.config.job_disk_gib * 2**30)
        box, group = None, None
        if self.config.isolate:
            if self.cgroups is not None and self.isolation.get("job_cgroup", {}).get("available"):
                group = self.cgroups.job(job.workdir.name)
                group.limit(self._limits(devices))
            expose = (str(job.workdir),) + ((str(self.config.models_dir),)
                                            if self.config.models_dir.is_dir() else ())
            box = sandbox.for_job(self.isolation, self.uids, sorted(job.devices), quota, cuda,
                                  sum(d.memory_bytes for d in devices), group, expose)
        return JobProcess(RUNNERS[a.spec.kind], job.workdir, env,
                          lambda report: self._on_report(job, report), limit,
                          self.config.cancel_grace_s, warm, box, quota, group)

    def _job_uid(self, job: RunningJob) -> int:
        """The uid the job runs as (its files are its, and only those are taken)."""
        if self.config.isolate and self.uids is not None and \
                self.isolation.get("unprivileged_user", {}).get("available"):
            return self.uids.uid(min(job.devices, default=0))
        return os.geteuid()

    def _limits(self, devices: list[DeviceInfo]) -> Limits:
        """A job's share of the host: on the CPU, its devices' memory and cores; on GPUs,
        host memory in proportion to the GPUs it leases, and no CPU cap."""
        if any(d.is_cuda for d in devices):
            gpus = [d for d in self.devices if d.is_cuda]
            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            return Limits(memory_bytes=host * len(devices) // max(len(gpus), 1), pids=4096)
        return Limits(memory_bytes=sum(d.memory_bytes for d in devices), pids=4096,
                      cpus=float(sum(d.cpu_cores for d in devices)))

    async def _run_job(self, job: RunningJob) -> None:
        a = job.assignment
        try:
            resumed_from = await self._prepare(job)
            if job.cancelled:
                return
            if self.draining:
                final = self._update(job, released=gw.JobReleased(reason="provider is draining"))
            else:
                job.process = self._process(job, self._take_warm(a.spec.kind))
                pid = await job.process.start()
                await asyncio.to_thread(self.journal.set_pid, *job.key, pid)
                self.send(self._update(job, started=gw.JobStarted(resumed_from_step=resumed_from)))
                final = await self._follow(job)
        except asyncio.CancelledError:
            raise
        except GpumarketError as exc:
            final = self._update(job, failed=gw.JobFailed(error=str(exc)))
            log.warning("job %s failed: %s", a.lease.job_id, exc)
        except Exception:
            log.exception("job %s failed in the provider", a.lease.job_id)
            final = self._update(job, failed=gw.JobFailed(error="provider error while running"))
        if final is None or job.cancelled:
            return
        await self._finalize(job, final)

    async def _follow(self, job: RunningJob) -> gw.ProviderMessage | None:
        """Follow the job process to its end; return the final update (None if cancelled)."""
        job_id = job.key[0]
        outcome = await job.process.run()
        if job.cancelled:
            return None
        if outcome.succeeded:
            if job.uploader is not None:
                job.uploader.cancel()
            log.info("job %s succeeded in %.1fs", job_id, outcome.wall_seconds)
            return self._update(job, receipt=await self._receipt(job, outcome.done,
                                                                 outcome.wall_seconds))
        if outcome.drained or self.draining:
            # Also a job that died of the drain request itself: it resumes elsewhere from
            # its last uploaded checkpoint rather than failing.
            if job.uploader is not None:
                await asyncio.gather(job.uploader, return_exceptions=True)
            log.info("job %s drained at step %d", job_id, job.uploaded_step)
            return self._update(job, released=gw.JobReleased(reason="provider is draining"))
        log.warning("job %s failed: %s", job_id, outcome.error)
        return self._update(job, failed=gw.JobFailed(error=outcome.error))

    async def _finalize(self, job: RunningJob, final: gw.ProviderMessage) -> None:
        self.unsettled[job.key] = final
        await asyncio.to_thread(self.journal.set_final, *job.key, final.SerializeToString())
        self.send(final)

    async def _prepare(self, job: RunningJob) -> int:
        """Fetch inputs and the checkpoint to resume from; write job.json. Returns the step
        the job resumes from (0 for a fresh start)."""
        a = job.assignment
        inputs_dir = job.workdir / "inputs"
        inputs_dir.mkdir(parents=True, exist_ok=True)
        paths = {}
        for ref in a.spec.inputs:
            target = inputs_dir / ref.name
            await self._cached(ref, target)
            paths[ref.name] = str(target)
        resume_dir, step = None, 0
        if a.lease.resume_from.sha256:
            archive = job.workdir / "resume.tar"
            await self._cached(a.lease.resume_from, archive)
            resume_dir = await asyncio.to_thread(checkpoints.unpack, archive,
                                                 job.workdir / "resume")
            step = checkpoints.step_of(resume_dir)
            job.uploaded_step = step
            archive.unlink()
        cuda = any(d.is_cuda for d in self._devices_of(job))
        model = required_model(a.spec)
        spec = runner_config(a, paths, resume_dir, cuda,
                             local_models(self.config.models_dir).get(model) if model else None)
        (job.workdir / "job.json").write_text(json.dumps(spec, indent=2))
        return step

    def _devices_of(self, job: RunningJob) -> list[DeviceInfo]:
        return [d for d in self.devices if d.index in job.devices]

    async def _cached(self, ref: pb.ArtifactRef, target: Path) -> None:
        """Put a verified copy of an artifact at ``target`` (downloaded once per host)."""
        self.config.cache_dir.mkdir(parents=True, exist_ok=True)
        cached = self.config.cache_dir / ref.sha256
        if not cached.exists():
            await self._with_broker(lambda: self.artifacts.download(ref, cached))
            self.send(gw.ProviderMessage(offer=self.offer()))  # it now holds this artifact
        target.unlink(missing_ok=True)
        try:
            target.hardlink_to(cached)
        except OSError:
            shutil.copyfile(cached, target)

    async def _with_broker(self, call, attempts: int = 10):
        """Run an artifact call, waiting out broker outages of up to a minute or so."""
        while self.artifacts is None and not self.stopping.is_set():
            await asyncio.sleep(0.2)    # the first connection is not made yet
        for i in range(attempts):
            try:
                return await call()
            except Unavailable:
                if i == attempts - 1 or self.stopping.is_set():
                    raise
                await asyncio.sleep(min(0.5 * 2 ** i, 8))

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
        elif event == "log" and isinstance(report.get("lines"), list):
            lines = [str(line)[:LOG_LINE_CHARS]
                     for line in report["lines"][:LOG_LINES_PER_UPDATE]]
            self.send(self._update(job, log=gw.JobLog(lines=lines)))
        elif event == "checkpoint":
            path = PurePosixPath(str(report.get("path", "")))
            if path.is_absolute():
                if not path.is_relative_to(job.workdir):
                    log.warning("job %s reported a checkpoint outside its work dir", job.key[0])
                    return
                path = path.relative_to(job.workdir)
            job.pending_checkpoint = (int(report.get("step", 0)), str(path),
                                      float(report.get("write_seconds", 0.0)))
            if job.uploader is None or job.uploader.done():
                job.uploader = asyncio.create_task(self._upload_checkpoints(job))

    async def _upload_checkpoints(self, job: RunningJob) -> None:
        """Upload the newest pending checkpoint (older pending ones are skipped)."""
        while job.pending_checkpoint is not None:
            step, path, write_s = job.pending_checkpoint
            job.pending_checkpoint = None
            if step <= job.uploaded_step:
                continue
            upload_dir = job.workdir / "upload"
            upload_dir.mkdir(exist_ok=True)
            tar = upload_dir / f"step-{step:08d}.tar"
            try:
                await asyncio.to_thread(self._pack, job, path, tar)
                ref = await self._with_broker(
                    lambda: self.artifacts.upload(tar, "checkpoint.tar"))
            except GpumarketError as exc:
                log.warning("job %s: checkpoint at step %d not uploaded: %s", job.key[0], step,
                            exc)
                continue
            finally:
                tar.unlink(missing_ok=True)
            job.uploaded_step = step
            job.checkpoint_report = self._update(job, checkpoint=gw.CheckpointReport(
                step=step, artifact=ref, write_seconds=write_s))
            self.send(job.checkpoint_report)
            await asyncio.to_thread(self._drop_older_checkpoints, job, path)

    def _pack(self, job: RunningJob, rel: str, tar: Path) -> None:
        """Pack the job's checkpoint ``rel`` (walked from the work directory without
        following links: the job may have swapped it for a link since it reported it)."""
        owner = self._job_uid(job)
        root = jobfiles.open_dir(job.workdir)
        try:
            ckpt = jobfiles.open_beneath(root, rel, directory=True)
        finally:
            os.close(root)
        try:
            checkpoints.pack(ckpt, tar, owner, PurePosixPath(rel).name)
        finally:
            os.close(ckpt)

    def _drop_older_checkpoints(self, job: RunningJob, rel: str) -> None:
        """Remove the job's checkpoints older than the one just uploaded (names sort by
        step; newer ones may be in progress), inside its own checkpoints directory only."""
        newest = PurePosixPath(rel)
        try:
            root = jobfiles.open_dir(job.workdir)
            try:
                parent = jobfiles.open_beneath(root, str(newest.parent), directory=True)
            finally:
                os.close(root)
        except (OSError, jobfiles.JobFileError):
            return
        try:
            for name in os.listdir(parent):
                if name.startswith("step-") and name < newest.name:
                    shutil.rmtree(name, ignore_errors=True, dir_fd=parent)
        finally:
            os.close(parent)

    async def _receipt(self, job: RunningJob, done: dict, wall_seconds: float) -> pb.Envelope:
        a = job.assignment
        outputs = []
        # The job may have swapped outputs/ or a file in it for a link to anything the
        # daemon can read: take only the job's own plain files, read through descriptors.
        owner = self._job_uid(job)
        root = jobfiles.open_dir(job.workdir)
        try:
            with jobfiles.plain_files(root, "outputs", owner) as files:
                for name, fd in files:
                    ref = await self._with_broker(
                        lambda fd=fd, name=name: self.artifacts.upload(fd, name))
                    outputs.append(ref)
        finally:
            os.close(root)
        metrics = {k: float(v) for k, v in (done.get("metrics") or {}).items()
                   if isinstance(v, (int, float))}
        receipt = pb.Receipt(
            job_id=a.lease.job_id, lease_id=a.lease.lease_id, attempt=a.lease.attempt,
            epoch=a.lease.epoch, provider_id=self.identity.id, spec_sha256=a.spec_sha256,
            outputs=outputs, wall_seconds=wall_seconds,
            device_seconds=wall_seconds * len(a.lease.device_indices),
            metrics=metrics, finished_at_ms=now_ms())
        return seal(self.identity, receipt)

    # -- what the broker says ------------------------------------------------------------

    async def _cancel(self, cancel: gw.CancelLease) -> None:
        job = self.jobs.get(cancel.job_id)
        if job is None or job.key[1] != cancel.epoch:
            return
        log.info("job %s stopped by the broker: %s", cancel.job_id, cancel.reason)
        job.cancelled = True
        self.unsettled.pop(job.key, None)
        if job.process is not None:
            await job.process.stop(cancel.reason)
        if job.task is not None and not job.task.done():
            job.task.cancel()
        await self._forget(job)

    async def _settled(self, settled: gw.UpdateSettled) -> None:
        key = (settled.job_id, settled.epoch)
        self.unsettled.pop(key, None)
        job = self.jobs.get(settled.job_id)
        if job is not None and job.key == key:
            if not settled.accepted:
                log.warning("broker refused the result of job %s: %s", settled.job_id,
                            settled.reason)
            await self._forget(job)

    async def _forget(self, job: RunningJob) -> None:
        if self.jobs.get(job.key[0]) is job:
            del self.jobs[job.key[0]]
        if job.uploader is not None:
            job.uploader.cancel()
        await asyncio.to_thread(self.journal.remove, *job.key)
        shutil.rmtree(job.workdir, ignore_errors=True)

    async def _stop_jobs(self, reason: str) -> None:
        for job in list(self.jobs.values()):
            job.cancelled = True
            if job.process is not None:
                await job.process.stop(reason)
            for task in (job.task, job.uploader):
                if task is not None:
                    task.cancel()
        for task in list(self._background):
            task.cancel()
        await self.warm.close()

    async def _refill_warm(self, kind: int) -> None:
        """Keep one idle runner of ``kind`` with its imports done, ready for the next lease."""
        if kind in WARM_KINDS and not (self.stopping.is_set() or self.draining):
            await self.warm.refill(RUNNERS[kind].rsplit(".", 1)[1])

    def _take_warm(self, kind: int) -> asyncio.subprocess.Process | None:
        proc = self.warm.take(RUNNERS[kind].rsplit(".", 1)[1])
        self._spawn(self._refill_warm(kind))
        return proc

    # -- after a restart -----------------------------------------------------------------

    async def _recover(self) -> None:
        """Re-attach to jobs that outlived the previous daemon, finish or give back the
        ones that ended meanwhile, and clean up what no journal entry accounts for."""
        entries = await asyncio.to_thread(self.journal.entries)
        attached: set[int] = set()
        for e in entries:
            assignment = recovery.assignment_of(e)
            if assignment is None:
                await asyncio.to_thread(self.journal.remove, e.job_id, e.epoch)
                continue
            lease = assignment.lease
            job = RunningJob(assignment, Path(e.workdir))
            self.jobs[lease.job_id] = job
            if e.final is not None:
                self.unsettled[job.key] = gw.ProviderMessage.FromString(e.final)
                log.info("job %s: re-sending its final update", lease.job_id)
            elif e.pid and pid_runs_in(e.pid, job.workdir):
                attached.add(e.pid)
                job.process = self._process(job)
                job.process.attach(e.pid)
                job.task = asyncio.create_task(self._reattached(job))
                log.info("job %s: re-attached to its running process %d", lease.job_id, e.pid)
            else:
                done = [r for r in read_reports(job.workdir, self._job_uid(job))
                        if r.get("event") == "done"]
                if done:
                    job.task = asyncio.create_task(self._finished_meanwhile(job, done[-1]))
                else:
                    log.warning("job %s: its process ended while the daemon was down",
                                lease.job_id)
                    await self._finalize(job, self._update(job, released=gw.JobReleased(
                        reason="job process ended while the provider daemon was down")))
        recovery.kill_orphans(self.config.jobs_dir, attached)
        following = [j for j in self.jobs.values() if j.process is not None]
        await asyncio.to_thread(
            recovery.end_strays, self.cgroups, {j.workdir.name for j in following},
            self.uids, {self._job_uid(j) for j in following})
        known = {Path(e.workdir).name for e in entries}
        if self.config.jobs_dir.is_dir():
            for d in self.config.jobs_dir.iterdir():
                if d.name not in known:
                    shutil.rmtree(d, ignore_errors=True)

    async def _reattached(self, job: RunningJob) -> None:
        ckpts = [r for r in read_reports(job.workdir, self._job_uid(job))
                 if r.get("event") == "checkpoint"]
        if ckpts:
            await self._on_report(job, ckpts[-1])
        final = await self._follow(job)
        if final is not None and not job.cancelled:
            await self._finalize(job, final)

    async def _finished_meanwhile(self, job: RunningJob, done: dict) -> None:
        try:
            seconds = float((done.get("metrics") or {}).get("train_seconds", 0.0))
            final = self._update(job, receipt=await self._receipt(job, done, seconds))
        except GpumarketError as exc:
            final = self._update(job, failed=gw.JobFailed(error=str(exc)))
        await self._finalize(job, final)
