"""One job attempt on this provider, from its lease to its final update: fetch its inputs
and the checkpoint it resumes from, start it in its sandbox, turn its reports into
progress, log and checkpoint updates (packing and uploading each checkpoint), and end with
a signed receipt, a failure, or a release. What it needs of the daemon is a ``Host``."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol

from gpumarket import kinds
from gpumarket.kinds import arrays
from gpumarket.proto.artifacts import CHUNK_BYTES, sha256_file
from gpumarket.proto.envelope import seal
from gpumarket.proto.errors import GpumarketError
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import check_artifact_name, now_ms
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider import checkpoints, failures, jobfiles
from gpumarket.provider.config import ProviderConfig
from gpumarket.provider.executor import JobProcess, job_env, read_reports
from gpumarket.provider.forkservers import ForkServers
from gpumarket.provider.inventory import DeviceInfo, local_models
from gpumarket.provider.isolation import Isolation
from gpumarket.provider.leases import Assignment, runner_config
from gpumarket.provider.replica import EngineLink
from gpumarket.provider.reports import Checkpoint, Done, Log, Progress, Report, TaskEnded
from gpumarket.provider.sandbox import kill_uid

log = logging.getLogger(__name__)

UPLOADS_AT_ONCE = 8        # a lease's output files in flight at once
FILES_AT_ONCE = 256        # a lease's output files open at once (beyond one directory's)
TASK_FLUSH_S = 0.2         # a job array's task results (and outputs) go at most this often ...
TASKS_PER_UPDATE = 1000    # ... this many to an update ...
UPDATE_BYTES = 1 << 20     # ... and this many bytes (receipts included)
FLUSH_TASKS = 1000         # tasks whose outputs go up together (one call for the small files)
FLUSH_BYTES = 32 << 20     # small files' bytes read with their hash for one flush (beyond:
                           # read again when sent, as a large file is)
BLOBS_PER_CALL = 1000      # small files in one UploadBlobs call ...
BLOB_CALL_BYTES = 16 << 20  # ... and their bytes
UPLOAD_TRIES = 5           # a flush's outputs are tried this often, waiting UPLOAD_BACKOFF_S,
UPLOAD_BACKOFF_S = 0.5     # doubling, between tries; then its tasks are reported failed


@dataclass(frozen=True)
class TaskOutput:
    """One file a task of a job array left in its outputs directory."""
    task: int
    name: str
    sha256: str
    size: int
    data: bytes | None          # a small file's bytes, read with its hash; None: read when sent


class Host(Protocol):
    """What an attempt asks of the daemon that runs it."""

    config: ProviderConfig
    identity: Identity
    isolation: Isolation
    devices: list[DeviceInfo]
    draining: bool
    forks: ForkServers | None      # the kinds' forkservers; None: every job starts cold

    def send(self, message: gw.ProviderMessage) -> None: ...
    async def fetch(self, ref: pb.ArtifactRef, target: Path) -> None: ...
    async def upload(self, source: Path | int, name: str,
                     digest: tuple[str, int] | None = None) -> pb.ArtifactRef: ...
    async def upload_blobs(self, blobs: list[tuple[str, bytes]]) -> list: ...
    async def started(self, attempt: "Attempt", pid: int) -> None: ...
    async def finished(self, attempt: "Attempt", final: gw.ProviderMessage) -> None: ...


def task_outputs(task: int) -> str:
    """Where an array task's outputs are, in its lease's work dir."""
    return f"tasks/{task:06d}/outputs"


class Attempt:
    def __init__(self, assignment: Assignment, workdir: Path, host: Host) -> None:
        self.assignment = assignment
        self.workdir = workdir
        self.host = host
        self.kind = kinds.get(assignment.spec.kind)
        self.process: JobProcess | None = None
        self.cancelled = False
        self.task: asyncio.Task | None = None
        self.uploader: asyncio.Task | None = None
        self.last_progress = 0.0
        self.pending_checkpoint: tuple[int, str, float] | None = None
        self.uploaded_step = 0
        self.checkpoint_report: gw.ProviderMessage | None = None   # the latest, re-sent
        self.engine: EngineLink | None = None    # an endpoint replica's engine
        self.tasks_open = set(assignment.lease.tasks)   # a job array's tasks not yet reported
        self.task_results: list[gw.TaskResult] = []
        self.task_flush: asyncio.TimerHandle | None = None
        self.to_upload: list[gw.TaskResult] = []    # tasks succeeded, their outputs to go up
        self.task_uploader: asyncio.Task | None = None
        self.flushed_at = 0.0               # when the last task outputs went up (monotonic)
        self.ending = asyncio.Event()       # the job's process ended: what is left goes now
        self.yield_asked = False            # the broker asked the lease to yield ...
        self.yield_sent = False             # ... and the runner was told

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
            if self.host.draining:
                final = self.update(released=gw.JobReleased(reason="provider is draining"))
            else:
                self.process = self.new_process(self.host.forks)
                pid = await self.process.start()
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
            self.uploaded_step = step
            archive.unlink()
        cuda = any(d.is_cuda for d in self._devices())
        model = self.kind.model_name(self.kind.values_of(a.spec))
        models_dir = self.host.config.models_dir
        spec = runner_config(a, paths, resume_dir, cuda,
                             local_models(models_dir).get(model) if model else None)
        (self.workdir / "job.json").write_text(json.dumps(spec, indent=2))
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
        env = job_env(self.workdir, ",".join(d.uuid for d in devices) if cuda else "", threads)
        if self.kind.runner_path:    # a plugin's runner, imported from where the plugin was
            env["PYTHONPATH"] = os.pathsep.join(self.kind.runner_path)
        box, group = self.host.isolation.for_job(config, self.workdir, devices,
                                                 self.host.devices)
        stdin = None
        if self.kind.name == "endpoint":
            self.engine = EngineLink(self.host.send, self.on_ready)
            stdin = self.engine.child_fd
        return JobProcess(self.kind.runner, self.workdir, env, self.on_report, limit,
                          config.cancel_grace_s, forks, box,
                          int(config.job_disk_gib * 2**30), group, stdin)

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
            await self.settle_tasks()
        if self.cancelled:
            return None
        if outcome.succeeded:
            if self.uploader is not None:
                self.uploader.cancel()
            log.info("job %s succeeded in %.1fs", job_id, outcome.wall_seconds)
            return self.update(receipt=await self.receipt(outcome.done, outcome.wall_seconds))
        if outcome.drained or self.host.draining:
            # Also a job that died of the drain request itself: it resumes elsewhere from
            # its last uploaded checkpoint rather than failing.
            if self.uploader is not None:
                await asyncio.gather(self.uploader, return_exceptions=True)
            log.info("job %s drained at step %d", job_id, self.uploaded_step)
            return self.update(released=gw.JobReleased(reason="provider is draining"))
        if self.uploader is not None:
            self.uploader.cancel()
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
        elif isinstance(report, Checkpoint):
            self.pending_checkpoint = (report.step, report.path, report.write_seconds)
            if self.uploader is None or self.uploader.done():
                self.uploader = asyncio.create_task(self.upload_checkpoints())

    def task_ended(self, report: TaskEnded) -> None:
        """A task of a job array's lease ended: pass it on with the others that end within
        TASK_FLUSH_S (one update for many short tasks); one that succeeded and left outputs
        once they are stored at the broker (upload_tasks)."""
        task = report.task
        if task not in self.tasks_open:
            return          # not a task of this lease, or told already
        self.tasks_open.discard(task)
        if self.yield_asked and not self.yield_sent:
            self.tell_yield()       # the runner, which has reported, now listens for it
        result = gw.TaskResult(task=task, ok=report.ok, error=report.error,
                               seconds=report.seconds)
        if result.ok and os.path.lexists(self.workdir / task_outputs(task)):
            self.to_upload.append(result)
            if self.task_uploader is None or self.task_uploader.done():
                self.task_uploader = asyncio.create_task(self.upload_tasks())
        else:
            self.queue_result(result)

    def queue_result(self, result: gw.TaskResult) -> None:
        self.task_results.append(result)
        if self.task_flush is None:
            self.task_flush = asyncio.get_running_loop().call_later(TASK_FLUSH_S,
                                                                    self.flush_tasks)

    async def upload_tasks(self) -> None:
        """Store the outputs of the tasks that succeeded at the broker, those of the tasks
        that end within TASK_FLUSH_S of each other together (their small files in one call),
        then pass each task on with a receipt for its outputs alone: an array's results can
        be fetched as its tasks end, not only when their lease does. A task is reported
        succeeded only once its outputs are stored; where they cannot be (UPLOAD_TRIES
        tries, backing off), or the task left what is no output (a link, too many files),
        it is reported failed and the broker runs it again."""
        while self.to_upload:
            wait = self.flushed_at + TASK_FLUSH_S - time.monotonic()
            if wait > 0 and not self.ending.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.ending.wait(), wait)
            batch, self.to_upload = self.to_upload[:FLUSH_TASKS], self.to_upload[FLUSH_TASKS:]
            self.flushed_at = time.monotonic()
            await self.send_task_outputs(batch)

    async def send_task_outputs(self, batch: list[gw.TaskResult]) -> None:
        found = await asyncio.to_thread(self.read_task_outputs, [r.task for r in batch])
        outputs = [o for r in batch if not isinstance(found[r.task], str)
                   for o in found[r.task]]
        error = ""
        for tried in range(1, UPLOAD_TRIES + 1):
            try:
                refs = await self.store_outputs(outputs)
                error = ""
                break
            except (GpumarketError, OSError) as exc:
                error = str(exc) or type(exc).__name__
                log.warning("job %s: outputs of %d tasks not stored (try %d of %d): %s",
                            self.key[0], len(batch), tried, UPLOAD_TRIES, error)
                if tried < UPLOAD_TRIES:
                    await asyncio.sleep(UPLOAD_BACKOFF_S * 2 ** (tried - 1)
                                        * random.uniform(0.8, 1.2))
        for result in batch:
            got = found[result.task]
            if isinstance(got, str) or error:
                result.ok = False
                result.error = (got if isinstance(got, str) else
                                f"its outputs could not be stored at the broker: {error}")[:1000]
            else:
                result.receipt.CopyFrom(self.sign([refs[(o.task, o.name)] for o in got],
                                                  result.seconds))
            self.queue_result(result)

    def read_task_outputs(self, tasks: list[int]) -> dict[int, list[TaskOutput] | str]:
        """Each task's output files (the job's own plain files, read through descriptors
        opened without following links), hashed, small ones read whole while FLUSH_BYTES
        last; or what is wrong with them (the task fails of it, its siblings do not)."""
        budget = FLUSH_BYTES
        found: dict[int, list[TaskOutput] | str] = {}
        root = jobfiles.open_dir(self.workdir)
        try:
            for task in tasks:
                outputs: list[TaskOutput] = []
                try:
                    sub = jobfiles.open_beneath(root, task_outputs(task), directory=True)
                    try:
                        names = sorted(os.listdir(sub))
                        if len(names) > arrays.TASK_OUTPUTS:
                            raise jobfiles.JobFileError(
                                f"{len(names):,} files, more than the {arrays.TASK_OUTPUTS:,}"
                                " a task may leave (pack them into fewer)")
                        for name in names:
                            check_artifact_name(arrays.output_name(task, name), "output")
                            fd = jobfiles.open_beneath(sub, name, owner=self.job_uid)
                            try:
                                size = os.fstat(fd).st_size
                                data = None
                                if size <= min(CHUNK_BYTES, budget):
                                    data = os.pread(fd, CHUNK_BYTES + 1, 0)
                                if data is not None and len(data) <= CHUNK_BYTES:
                                    budget -= len(data)
                                    outputs.append(TaskOutput(
                                        task, name, hashlib.sha256(data).hexdigest(),
                                        len(data), data))
                                else:
                                    sha, size = sha256_file(fd)
                                    outputs.append(TaskOutput(task, name, sha, size, None))
                            finally:
                                os.close(fd)
                    finally:
                        os.close(sub)
                    found[task] = outputs
                except (GpumarketError, OSError) as exc:
                    found[task] = f"its outputs: {getattr(exc, 'message', None) or exc}"
        finally:
            os.close(root)
        return found

    async def store_outputs(self, outputs: list[TaskOutput]) -> dict[tuple[int, str],
                                                                      pb.ArtifactRef]:
        """Upload task outputs, each content once: the small files read whole in few
        UploadBlobs calls, the rest one by one (UPLOADS_AT_ONCE at a time, each opened
        again as read_task_outputs did). Their references, by (task, name)."""
        small = {o.sha256: o.data for o in outputs if o.data is not None}
        large = {o.sha256: o for o in outputs if o.data is None and o.sha256 not in small}
        group: list[tuple[str, bytes]] = []
        size = 0
        for sha, data in small.items():
            if group and (len(group) == BLOBS_PER_CALL or size + len(data) > BLOB_CALL_BYTES):
                await self.host.upload_blobs(group)
                group, size = [], 0
            group.append((sha, data))
            size += len(data)
        if group:
            await self.host.upload_blobs(group)
        gate = asyncio.Semaphore(UPLOADS_AT_ONCE)

        async def send(o: TaskOutput) -> None:
            async with gate:
                fd = await asyncio.to_thread(jobfiles.open_under, self.workdir,
                                             f"{task_outputs(o.task)}/{o.name}",
                                             owner=self.job_uid)
                try:
                    await self.host.upload(fd, arrays.output_name(o.task, o.name),
                                           (o.sha256, o.size))
                finally:
                    os.close(fd)

        ended = await asyncio.gather(*map(send, large.values()), return_exceptions=True)
        for result in ended:
            if isinstance(result, BaseException):
                raise result
        return {(o.task, o.name): pb.ArtifactRef(name=arrays.output_name(o.task, o.name),
                                                 sha256=o.sha256, size_bytes=o.size)
                for o in outputs}

    async def settle_tasks(self) -> None:
        """The job ended: its tasks' outputs go up at once (or are dropped with a cancelled
        lease), then every task result not sent yet goes."""
        self.ending.set()
        if self.task_uploader is not None:
            if self.cancelled:
                self.task_uploader.cancel()
            await asyncio.gather(self.task_uploader, return_exceptions=True)
        self.flush_tasks()

    def request_yield(self) -> None:
        """The broker asks this job array's lease to stop after the task it runs now (another
        client waits for its device): it ends with its receipt for the tasks it ran. The
        runner is told once it has reported a task: before that it may not be listening."""
        if not self.assignment.lease.tasks or self.yield_asked:
            return
        self.yield_asked = True
        if len(self.tasks_open) < len(self.assignment.lease.tasks):
            self.tell_yield()

    def tell_yield(self) -> None:
        if self.process is not None:
            self.yield_sent = True
            self.process.request_yield()

    def flush_tasks(self) -> None:
        if self.task_flush is not None:
            self.task_flush.cancel()
            self.task_flush = None
        batch: list[gw.TaskResult] = []
        size = 0
        for result in self.task_results:
            if batch and (len(batch) == TASKS_PER_UPDATE
                          or size + result.ByteSize() > UPDATE_BYTES):
                self.host.send(self.update(tasks=gw.TaskResults(results=batch)))
                batch, size = [], 0
            batch.append(result)
            size += result.ByteSize()
        if batch:
            self.host.send(self.update(tasks=gw.TaskResults(results=batch)))
        self.task_results = []

    async def upload_checkpoints(self) -> None:
        """Upload the newest pending checkpoint (older pending ones are skipped)."""
        while self.pending_checkpoint is not None:
            step, path, write_s = self.pending_checkpoint
            self.pending_checkpoint = None
            if step <= self.uploaded_step:
                continue
            upload_dir = self.workdir / "upload"
            upload_dir.mkdir(exist_ok=True)
            tar = upload_dir / f"step-{step:08d}.tar"
            try:
                await asyncio.to_thread(self.pack, path, tar)
                ref = await self.host.upload(tar, "checkpoint.tar")
            except (GpumarketError, OSError) as exc:    # the job's files: anything goes
                log.warning("job %s: checkpoint at step %d not uploaded: %s", self.key[0],
                            step, exc)
                continue
            finally:
                tar.unlink(missing_ok=True)
            self.uploaded_step = step
            self.checkpoint_report = self.update(checkpoint=gw.CheckpointReport(
                step=step, artifact=ref, write_seconds=write_s))
            self.host.send(self.checkpoint_report)
            await asyncio.to_thread(self.drop_older_checkpoints, path)

    def pack(self, rel: str, tar: Path) -> None:
        """Pack the job's checkpoint ``rel`` (walked from the work directory without
        following links: the job may have swapped it for a link since it reported it)."""
        ckpt = jobfiles.open_under(self.workdir, rel, directory=True)
        try:
            checkpoints.pack(ckpt, tar, self.job_uid, PurePosixPath(rel).name)
        finally:
            os.close(ckpt)

    def drop_older_checkpoints(self, rel: str) -> None:
        """Remove the job's checkpoints older than the one just uploaded (names sort by
        step; newer ones may be in progress), inside its own checkpoints directory only."""
        newest = PurePosixPath(rel)
        try:
            parent = jobfiles.open_under(self.workdir, str(newest.parent), directory=True)
        except (OSError, jobfiles.JobFileError):
            return
        try:
            for name in os.listdir(parent):
                if name.startswith("step-") and name < newest.name:
                    shutil.rmtree(name, ignore_errors=True, dir_fd=parent)
        finally:
            os.close(parent)

    async def upload_all(self, files: list[tuple[int, str]]) -> list[pb.ArtifactRef]:
        """Upload open files (descriptor, name), UPLOADS_AT_ONCE at a time and each content
        once (an array's tasks write many files alike); their references, in order. Every
        upload has ended when this returns or raises: the descriptors are the caller's."""
        digests = await asyncio.to_thread(lambda: [sha256_file(fd) for fd, _ in files])
        first: dict[tuple[str, int], tuple[int, str]] = {}
        for file, digest in zip(files, digests):
            first.setdefault(digest, file)
        gate = asyncio.Semaphore(UPLOADS_AT_ONCE)

        async def send(file: tuple[int, str], digest: tuple[str, int]) -> pb.ArtifactRef:
            async with gate:
                return await self.host.upload(*file, digest)

        ended = await asyncio.gather(*(send(f, d) for d, f in first.items()),
                                     return_exceptions=True)
        for result in ended:
            if isinstance(result, BaseException):
                raise result
        sent = dict(zip(first, ended))    # each content as the broker took it
        return [pb.ArtifactRef(name=name, sha256=sent[d].sha256, size_bytes=sent[d].size_bytes)
                for (_, name), d in zip(files, digests)]

    async def receipt(self, done: Done, wall_seconds: float) -> pb.Envelope:
        """Upload the job's outputs and sign the receipt for them. A job array's lease names
        none: each task's went up with its own receipt (settle_tasks)."""
        if self.assignment.lease.tasks:
            return self.sign([], wall_seconds, done.metrics)
        return self.sign(await self.upload_outputs([("outputs", None)]), wall_seconds,
                         done.metrics)

    async def upload_outputs(self, dirs: list[tuple[str, int | None]]) -> list[pb.ArtifactRef]:
        """Upload the files of ``dirs`` (in the work dir; a task's named by its task). The job
        may have swapped a directory or a file in it for a link to anything the daemon can
        read: only the job's own plain files are taken, read through descriptors
        (JobFileError if it left anything else there)."""
        outputs: list[pb.ArtifactRef] = []
        root = jobfiles.open_dir(self.workdir)
        try:
            # Directories are opened until FILES_AT_ONCE of their files are, then those go up
            # and are closed: a task may leave thousands of files, and the daemon's
            # descriptors are not the job's to use up.
            with contextlib.ExitStack() as opened:
                files: list[tuple[int, str]] = []
                for rel, task in dirs:
                    files += [(fd, name if task is None else arrays.output_name(task, name))
                              for name, fd in opened.enter_context(
                                  jobfiles.plain_files(root, rel, self.job_uid))]
                    if len(files) >= FILES_AT_ONCE:
                        outputs += await self.upload_all(files)
                        files = []
                        opened.close()
                outputs += await self.upload_all(files)
        finally:
            os.close(root)
        return outputs

    def sign(self, outputs: list[pb.ArtifactRef], wall_seconds: float,
             metrics: dict[str, float] | None = None) -> pb.Envelope:
        a = self.assignment
        receipt = pb.Receipt(
            job_id=a.lease.job_id, lease_id=a.lease.lease_id, attempt=a.lease.attempt,
            epoch=a.lease.epoch, provider_id=self.host.identity.id, spec_sha256=a.spec_sha256,
            outputs=outputs, wall_seconds=wall_seconds,
            device_seconds=wall_seconds * len(a.lease.device_indices),
            metrics=metrics or {}, finished_at_ms=now_ms())
        return seal(self.host.identity, receipt)

    # -- ending it -------------------------------------------------------------------------

    async def stop(self, reason: str) -> None:
        """Stop the job for good (cancelled by the broker, or the daemon is stopping)."""
        self.cancelled = True
        if self.process is not None:
            await self.process.stop(reason)
        for task in (self.task, self.uploader):
            if task is not None and not task.done():
                task.cancel()

    def request_drain(self) -> None:
        if self.engine is not None:
            return      # a replica serves on: the broker starts its replacement, then stops it
        if self.process is not None:
            self.process.request_drain()

    # -- after a daemon restart --------------------------------------------------------

    def reattach(self, pid: int) -> asyncio.Task:
        """Follow the job process a previous daemon started."""
        self.process = self.new_process()
        if self.engine is not None:     # its engine lost its link with the old daemon: it ends
            os.close(self.engine.child_fd)
            self.engine.close()
        self.process.attach(pid)
        self.task = asyncio.create_task(self._reattached())
        return self.task

    def tasks_meanwhile(self, tasks: list[TaskEnded]) -> None:
        """Pass on the tasks of a job array's lease that ended while no daemon watched."""
        for report in tasks:
            self.task_ended(report)

    async def _reattached(self) -> None:
        meanwhile = await asyncio.to_thread(read_reports, self.workdir, self.job_uid,
                                            self.tasks_open)
        self.tasks_meanwhile(meanwhile.tasks)
        if meanwhile.checkpoint is not None:
            await self.on_report(meanwhile.checkpoint)
        final = await self.follow()
        if final is not None and not self.cancelled:
            await self.host.finished(self, final)

    def done_meanwhile(self) -> Done | None:
        """The job's "done" report, if it finished while no daemon watched it."""
        return read_reports(self.workdir, self.job_uid).done

    def finish_meanwhile(self, done: Done) -> asyncio.Task:
        """Sign the receipt of a job that finished while no daemon watched it."""
        async def finish() -> None:
            if self.host.isolation.uids is not None and self.job_uid != os.geteuid():
                # Whatever it left running goes before its outputs are read.
                await asyncio.to_thread(kill_uid, self.job_uid)
            meanwhile = await asyncio.to_thread(read_reports, self.workdir, self.job_uid,
                                                self.tasks_open)
            self.tasks_meanwhile(meanwhile.tasks)
            await self.settle_tasks()
            try:
                seconds = done.metrics.get("train_seconds", 0.0)
                final = self.update(receipt=await self.receipt(done, seconds))
            except GpumarketError as exc:
                final = self.update(failed=self.failure(str(exc), ran=True))
            await self.host.finished(self, final)

        self.task = asyncio.create_task(finish())
        return self.task
