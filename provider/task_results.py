"""The task results of a job array's lease: each task that ends is passed on to the broker,
those that end together in one update; a task that succeeded and left outputs only once
they are stored at the broker (so an array's results can be fetched as its tasks end, not
only when their lease does). One receipt signs each update's outputs: the root of a hash
tree over its tasks (kinds/receipt_tree.py), each result naming its own outputs. Small
outputs travel in the update itself (the broker stores them in the transaction that records
their tasks); larger ones are uploaded first. Each update is kept, and sent again on the
next session, until the broker acknowledges it (TaskResultsSettled). Updates shrink toward
the lease's end (``TaskResults.due``): the array's end waits for the broker to record its
leases' last ones."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpumarket.kinds import arrays, receipt_tree
from gpumarket.proto.artifacts import CHUNK_BYTES, sha256_file
from gpumarket.proto.errors import GpumarketError
from gpumarket.proto.jobspec import check_artifact_name
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider import jobfiles
from gpumarket.provider.receipts import UPLOADS_AT_ONCE
from gpumarket.provider.reports import TaskEnded

log = logging.getLogger(__name__)

TASK_FLUSH_S = 1.0         # a job array's task results (and outputs) go at most this often
                           # (each a call and an update, a transaction each at the broker;
                           # 0.2 s cost its broker 3.1 ms of CPU a 35 ms task, 1 s 1.7) ...
TASKS_PER_UPDATE = 1000    # ... this many to an update ...
LAST_UPDATE_TASKS = 16     # ... and sooner near the lease's end: as soon as they are as many
                           # as its tasks left to run (at least this many), so its updates
                           # halve toward its end and the last, which the array's end waits
                           # on (the broker recorded 280-500 one-file tasks' in 45-66 ms),
                           # holds at most this many ...
UPDATE_BYTES = 1 << 20     # ... and this many bytes (receipts included)
FLUSH_TASKS = 1000         # tasks whose outputs go up together (one call for the small files)
FLUSH_BYTES = 32 << 20     # small files' bytes read with their hash for one flush (beyond:
                           # read again when sent, as a large file is)
BLOBS_PER_CALL = 1000      # small files in one UploadBlobs call ...
BLOB_CALL_BYTES = 16 << 20  # ... and their bytes
UPLOAD_TRIES = 5           # a flush's outputs are tried this often, waiting UPLOAD_BACKOFF_S,
UPLOAD_BACKOFF_S = 0.5     # doubling, between tries; then its tasks are reported failed
# Outputs sent in the task results update rather than uploaded (kinds/arrays.py): each at
# most INLINE_OUTPUT_BYTES, an update's at most INLINE_UPDATE_BYTES and INLINE_UPDATE_BLOBS.


@dataclass(frozen=True)
class TaskOutput:
    """One file a task of a job array left in its outputs directory."""
    task: int
    name: str
    sha256: str
    size: int
    data: bytes | None          # a small file's bytes, read with its hash; None: read when sent


class Store(Protocol):
    """What task results ask of the daemon: the session to the broker and its artifact
    store."""

    update_receipts: bool       # the broker takes one receipt an update (else one a task)

    def send(self, message: gw.ProviderMessage) -> None: ...
    async def upload(self, source: Path | int, name: str,
                     digest: tuple[str, int] | None = None) -> pb.ArtifactRef: ...
    async def upload_blobs(self, blobs: list[tuple[str, bytes]]) -> list: ...


def ref_of(o: TaskOutput) -> pb.ArtifactRef:
    return pb.ArtifactRef(name=arrays.output_name(o.task, o.name), sha256=o.sha256,
                          size_bytes=o.size)


def task_outputs(task: int) -> str:
    """Where an array task's outputs are, in its lease's work dir."""
    return f"tasks/{task:06d}/outputs"


class TaskResults:
    """One array lease's tasks as they end. ``update`` makes the lease's JobUpdate message
    of its fields; ``sign(outputs, seconds, tasks_root=b"")`` a receipt for an update's
    tasks (by their tree's root) or, for a broker before issue 32, for one task's outputs;
    ``owner`` is the job's uid (only its files are taken)."""

    def __init__(self, tasks: Iterable[int], workdir: Path, owner: int, host: Store,
                 update: Callable[..., gw.ProviderMessage],
                 sign: Callable[..., pb.Envelope]) -> None:
        self.open = set(tasks)              # the lease's tasks not yet reported
        self.count = len(self.open)
        self.began: float | None = None     # when its first task began (monotonic)
        self.workdir = workdir
        self.owner = owner
        self.host = host
        self.update = update
        self.sign = sign
        self.results: list[tuple[gw.TaskResult, dict[str, bytes]]] = []  # told, not yet
                                            # sent: each with the outputs that go with it
        self.sent = 0                       # updates sent (their seq)
        self.unacked: dict[int, gw.ProviderMessage] = {}    # by seq: sent, not acknowledged
        self.flush_timer: asyncio.TimerHandle | None = None
        self.to_upload: list[gw.TaskResult] = []    # tasks succeeded, their outputs to go up
        self.uploader: asyncio.Task | None = None
        self.flushed_at = 0.0               # when the last task outputs went up (monotonic)
        self.ending = asyncio.Event()       # the job's process ended: what is left goes now
        self.stopping = False               # it stops after its current task (a yield)
        self.wake = asyncio.Event()         # what is held is due (``due``): the uploader goes

    def ended(self, report: TaskEnded) -> bool:
        """A task ended: pass it on with the others that end within TASK_FLUSH_S (one update
        for many short tasks), or sooner near the lease's end (``due``); one that succeeded
        and left outputs once they are stored at the broker (upload). False if it is no open
        task of this lease (ignored)."""
        task = report.task
        if task not in self.open:
            return False        # not a task of this lease, or told already
        self.open.discard(task)
        if self.began is None:
            self.began = time.monotonic() - max(0.0, report.seconds)
        result = gw.TaskResult(task=task, ok=report.ok, error=report.error,
                               seconds=report.seconds)
        if result.ok and os.path.lexists(self.workdir / task_outputs(task)):
            self.to_upload.append(result)
            if self.uploader is None or self.uploader.done():
                self.uploader = asyncio.create_task(self.upload())
            elif self.due():
                self.wake.set()
        else:
            self.queue(result)
        return True

    def due(self) -> bool:
        """Whether the results held (told, not sent; those of an upload under way aside) go
        now rather than at the end of their TASK_FLUSH_S: the job ended; or it stops after
        its current task (its last update then holds that task alone); or they are as many
        as the lease's tasks left to run, and at least LAST_UPDATE_TASKS. The array's end
        waits for the broker to record its leases' last updates (a few ms a hundred tasks):
        updates that halve toward a lease's end (a lease of 1,000 short tasks sends 500,
        250, ... 16, then its last) make that last one small, at the cost of a few more
        updates a lease."""
        held = len(self.results) + len(self.to_upload)
        return self.ending.is_set() or held > 0 and (
            self.stopping or held >= max(LAST_UPDATE_TASKS, len(self.open)))

    def left_s(self) -> float | None:
        """Seconds the lease's tasks not run yet (the one running now among them) would take
        at its pace so far: its wall time since its first task began over the tasks it ran
        (a task's cost to the lease, the runner's and this daemon's share of the core
        included); None before a task ended. The broker can only count the tasks reported,
        which lag these by what is held (up to TASK_FLUSH_S)."""
        ran = self.count - len(self.open)
        if self.began is None or ran < 1:
            return None
        return len(self.open) * (time.monotonic() - self.began) / ran

    def yielding(self) -> None:
        """The lease stops after the task it runs now (the broker asked it to yield): what
        is held goes now, not with that task at the lease's end."""
        self.stopping = True
        if self.results:
            self.flush()
        if self.to_upload:
            self.wake.set()

    def give_back(self, from_task: int | None, order: Iterable[int]) -> list[int]:
        """The runner split the lease: its open tasks from ``from_task`` on, in the lease's
        ``order``, are no longer its own; they go to the broker now, with what is held, in
        an update (``yielded``) kept and sent again until acknowledged as any other. Returns
        them (none where ``from_task`` is None or no open task of the lease)."""
        order = list(order)
        if from_task is None or from_task not in self.open:
            return []
        given = [t for t in order[order.index(from_task):] if t in self.open]
        self.open.difference_update(given)
        self.count -= len(given)
        self.flush(yielded=given)
        return given

    def giving_back(self) -> bool:
        """Whether an update giving tasks back (``give_back``) is not acknowledged yet."""
        return any(m.job_update.tasks.yielded for m in self.unacked.values())

    def queue(self, result: gw.TaskResult, blobs: dict[str, bytes] | None = None) -> None:
        self.results.append((result, blobs or {}))
        if self.due():
            self.flush()
        elif self.flush_timer is None:
            self.flush_timer = asyncio.get_running_loop().call_later(TASK_FLUSH_S, self.flush)

    async def upload(self) -> None:
        """Store the outputs of the tasks that succeeded at the broker, those of the tasks
        that end within TASK_FLUSH_S of each other (or fewer, ``due``) together (their small
        files in one call), then pass each task on naming its outputs (its update's receipt
        signs them, ``send``). A task is reported succeeded only once its outputs are
        stored; where they cannot be (UPLOAD_TRIES tries, backing off), or the task left
        what is no output (a link, too many files), it is reported failed and the broker
        runs it again."""
        while self.to_upload:
            wait = self.flushed_at + TASK_FLUSH_S - time.monotonic()
            if wait > 0 and not self.due():
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), wait)
            batch, self.to_upload = self.to_upload[:FLUSH_TASKS], self.to_upload[FLUSH_TASKS:]
            self.flushed_at = time.monotonic()
            await self.send_outputs(batch)

    async def send_outputs(self, batch: list[gw.TaskResult]) -> None:
        found = await asyncio.to_thread(self.read_outputs, [r.task for r in batch])
        inline = {r.task: self.inline(found[r.task]) for r in batch
                  if not isinstance(found[r.task], str)}
        outputs = [o for r in batch if not isinstance(found[r.task], str)
                   for o in found[r.task] if o.sha256 not in inline[r.task]]
        error = ""
        for tried in range(1, UPLOAD_TRIES + 1):
            try:
                await self.store(outputs)
                error = ""
                break
            except (GpumarketError, OSError) as exc:
                error = str(exc) or type(exc).__name__
                log.warning("lease %s: outputs of %d tasks not stored (try %d of %d): %s",
                            self.workdir.name, len(batch), tried, UPLOAD_TRIES, error)
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
                result.outputs.extend(ref_of(o) for o in got)
            self.results.append((result, inline.get(result.task, {}) if result.ok else {}))
        # Their window passed before the upload: they go now (with any told meanwhile).
        self.flush()

    @staticmethod
    def inline(outputs: list[TaskOutput]) -> dict[str, bytes]:
        """Those of a task's outputs that go with its result rather than up on their own
        (sha256 → bytes): the small ones read whole, while the update's bounds last."""
        out: dict[str, bytes] = {}
        size = 0
        for o in outputs:
            if (o.data is not None and o.size <= arrays.INLINE_OUTPUT_BYTES
                    and o.sha256 not in out and len(out) < arrays.INLINE_UPDATE_BLOBS
                    and size + o.size <= arrays.INLINE_UPDATE_BYTES):
                out[o.sha256] = o.data
                size += o.size
        return out

    def read_outputs(self, tasks: list[int]) -> dict[int, list[TaskOutput] | str]:
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
                            fd = jobfiles.open_beneath(sub, name, owner=self.owner)
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

    async def store(self, outputs: list[TaskOutput]) -> None:
        """Upload task outputs, each content once: the small files read whole in few
        UploadBlobs calls, the rest one by one (UPLOADS_AT_ONCE at a time, each opened
        again as read_outputs did)."""
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
                                             owner=self.owner)
                try:
                    await self.host.upload(fd, arrays.output_name(o.task, o.name),
                                           (o.sha256, o.size))
                finally:
                    os.close(fd)

        ended = await asyncio.gather(*map(send, large.values()), return_exceptions=True)
        for result in ended:
            if isinstance(result, BaseException):
                raise result

    async def settle(self, dropped: bool = False) -> None:
        """The job ended: its tasks' outputs go up at once (or are ``dropped``, with a
        cancelled lease), then every task result not sent yet goes."""
        self.ending.set()
        self.wake.set()
        if self.uploader is not None:
            if dropped:
                self.uploader.cancel()
            await asyncio.gather(self.uploader, return_exceptions=True)
        self.flush()

    def flush(self, yielded: list[int] | None = None) -> None:
        """Send every task result told so far, in updates of at most TASKS_PER_UPDATE
        results and UPDATE_BYTES, each with the outputs that go with its results (within
        the INLINE bounds); each kept until the broker acknowledges it (``settled``). The
        tasks ``yielded`` (a split) go in the last."""
        if self.flush_timer is not None:
            self.flush_timer.cancel()
            self.flush_timer = None
        batch: list[gw.TaskResult] = []
        blobs: dict[str, bytes] = {}
        size = blob_bytes = 0
        for result, theirs in self.results:
            new = {sha: data for sha, data in theirs.items() if sha not in blobs}
            more = sum(map(len, new.values()))
            if batch and (len(batch) == TASKS_PER_UPDATE
                          or size + result.ByteSize() > UPDATE_BYTES
                          or blob_bytes + more > arrays.INLINE_UPDATE_BYTES
                          or len(blobs) + len(new) > arrays.INLINE_UPDATE_BLOBS):
                self.send(batch, blobs)
                batch, blobs, size, blob_bytes = [], {}, 0, 0
                new, more = dict(theirs), sum(map(len, theirs.values()))
            batch.append(result)
            blobs.update(new)
            size += result.ByteSize()
            blob_bytes += more
        if batch or yielded:
            self.send(batch, blobs, yielded or [])
        self.results = []

    def send(self, results: list[gw.TaskResult], blobs: dict[str, bytes],
             yielded: list[int] = ()) -> None:
        """Send one update, its succeeded tasks' outputs signed by one receipt over them
        (the broker checks one signature an update, not one a task); to a broker that does
        not take such receipts (before issue 32), by a receipt in each result, naming that
        task's outputs."""
        self.sent += 1
        covered = [r for r in results if r.ok and r.outputs]
        receipt = None
        if covered and self.host.update_receipts:
            root = receipt_tree.root([receipt_tree.task_leaf(r.task, r.outputs)
                                      for r in covered])
            receipt = self.sign([], sum(r.seconds for r in covered), tasks_root=root)
        else:
            for r in covered:
                r.receipt.CopyFrom(self.sign(list(r.outputs), r.seconds))
                r.ClearField("outputs")
        message = self.update(tasks=gw.TaskResults(
            results=results, seq=self.sent, receipt=receipt, yielded=yielded,
            blobs=[gw.TaskOutputBlob(sha256=sha, data=data) for sha, data in blobs.items()]))
        self.unacked[self.sent] = message
        self.host.send(message)

    def settled(self, answer: gw.TaskResultsSettled) -> None:
        """The broker recorded (or refused) update ``answer.seq``: it is not sent again. A
        refused one's tasks are not recorded: the broker runs them again."""
        sent = self.unacked.pop(answer.seq, None)
        if sent is not None and not answer.accepted:
            log.warning("lease %s: the broker refused %d task results: %s", self.workdir.name,
                        len(sent.job_update.tasks.results), answer.reason)

    def pending(self) -> list[gw.ProviderMessage]:
        """The updates the broker has not acknowledged yet, in the order sent (to send
        again on a new session, before the lease's final update)."""
        return [self.unacked[seq] for seq in sorted(self.unacked)]
