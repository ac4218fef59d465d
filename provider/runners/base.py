"""What every runner shares and that needs no torch: the job-error type, the checkpoint
cadence, the drain signal, and the fsync helpers of atomic checkpoint writes."""

from __future__ import annotations

import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # imported when read: a runner listens for a drain before the rest loads
    from gpumarket.kinds.runner_job import RunnerJob

MARKER = "COMPLETE"
_drain = False
_yield = False         # run_tasks: the broker asked the lease to stop after its current task
_split = False         # run_tasks: ... to give the later part of its tasks to an idle lane
SPLIT_SIGNAL = signal.SIGURG    # the split request: ignored by default, so one that comes
                                # before the runner listens ends nothing
SPLIT_START_S = 0.1    # what a split costs the lane that takes the tasks given, before its
                       # first one runs (the report read, a lease, a fork, the sandbox):
                       # 0.06-0.2 s measured here (issue 32)
_task: tuple[Path, RunnerJob] | None = None    # run_tasks: the task running now, and its job


def read_job(workdir: Path) -> RunnerJob:
    """The job this process runs in ``workdir``: its job.json, or, for a task of an array's
    lease, the task's job as run_tasks handed it over (no file written and read per task).
    JobError if job.json is no runner job."""
    from gpumarket.kinds.runner_job import RunnerJob, RunnerJobError

    if _task is not None and _task[0] == workdir:
        return _task[1]
    try:
        return RunnerJob.from_json((workdir / "job.json").read_bytes())
    except (OSError, RunnerJobError) as exc:
        raise JobError(f"job.json: {exc}") from exc


class JobError(Exception):
    """A problem with the job's inputs: reported as one line, no traceback."""


def listen_for_drain() -> None:
    """Note SIGUSR1 (the daemon's drain request) instead of dying of it. Call it first
    thing: a drain request may come while the slow imports are still loading."""
    def note(signum, frame) -> None:
        global _drain
        _drain = True

    signal.signal(signal.SIGUSR1, note)


def drain_requested() -> bool:
    return _drain


def listen_for_yield() -> None:
    """Note SIGUSR2 (the broker asks a job array's lease to yield its device: stop after
    the current task; the daemon sends it only once a task has reported, so after this)."""
    def note(signum, frame) -> None:
        global _yield
        _yield = True

    signal.signal(signal.SIGUSR2, note)


def listen_for_split() -> None:
    """Note SPLIT_SIGNAL (the broker asks a job array's lease to give the later part of its
    tasks not started to an idle lane of its array; it runs the rest)."""
    def note(signum, frame) -> None:
        global _split
        _split = True

    signal.signal(SPLIT_SIGNAL, note)


def split_point(left: int, pace_s: float, start_s: float = SPLIT_START_S) -> int:
    """How many of its ``left`` tasks not started a lease keeps when it splits, at ``pace_s``
    a task: the two lanes end together, the other's starting ``start_s`` later (it keeps
    (left + start/pace) / 2, at most all: a split that would end no sooner gives nothing)."""
    if left <= 0:
        return 0
    if pace_s <= 0:
        return -(-left // 2)
    return min(left, math.ceil((left + start_s / pace_s) / 2))


class Cadence:
    """When to checkpoint: every N steps if the job says so, else every Young interval
    sqrt(2 x measured write time x provider MTBF), re-estimated after each checkpoint."""

    MIN_S, MAX_S, FIRST_S = 5.0, 3600.0, 10.0

    def __init__(self, every_steps: int, interval_s: float, mtbf_s: float) -> None:
        self.every_steps = every_steps
        # Until this job's own checkpoint cost is measured, the broker's interval rests on a
        # guess: checkpoint early once (at most FIRST_S in) to measure it.
        self.interval_s = min(interval_s, self.FIRST_S) if mtbf_s > 0 else interval_s
        self.mtbf_s = mtbf_s
        self.last = time.monotonic()

    @classmethod
    def for_job(cls, job: RunnerJob) -> Cadence:
        """The cadence job.json asks for."""
        return cls(job.checkpoint_every, job.checkpoint_interval_s, job.provider_mtbf_s)

    def due(self, step: int) -> bool:
        if self.every_steps:
            return step % self.every_steps == 0
        return self.interval_s > 0 and time.monotonic() - self.last >= self.interval_s

    def written(self, write_seconds: float) -> None:
        self.last = time.monotonic()
        if not self.every_steps and self.mtbf_s > 0:
            young = math.sqrt(2 * max(write_seconds, 1e-3) * self.mtbf_s)
            self.interval_s = min(self.MAX_S, max(self.MIN_S, young))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def publish_checkpoint(root: Path, step: int, write: Callable[[Path], None]) -> Path:
    """Write checkpoint ``root/step-NNNNNNNN`` atomically: ``write`` fills a temporary
    directory, which is fsynced, renamed into place and finished with the COMPLETE marker
    (a directory without it is ignored). Returns the checkpoint's path."""
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step-{step:08d}", root / f".tmp-step-{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write(tmp)
    for f in tmp.iterdir():
        fsync_file(f)
    fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    (final / MARKER).write_text(str(step))
    fsync_file(final / MARKER)
    fsync_dir(final)
    fsync_dir(root)
    return final


def apply_share() -> list[str]:
    """Hold this job process to its device's share, as the provider's job environment says
    (provider/executor.slice_env): every thread pinned to its cores (a CPU device or slice:
    GPUMARKET_CPU_CORES) with torch's threads as many; on a slice of a GPU, torch's caching
    allocator held to its share of the card's memory (GPUMARKET_MEMORY_FRACTION: past it,
    an allocation fails with an out-of-memory error in this process, not in its
    neighbour's). Called first by every runner's start (``run_main``, the engine's). Returns
    notes for the job's log; a share it cannot apply is a JobError (the job must not run
    past its share)."""
    notes = []
    cores_text = os.environ.get("GPUMARKET_CPU_CORES", "")
    if cores_text:
        try:
            cores = {int(c) for c in cores_text.split(",")}
        except ValueError:
            raise JobError(f"GPUMARKET_CPU_CORES={cores_text!r} is no list of cores") from None
        for tid in [int(t) for t in os.listdir("/proc/self/task")] or [0]:
            try:
                os.sched_setaffinity(tid, cores)
            except OSError as exc:
                notes.append(f"threads not pinned to cores {cores_text} ({exc.strerror})")
                break
        if (torch := sys.modules.get("torch")) is not None:
            torch.set_num_threads(min(torch.get_num_threads(), len(cores)) or 1)
    fraction = os.environ.get("GPUMARKET_MEMORY_FRACTION", "")
    if fraction:
        try:
            share = float(fraction)
        except ValueError:
            raise JobError(f"GPUMARKET_MEMORY_FRACTION={fraction!r} is no number") from None
        if not 0 < share <= 1:
            raise JobError(f"GPUMARKET_MEMORY_FRACTION={fraction!r} is not in (0, 1]")
        import torch

        if torch.cuda.is_available():
            # Only the card of its slice is visible (CUDA_VISIBLE_DEVICES): device 0.
            torch.cuda.set_per_process_memory_fraction(share, 0)
            notes.append(f"CUDA memory held to {share:.3g} of the card")
    return notes


def run_main(module_name: str, fn: Callable) -> int:
    """A runner's command line: ``python -m gpumarket.provider.runners.NAME WORKDIR``; a
    JobError is one line on stderr and exit 1."""
    from gpumarket.provider.runners.report import Reporter

    if len(sys.argv) != 2:
        print(f"usage: python -m gpumarket.provider.runners.{module_name} WORKDIR",
              file=sys.stderr)
        return 2
    workdir = Path(sys.argv[1])
    try:
        for note in apply_share():
            print(f"note: {note}", file=sys.stderr)
        job = read_job(workdir)
        if job.tasks is not None:
            run_tasks(fn, workdir, job, Reporter())
        else:
            fn(workdir, Reporter())
    except JobError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


class _TaskReporter:
    """What a task of an array reports: its end only (the lease's progress is tasks done;
    a task is not checkpointed: one cut short runs again from its start)."""

    def __init__(self) -> None:
        self.done_metrics: dict | None = None

    def send(self, event: str, **fields) -> None:
        pass

    def progress(self, step: int, total: int, **metrics: float) -> None:
        pass

    def checkpoint(self, step: int, path: str, write_seconds: float) -> None:
        pass

    def drained(self, step: int) -> None:
        pass

    def done(self, **metrics: float) -> None:
        self.done_metrics = metrics


def run_tasks(fn: Callable, workdir: Path, job: RunnerJob, reporter) -> None:
    """A job array's lease: its tasks one after another in this process (one client's, of
    one array), each in ``tasks/NNNNNN/`` (its outputs in ``outputs/`` there), each reported
    as it ends (``task`` reports) while a failed task does not stop the others. On a drain
    request it stops between tasks: the rest run elsewhere. Asked to yield, it ends after
    the current task as if its list ended there (the broker queues the rest again). Asked
    to split, it keeps the first part of the tasks it has not started (``split_point``, at
    its pace so far) and reports the first one it gives (a ``split`` report, ``from_task``
    null when it gives none): its list ends there."""
    import traceback

    global _task, _split
    listen_for_drain()
    listen_for_yield()
    listen_for_split()
    tasks = list(job.tasks)
    ok_count = 0
    home = os.getcwd()
    began = time.monotonic()
    (workdir / "tasks").mkdir(exist_ok=True)
    i = -1
    while i + 1 < len(tasks):
        i += 1
        item = tasks[i]
        n = item.task
        tdir = workdir / "tasks" / f"{n:06d}"
        tdir.mkdir(exist_ok=True)
        _task = (tdir, job.for_task(item))
        quiet = _TaskReporter()
        started = time.monotonic()
        error = ""
        os.chdir(tdir)
        try:
            fn(tdir, quiet)
            if quiet.done_metrics is None:
                error = "it ended without finishing"
        except JobError as exc:
            error = str(exc)
        except Exception as exc:       # the task's own fault: its siblings go on
            traceback.print_exc()
            error = f"{type(exc).__name__}: {exc}"
        finally:
            os.chdir(home)
            _task = None
        try:
            # A task that left nothing leaves no directory: thousands of empty directories
            # in one made each mkdir here cost 0.6 ms (ext4), against 0.1 ms made and removed.
            tdir.rmdir()
        except OSError:
            pass    # its outputs (or anything else it left) stay for the receipt
        ok_count += not error
        ended = time.monotonic()
        # The task reports are the lease's progress: the broker counts them (no progress
        # report beside them: each was an update, a transaction and an event at the broker).
        reporter.send("task", task=n, ok=not error, error=error[:1000],
                      seconds=round(ended - started, 6))
        if drain_requested() and i + 1 < len(tasks):
            reporter.drained(i + 1)
            return
        if _yield and i + 1 < len(tasks):
            reporter.done(tasks_ok=ok_count, tasks_failed=i + 1 - ok_count,
                          tasks_yielded=len(tasks) - i - 1)
            return
        if _split:
            _split = False
            left = len(tasks) - i - 1
            keep = split_point(left, (ended - began) / (i + 1))
            reporter.send("split", from_task=tasks[i + 1 + keep].task if keep < left else None)
            del tasks[i + 1 + keep:]
    reporter.done(tasks_ok=ok_count, tasks_failed=len(tasks) - ok_count)
