"""One job attempt on this provider, from its lease to its final update: fetch its inputs
and the checkpoint it resumes from, start it in its sandbox, turn its reports into
progress, log and checkpoint updates, and end with a signed receipt, a failure, or a
release. What it needs of the daemon is a ``Host``. Its parts live beside it: a job
array's task results (task_results), checkpoint uploads (checkpoint_upload), outputs and
the receipt (receipts), and taking it up again after a daemon restart (reattach)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Protocol

from gpumarket import kinds
from gpumarket.proto.errors import GpumarketError
from gpumarket.proto.identity import Identity
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider import checkpoints, failures, receipts
from gpumarket.provider.checkpoint_upload import CheckpointUploads
from gpumarket.provider.config import ProviderConfig
from gpumarket.provider.executor import JobProcess, job_env, job_priority, slice_env
from gpumarket.provider.forkservers import ForkServers
from gpumarket.provider.inventory import DeviceInfo, local_models
from gpumarket.provider.isolation import Isolation
from gpumarket.provider.leases import Assignment, runner_config
from gpumarket.provider.replica import EngineLink
from gpumarket.provider.reports import (Checkpoint, Done, Log, Progress, Report, Split,
                                        TaskEnded)
from gpumarket.provider.task_results import TaskResults

log = logging.getLogger(__name__)


class Host(Protocol):
    """What an attempt asks of the daemon that runs it."""

    config: ProviderConfig
    identity: Identity
    isolation: Isolation
    devices: list[DeviceInfo]
    draining: bool
    forks: ForkServers | None      # the kinds' forkservers; None: every job starts cold
    update_receipts: bool          # the broker takes one receipt a task results update

    def send(self, message: gw.ProviderMessage) -> None: ...
    async def fetch(self, ref: pb.ArtifactRef, target: Path) -> None: ...
    async def upload(self, source: Path | int, name: str,
                     digest: tuple[str, int] | None = None) -> pb.ArtifactRef: ...
    async def upload_blobs(self, blobs: list[tuple[str, bytes]]) -> list: ...
    async def started(self, attempt: "Attempt", pid: int) -> None: ...
    async def finished(self, attempt: "Attempt", final: gw.ProviderMessage) -> None: ...


class Attempt:
    def __init__(self, assignment: Assignment, workdir: Path, host: Host) -> None:
        self.assignment = assignment
        self.workdir = workdir
        self.host = host
        self.kind = kinds.get(assignment.spec.kind)
        self.process: JobProcess | None = None
        self.cancelled = False
        self.task: asyncio.Task | None = None
        self.last_progress = 0.0
        self.engine: EngineLink | None = None    # an endpoint replica's engine
        self.checkpoints = CheckpointUploads(workdir, self.job_uid, host, self.update)
        self.task_results = TaskResults(assignment.lease.tasks, workdir, self.job_uid,
                                        host, self.update, self.sign_tasks)  # an array's
        self.yield_asked = False            # the broker asked the lease to yield ...
        self.yield_min_left_s = 0.0         # ... if what is left takes this long (a steal)
        self.yield_sent = False             # ... and the runner was told
        self.yield_split = False            # ... to split, not stop (YieldLease.split)
        self.preempted = ""                 # why the broker preempted this lease, if it did
        self._grace: asyncio.TimerHandle | None = None
        self._grace_stop: asyncio.Task | None = None

    @property
    def key(self) -> tuple[str, int]:
        return self.assignment.lease.job_id, self.assignment.lease.epoch

    @property
    def devices(self) -> set[int]:
        return set(self.assignment.lease.device_indices)

    @property
    def job_uid(self) -> int:
        return self.host.isolation.job_uid(self.devices)

    def update(self, **fields) -> gw.ProviderMessage:
        job_id, epoch = self.key
        return gw.ProviderMessage(job_update=gw.JobUpdate(job_id=job_id, epoch=epoch, **fields))

    def _devices(self) -> list[DeviceInfo]:
        return [d for d in self.host.devices if d.index in self.devices]

    # -- the whole attempt ---------------------------------------------------------------

    def begin(self) -> asyncio.Task:
        self.task = asyncio.create_task(self.run())
        return self.task

    async def run(self) -> None:
        job_id = self.key[0]
        final = None
        try:
            resumed_from = await self.prepare()
            if self.cancelled:
                return
            if self.host.draining or self.preempted:
                final = self.update(released=gw.JobReleased(reason=self.release_reason))
            else:
                self.process = self.new_process(self.host.forks)
                pid = await self.process.start()
                if self.preempted:      # asked while it was starting: ask it now
                    self.process.request_drain()
                if self.engine is not None:
                    await self.engine.start()
                await self.host.started(self, pid)
                self.host.send(self.update(started=gw.JobStarted(
                    resumed_from_step=resumed_from)))
                final = await self.follow()
        except asyncio.CancelledError:
            raise
        except GpumarketError as exc:
            final = self.update(failed=self.failure(str(exc)))
            log.warning("job %s failed: %s", job_id, exc)
        except Exception:
            log.exception("job %s failed in the provider", job_id)
            final = self.update(failed=self.failure("provider error while running"))
        finally:
            # However it ended (the daemon's own code failing after the start included),
            # nothing of the job runs on once its device is told free.
            if self.process is not None:
                try:
                    await self.process.end()
                except Exception:   # the next job on its devices ends what is left first
                    log.exception("job %s: not all of it could be ended", job_id)
        if final is not None and not self.cancelled:
            await self.host.finished(self, final)

    async def prepare(self) -> int:
        """Fetch inputs and the checkpoint to resume from; write job.json. Returns the step
        the job resumes from (0 for a fresh start)."""
        a = self.assignment
        inputs_dir = self.workdir / "inputs"
        inputs_dir.mkdir(parents=True, exist_ok=True)
        paths = {}
        for ref in a.spec.inputs:
            target = inputs_dir / ref.name
            await self.host.fetch(ref, target)
            paths[ref.name] = str(target)
        resume_dir, step = None, 0
        if a.lease.resume_from.sha256:
            archive = self.workdir / "resume.tar"
            await self.host.fetch(a.lease.resume_from, archive)
            resume_dir = await asyncio.to_thread(checkpoints.unpack, archive,
                                                 self.workdir / "resume")
            step = checkpoints.step_of(resume_dir)
            self.checkpoints.uploaded_step = step
            archive.unlink()
        cuda = any(d.is_cuda for d in self._devices())
        model = self.kind.model_name(self.kind.values_of(a.spec))
        models_dir = self.host.config.models_dir
        job = runner_config(a, paths, resume_dir, cuda,
                            local_models(models_dir).get(model) if model else None)
        if a.lease.check.claimed.sha256:
            # a check by fingerprints: the checked provider's completions, whose tokens it
            # prefills (docs/verification.md)
            claimed = self.workdir / "claimed.jsonl"
            await self.host.fetch(a.lease.check.claimed, claimed)
            job = dataclasses.replace(job, check_claimed=str(claimed))
        (self.workdir / "job.json").write_text(job.to_json())
        return step

    def new_process(self, forks: ForkServers | None = None) -> JobProcess:
        """The job's process, to start (forked by ``forks`` where its kind has a
        forkserver; an endpoint's always cold, with its engine link) or to re-attach to."""
        config, devices = self.host.config, self._devices()
        cuda = any(d.is_cuda for d in devices)
        per_task = max(1, len(self.assignment.lease.tasks))  # an array's limit is per task
        limit = min((self.assignment.spec.max_runtime_s * per_task) or config.max_runtime_s,
                    config.max_runtime_s)
        # A CPU lease's threads are its cores: as many threads as the job's CPU quota. More
        # (torch's default, all of the host's) oversubscribe the cores beside other leases
        # or providers, where OpenMP's spin-waits make small ops many times slower.
        threads = None if cuda else sum(d.cpu_cores for d in devices) or None
        env = job_env(self.workdir, ",".join(d.visible_id for d in devices) if cuda else "",
                      threads)
        env.update(slice_env(devices))      # its cores, or its share of a GPU
        if self.kind.runner_path:    # a plugin's runner, imported from where the plugin was
            env["PYTHONPATH"] = os.pathsep.join(self.kind.runner_path)
        box, group = self.host.isolation.for_job(config, self.workdir, devices,
                                                 self.host.devices)
        stdin = None
        if self.kind.serves:
            self.engine = EngineLink(self.host.send, self.on_ready)
            stdin = self.engine.child_fd
        return JobProcess(self.kind.runner, self.workdir, env, self.on_report, limit,
                          config.cancel_grace_s, forks, box,
                          int(config.job_disk_gib * 2**30), group, stdin,
                          job_priority(self.assignment.spec.tier, self.kind.serves))

    def on_ready(self, ready: gw.ReplicaReady) -> None:
        log.info("replica %s ready: %s", self.key[0], ready.engine)
        self.host.send(self.update(ready=ready))

    async def follow(self) -> gw.ProviderMessage | None:
        """Follow the job process to its end; return the final update (None if cancelled)."""
        job_id = self.key[0]
        try:
            outcome = await self.process.run()
        finally:
            if self.engine is not None:
                self.engine.close()
            await self.task_results.settle(dropped=self.cancelled)
        if self.cancelled:
            return None
        if outcome.succeeded:
            self.checkpoints.cancel()
            log.info("job %s succeeded in %.1fs", job_id, outcome.wall_seconds)
            return self.update(receipt=await self.receipt(outcome.done, outcome.wall_seconds))
        if outcome.drained or self.host.draining or self.preempted:
            # Also a job that died of the drain request itself (or was stopped when its
            # preemption's grace ran out): it resumes elsewhere from its last uploaded
            # checkpoint rather than failing.
            await self.checkpoints.finish()
            log.info("job %s %s at step %d", job_id,
                     "preempted" if self.preempted else "drained",
                     self.checkpoints.uploaded_step)
            return self.update(released=gw.JobReleased(reason=self.release_reason))
        self.checkpoints.cancel()
        log.warning("job %s failed: %s", job_id, outcome.error)
        return self.update(failed=self.failure(outcome.error, outcome.exit_code, ran=True))

    def failure(self, error: str, exit_code: int | None = None,
                ran: bool | None = None) -> gw.JobFailed:
        """The failed update, with this provider's signed report (provider/failures.py);
        ``ran``: the job's own process ran (default: it was started)."""
        ran = self.process is not None and self.process.pid is not None if ran is None else ran
        return failures.failed(self.host.identity, self.assignment, error, ran=ran,
                               exit_code=exit_code, workdir=self.workdir, owner=self.job_uid)

    # -- what the job reports --------------------------------------------------------------

    async def on_report(self, report: Report) -> None:
        """Pass on what the job reported (checked by provider/reports.py: in range, and a
        checkpoint's path a plain path inside its work directory)."""
        if isinstance(report, Progress):
            now = time.monotonic()
            if (now - self.last_progress < self.host.config.progress_interval_s
                    and report.step < report.total):
                return
            self.last_progress = now
            self.host.send(self.update(progress=pb.Progress(
                step=report.step, total=report.total, metrics=report.metrics)))
        elif isinstance(report, Log):
            self.host.send(self.update(log=gw.JobLog(lines=report.lines)))
        elif isinstance(report, TaskEnded):
            self.task_ended(report)
        elif isinstance(report, Split):
            self.split_answered(report)
        elif isinstance(report, Checkpoint):
            self.checkpoints.reported(report.step, report.path, report.write_seconds)

    def task_ended(self, report: TaskEnded) -> None:
        """A task of a job array's lease ended: passed on by ``tasks``; a yield the broker
        asked for goes to the runner now that it listens (it has reported)."""
        if self.task_results.ended(report) and self.yield_asked and not self.yield_sent:
            self.tell_yield()

    def request_yield(self, min_left_s: float = 0.0, split: bool = False) -> None:
        """The broker asks this job array's lease to stop after the task it runs now (another
        client waits for its device, or a lane of its array is idle): it ends with its
        receipt for the tasks it ran. With ``split`` (a steal) it goes on instead, and gives
        the later part of its tasks not started to another lease (``split_answered``). With
        ``min_left_s`` (a steal) only if the tasks it has not run yet would take it that
        long at its pace (``TaskResults.left_s``): the broker counted the tasks not
        reported, those this daemon holds among them; declined, the lease runs them out (a
        later ask decides again). The runner is told once it has reported a task: before
        that it may not be listening. A stop asked while a split is (its answer not come)
        is told at once: a split frees no device."""
        if not self.assignment.lease.tasks or (self.yield_asked or self.yield_sent) and (
                split or not self.yield_split):
            return
        if split and self.task_results.giving_back():
            # Asked before the broker recorded the tasks its last split gave (it asks while
            # they are marked; the acknowledgement comes after any such ask): stale. A later
            # ask splits again, on what the broker marks once that is recorded.
            return
        told = self.yield_sent
        self.yield_asked, self.yield_sent = True, False
        self.yield_split = split
        self.yield_min_left_s = max(0.0, min_left_s) if min_left_s == min_left_s else 0.0
        if told or len(self.task_results.open) < len(self.assignment.lease.tasks):
            self.tell_yield()

    def tell_yield(self) -> None:
        if self.process is None:
            return
        left = self.task_results.left_s()
        if self.yield_min_left_s and left is not None and left < self.yield_min_left_s:
            log.info("job %s does not yield: %d tasks left, %.2fs at its pace, under the"
                     " %.2fs a steal needs", self.assignment.lease.job_id,
                     len(self.task_results.open), left, self.yield_min_left_s)
            self.yield_asked = False
            return
        self.yield_sent = True
        if self.yield_split:
            log.info("job %s splits: %d tasks not reported", self.assignment.lease.job_id,
                     len(self.task_results.open))
            self.process.request_split()
            return
        log.info("job %s yields after its current task: %d tasks not run go back",
                 self.assignment.lease.job_id, max(0, len(self.task_results.open) - 1))
        self.process.request_yield()
        self.task_results.yielding()

    def split_answered(self, report: Split) -> None:
        """The runner answered a split: its tasks from ``from_task`` on (in the lease's
        order) go back to the broker now, in an update of their own (TaskResults.yielded),
        and the lease runs the rest; a later ask may split it again."""
        if not (self.yield_sent and self.yield_split):
            return          # asked nothing: a runner's own line changes nothing
        self.yield_asked = self.yield_sent = self.yield_split = False
        given = self.task_results.give_back(report.from_task, self.assignment.lease.tasks)
        log.info("job %s gives %d tasks not started to another lease",
                 self.assignment.lease.job_id, len(given))

    # -- its outputs -----------------------------------------------------------------------

    async def receipt(self, done: Done, wall_seconds: float) -> pb.Envelope:
        """Upload the job's outputs and sign the receipt for them. A job array's lease names
        none: each task's went up with its task results update's receipt (task_results)."""
        if self.assignment.lease.tasks:
            return self.sign([], wall_seconds, done.metrics)
        outputs = await receipts.upload_outputs(self.host, self.workdir, self.job_uid,
                                                [("outputs", None)])
        return self.sign(outputs, wall_seconds, done.metrics)

    def sign(self, outputs: list[pb.ArtifactRef], wall_seconds: float,
             metrics: dict[str, float] | None = None) -> pb.Envelope:
        return receipts.sign(self.host.identity, self.assignment, outputs, wall_seconds,
                             metrics)

    def sign_tasks(self, outputs: list[pb.ArtifactRef], wall_seconds: float,
                   tasks_root: bytes = b"") -> pb.Envelope:
        """The receipt for a task results update's tasks' outputs by their tree's root
        (kinds/receipt_tree.py), or for one task's ``outputs`` (a broker before issue 32);
        ``wall_seconds`` their seconds."""
        return receipts.sign(self.host.identity, self.assignment, outputs, wall_seconds,
                             tasks_root=tasks_root)

    # -- ending it -------------------------------------------------------------------------

    async def stop(self, reason: str) -> None:
        """Stop the job for good (cancelled by the broker, or the daemon is stopping)."""
        self.cancelled = True
        if self._grace is not None:
            self._grace.cancel()
        if self.process is not None:
            await self.process.stop(reason)
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self.checkpoints.cancel()

    @property
    def release_reason(self) -> str:
        return self.preempted or "provider is draining"

    def request_preempt(self, grace_s: float, reason: str) -> None:
        """The broker preempts this interruptible lease: the job is asked to checkpoint
        and stop, as in a drain (its runner, or the script's task.should_stop, sees the
        same request); one that has not stopped after ``grace_s`` is stopped, and the lease
        is released all the same, from its last uploaded checkpoint."""
        if self.preempted:
            return
        self.preempted = reason
        if self.process is not None:
            self.process.request_drain()
        self._grace = asyncio.get_running_loop().call_later(grace_s, self._grace_over)

    def _grace_over(self) -> None:
        if self.process is not None and not self.cancelled and self.process.alive():
            log.warning("job %s did not stop within its preemption's grace; stopping it",
                        self.key[0])
            self._grace_stop = asyncio.create_task(
                self.process.stop("preempted: its grace period is over"))

    def request_drain(self) -> None:
        if self.engine is not None:
            return      # a replica serves on: the broker starts its replacement, then stops it
        if self.process is not None:
            self.process.request_drain()
