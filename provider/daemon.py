"""The provider daemon: a session with the broker (provider/session.py), one attempt per
leased job (provider/attempt.py), and what survives a restart (provider/recovery.py). It
keeps each job's final update (in memory and in the journal) until the broker settles it.
SIGTERM drains: every job checkpoints now, uploads, and gives its lease back, then it exits.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

from gpumarket import kinds
from gpumarket.kinds.engine_protocol import Final, encode_answer
from gpumarket.proto.errors import GpumarketError, InvalidArgument, Unavailable
from gpumarket.proto.identity import Identity
from gpumarket.proto.slices import overlapping
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider import recovery
from gpumarket.provider.attempt import Attempt
from gpumarket.provider.cache import ArtifactCache
from gpumarket.provider.config import ProviderConfig
from gpumarket.provider.forkservers import ForkServers
from gpumarket.provider.inventory import (
    DeviceInfo,
    busy,
    inference_engines,
    local_models,
)
from gpumarket.provider.isolation import Isolation
from gpumarket.provider.journal import Journal
from gpumarket.provider.leases import check_lease, refusal, rejection
from gpumarket.provider.offering import build_offer, runnable_kinds
from gpumarket.provider.session import BrokerSession

log = logging.getLogger(__name__)

MAX_PREEMPT_GRACE_S = 600.0     # the longest a preempted job is given to checkpoint


class ProviderDaemon:
    def __init__(self, config: ProviderConfig, identity: Identity, devices: list[DeviceInfo],
                 benchmarks: dict[int, pb.Benchmark]) -> None:
        self.config = config
        self.identity = identity
        self.devices = devices
        self.benchmarks = benchmarks
        self.engines = inference_engines(any(d.is_cuda for d in devices))
        self.kinds = runnable_kinds(config, self.engines)
        self.jobs: dict[str, Attempt] = {}
        self.stopping_jobs: set[tuple[str, int]] = set()  # told to stop, not stopped yet
        self.unsettled: dict[tuple[str, int], gw.ProviderMessage] = {}
        self.stopping = asyncio.Event()
        self.draining = False
        self.journal = Journal(config.data_dir / "journal.db")
        self.forks = ForkServers(config.jobs_dir, config.warm_runners)
        self.isolation = Isolation()
        self.session = BrokerSession(config, identity, self)
        # A new cached artifact is re-offered: jobs that need it prefer this provider.
        self.cache = ArtifactCache(config.cache_dir, self._with_broker,
                                   lambda: self.send(gw.ProviderMessage(offer=self.offer())))
        self._background: set[asyncio.Task] = set()

    # -- for the session: what it offers, runs and owes; what the broker says -------------

    def offer(self) -> pb.Envelope:
        return build_offer(self.config, self.identity, self.devices, self.benchmarks,
                           self.offered_kinds(), self.engines,
                           self.isolation.runs_code(self.config),
                           self.isolation.job_limits(self.devices))

    def offered_kinds(self) -> set[int]:
        """The kinds it runs, less those running the client's own code where the host
        cannot isolate it."""
        isolates = self.isolation.isolates_code(self.config)
        return {k for k in self.kinds if isolates or not kinds.get(k).opt_in}

    def running(self) -> list[tuple[str, int]]:
        # Not a job whose final update went (it ended; its lease ends with that update,
        # which the stream carries ahead of this heartbeat).
        return [job.key for job in self.jobs.values() if job.key not in self.unsettled]

    def pending(self) -> list[gw.ProviderMessage]:
        # A lease's task results go before its final update (which the broker settles only
        # after them: the stream keeps their order).
        return [j.checkpoints.report for j in self.jobs.values() if j.checkpoints.report] + [
            m for j in self.jobs.values() for m in j.task_results.pending()] + [
            j.update(ready=j.engine.ready) for j in self.jobs.values()
            if j.engine is not None and j.engine.ready is not None] + [
            *self.unsettled.values()]

    def on_infer(self, request: gw.InferenceRequest) -> None:
        job = self.jobs.get(request.job_id)
        why = "no such replica on this provider"
        if job is not None and job.key[1] == request.epoch and job.engine is not None:
            why = job.engine.forward(request)
        if why:
            self.send(gw.ProviderMessage(chunk=gw.InferenceChunk(
                request_id=request.request_id, last=True,
                data=encode_answer(Final.failed(why, 503)))))

    def on_infer_cancel(self, cancel: gw.InferenceCancel) -> None:
        job = self.jobs.get(cancel.job_id)
        if job is not None and job.key[1] == cancel.epoch and job.engine is not None:
            job.engine.cancel(cancel.request_id)

    async def on_lease(self, envelope: pb.Envelope) -> None:
        try:
            if self.draining:
                raise Unavailable("provider is draining")
            # Not a device leased, nor a card with a slice leased, nor a slice of a card
            # leased whole (inventory.busy).
            taken = busy(self.devices, {i for j in self.jobs.values() for i in j.devices})
            assignment = check_lease(
                envelope, broker_public_key=self.session.broker_key or b"",
                provider_id=self.identity.id,
                device_indices={d.index for d in self.devices} - taken,
                kinds=self.offered_kinds(), engines=self.engines,
                models=frozenset(local_models(self.config.models_dir)),
                policy=self.config.policy, runs_code=self.isolation.runs_code(self.config))
            if overlapping([(d.index, d.slice_of) for d in self.devices],
                           assignment.lease.device_indices):
                raise InvalidArgument("lease names a device and a slice of it, or two slices"
                                      " of one device")
        except GpumarketError as exc:
            log.warning("refused a lease: %s", refusal(exc))
            if answer := rejection(envelope, self.session.broker_key, refusal(exc)):
                self.send(answer)
            return
        lease = assignment.lease
        job = Attempt(assignment, self.config.jobs_dir / f"{lease.job_id}.{lease.epoch}", self)
        self.jobs[lease.job_id] = job
        await asyncio.to_thread(self.journal.add, lease.job_id, lease.epoch,
                                envelope.SerializeToString(), str(job.workdir))
        job.begin()
        log.info("job %s (%s) leased, attempt %d", lease.job_id, job.kind.name, lease.attempt)

    async def on_cancel(self, cancel: gw.CancelLease) -> None:
        job = self.jobs.get(cancel.job_id)
        if job is None or job.key[1] != cancel.epoch or job.key in self.stopping_jobs:
            return
        log.info("job %s stopped by the broker: %s", cancel.job_id, cancel.reason)
        self.unsettled.pop(job.key, None)
        # Stopping takes the job's grace period and more: the session reads on meanwhile
        # (a lease read seconds late is lost to missed heartbeats). Until it has stopped the
        # job is listed in heartbeats and its devices stay taken.
        self.stopping_jobs.add(job.key)
        self._spawn(self._stop(job, cancel.reason))

    async def _stop(self, job: Attempt, reason: str) -> None:
        try:
            await job.stop(reason)
        finally:
            self.stopping_jobs.discard(job.key)
            await self._forget(job)

    def on_yield(self, request: gw.YieldLease) -> None:
        job = self.jobs.get(request.job_id)
        if job is not None and job.key[1] == request.epoch:
            log.info("job %s asked to %s: %s", request.job_id,
                     "split" if request.split else "yield after its current task",
                     request.reason)
            job.request_yield(request.min_left_s, split=request.split)

    def on_preempt(self, request: gw.PreemptLease) -> None:
        """A job of a higher tier needs the devices of this interruptible lease: the job
        checkpoints now and stops (as in a drain), within the grace period the broker gives
        (at most MAX_PREEMPT_GRACE_S), and the lease is released (the broker ends it
        PREEMPTED; the job resumes elsewhere from that checkpoint)."""
        job = self.jobs.get(request.job_id)
        if job is None or job.key[1] != request.epoch or job.key in self.stopping_jobs:
            return
        if job.assignment.spec.tier != pb.TIER_INTERRUPTIBLE:
            log.warning("broker asked job %s, not interruptible, to yield; ignored",
                        request.job_id)
            return
        grace = min(float(request.grace_s) or MAX_PREEMPT_GRACE_S, MAX_PREEMPT_GRACE_S)
        log.info("job %s preempted (%s): checkpoint within %.0fs, then release",
                 request.job_id, request.reason[:200], grace)
        job.request_preempt(grace, request.reason[:200] or "preempted")

    async def on_settled(self, settled: gw.UpdateSettled) -> None:
        key = (settled.job_id, settled.epoch)
        self.unsettled.pop(key, None)
        job = self.jobs.get(settled.job_id)
        if job is not None and job.key == key:
            if not settled.accepted:
                log.warning("broker refused the result of job %s: %s", settled.job_id,
                            settled.reason)
            await self._forget(job)

    def on_tasks_settled(self, settled: gw.TaskResultsSettled) -> None:
        job = self.jobs.get(settled.job_id)
        if job is not None and job.key == (settled.job_id, settled.epoch):
            job.task_results.settled(settled)

    async def _forget(self, job: Attempt) -> None:
        """The job is over: its devices are free now; its journal entry and work directory
        go in the background (a large array lease's directory takes a while to remove, and
        the session's reader must not wait for it; a restart sweeps what is left)."""
        if self.jobs.get(job.key[0]) is job:
            del self.jobs[job.key[0]]
        self._spawn(self._remove(job))

    async def _remove(self, job: Attempt) -> None:
        await asyncio.to_thread(self.journal.remove, *job.key)
        await asyncio.to_thread(shutil.rmtree, job.workdir, ignore_errors=True)

    # -- for attempts: the broker, the cache, the journal ------------------------------

    def send(self, message: gw.ProviderMessage) -> None:
        self.session.send(message)

    @property
    def update_receipts(self) -> bool:
        """Whether the broker takes one receipt for a task results update (task_results)."""
        return self.session.update_receipts

    async def fetch(self, ref: pb.ArtifactRef, target: Path) -> None:
        await self.cache.put(ref, target)

    async def upload(self, source: Path | int, name: str,
                     digest: tuple[str, int] | None = None) -> pb.ArtifactRef:
        return await self._with_broker(lambda a: a.upload(source, name, digest=digest))

    async def upload_blobs(self, blobs: list[tuple[str, bytes]]) -> list:
        return await self._with_broker(lambda a: a.upload_blobs(blobs))

    async def _with_broker(self, call):
        return await self.session.with_broker(call, self.stopping)

    async def started(self, job: Attempt, pid: int) -> None:
        await asyncio.to_thread(self.journal.set_pid, *job.key, pid)

    async def finished(self, job: Attempt, final: gw.ProviderMessage) -> None:
        """Keep the final update until the broker settles it, across reconnects and restarts."""
        self.unsettled[job.key] = final
        await asyncio.to_thread(self.journal.set_final, *job.key, final.SerializeToString())
        self.send(final)

    # -- lifetime --------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until stopped (after a drain, or at once by stop()); then end every job."""
        self.isolation = await asyncio.to_thread(Isolation.prepare, self.config,
                                                 self.identity.id)
        await recovery.restore(self)    # first: it kills what it finds of an earlier daemon
        for kind in [k for k in map(kinds.get, self.kinds) if k.warm]:
            await self.forks.start(kind.runner, kind.runner_path)
        try:
            await self.session.run(self.stopping)
        finally:
            for job in list(self.jobs.values()):
                await job.stop("provider is shutting down")
            for task in list(self._background):
                task.cancel()
            await self.forks.close()
            self.journal.close()
            if self.isolation.cgroups:
                self.isolation.cgroups.remove()     # empty now: every job was ended

    def stop(self) -> None:
        """Stop now: jobs are killed and their leases lapse."""
        self.forks.closing = True
        self.stopping.set()

    def request_drain(self) -> None:
        self._spawn(self.drain())

    async def drain(self) -> None:
        """Checkpoint every job now, upload, give the leases back, then stop."""
        if self.draining:
            return
        self.draining = self.forks.closing = True
        log.info("draining %d jobs: checkpoint, upload, release", len(self.jobs))
        self.send(self.session.heartbeat())
        for job in list(self.jobs.values()):
            job.request_drain()
        tasks = [j.task for j in self.jobs.values() if j.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.drain_timeout_s)
        deadline = time.monotonic() + 15     # the broker's acknowledgements of the releases
        while self.unsettled and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.unsettled:
            log.warning("%d job updates were not acknowledged before exit", len(self.unsettled))
        self.stopping.set()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
