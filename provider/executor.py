"""Runs one job attempt in its own child process and work directory.

The child appends reports (one JSON object a line, see runners/report.py) to
``reports.jsonl`` in its work directory and its stdout and stderr to ``job.log``. It
leads its own process group, so a cancel reaches everything it started: SIGTERM, then
SIGKILL. Because reports go to a file, a restarted daemon can re-attach to a job that
outlived the daemon before it (``JobProcess.attach``). A job of a kind with a forkserver
(provider/forkservers.py) is forked from it rather than started cold.

A job's end is noticed by an event, not by polling: our own child's through asyncio's child
watcher, a forked one's through its forkserver's message, and a process that is not our
child (a re-attached job, or a forked one whose forkserver died) through a pidfd the event
loop watches (provider/exits.py; only where no pidfd can be had is its pid polled). Its log
and reports are read every DRAIN_S while it runs and once more, to the end, when it has
ended: a job that only runs costs the daemon a few reads a second.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpumarket.proto.jobspec import LOG_LINES_PER_UPDATE
from gpumarket.provider import jobfiles, keyrings, reports
from gpumarket.provider.cgroups import CgroupError, JobCgroup
from gpumarket.provider.exits import ForkedChild, pid_gone, pid_runs_in, signal_group, started_at
from gpumarket.provider.priority import job_priority, settle
from gpumarket.provider.reports import (
    Checkpoint,
    Done,
    Drained,
    Report,
    ReportReader,
    TaskEnded,
)
from gpumarket.provider.runners.base import SPLIT_SIGNAL
from gpumarket.provider.sandbox import ENV as SANDBOX_ENV
from gpumarket.provider.sandbox import Sandbox, kill_uid, reclaim_uid

if TYPE_CHECKING:
    from gpumarket.provider.forkservers import ForkServers

log = logging.getLogger(__name__)

# job_priority lives in provider/priority.py; its callers (attempt.py) import it from here.
__all__ = ["JobProcess", "job_env", "job_priority", "slice_env"]

LOG_READ_BYTES = 1 << 20       # read at most this much of job.log per poll
REPORTS_READ_BYTES = reports.MAX_LINE   # ... and of the reports

# Ends a job uid's processes and keyrings at a job's end (one server for the daemon).
ENDER = keyrings.Ender()

REPORTS = "reports.jsonl"
DRAIN_S = 0.25                 # how often a running job's log and reports are read ...
ANSWER_DRAIN_S = 0.01          # ... and for ANSWER_WITHIN_S after the job is asked to split
ANSWER_WITHIN_S = 1.0          # (its answer gives tasks to an idle lane: read at once)
DISK_CHECK_S = 2.0             # how often a job's work directory is measured against its quota

# Only what a job needs from the daemon's environment; never the daemon's secrets.
PASSTHROUGH_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "VIRTUAL_ENV")
# Job uids have no passwd entry: getpass.getuser() (imported by torch._dynamo and
# torch._inductor, transformers' masking utilities) reads the name from LOGNAME or USER.
JOB_USER = "job"
# Where the libraries a job uses keep their caches and settings, inside its own directory
# (relative to it): never the daemon's, never shared with the next job — a compiled-kernel
# cache one tenant writes is code the next one would run.
JOB_CACHES = {
    "XDG_CACHE_HOME": ".cache",
    "XDG_CONFIG_HOME": ".config",
    "XDG_DATA_HOME": ".local/share",
    "XDG_STATE_HOME": ".local/state",
    "HF_HOME": ".cache/huggingface",
    "TORCH_HOME": ".cache/torch",
    "TORCHINDUCTOR_CACHE_DIR": ".cache/torchinductor",
    "TORCH_EXTENSIONS_DIR": ".cache/torch_extensions",
    "TRITON_CACHE_DIR": ".cache/triton",
    "CUDA_CACHE_PATH": ".cache/nv/ComputeCache",
    "MPLCONFIGDIR": ".cache/matplotlib",
    "VLLM_CACHE_ROOT": ".cache/vllm",
    "NUMBA_CACHE_DIR": ".cache/numba",
    "CUPY_CACHE_DIR": ".cache/cupy",
}


@dataclass
class Outcome:
    exit_code: int | None      # None for a re-attached job (not our child)
    done: Done | None          # the runner's final "done" report, if it got that far
    drained: bool              # the runner checkpointed and stopped on request
    error: str                 # for a failure: what happened, with the log's last line
    wall_seconds: float
    killed: bool               # ended by cancel or time limit

    @property
    def succeeded(self) -> bool:
        return self.done is not None and self.exit_code in (0, None)


def job_env(workdir: Path, visible_devices: str, threads: int | None) -> dict[str, str]:
    """The whole environment of the job in ``workdir``: a few of the daemon's variables
    (PASSTHROUGH_ENV), its user's name, and a home, temporary directory and caches inside
    its own directory."""
    env = {k: os.environ[k] for k in PASSTHROUGH_ENV if k in os.environ}
    env.update({name: str(workdir / rel) for name, rel in JOB_CACHES.items()})
    env.update({
        "HOME": str(workdir),
        "USER": JOB_USER,
        "LOGNAME": JOB_USER,
        "TMPDIR": str(workdir / "tmp"),
        "CUDA_VISIBLE_DEVICES": visible_devices,
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "GPUMARKET_REPORT_FILE": str(workdir / REPORTS),
    })
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def slice_env(devices) -> dict[str, str]:
    """What a job on ``devices`` (inventory.DeviceInfo) is told of its share, for the
    runners' start (runners/base.apply_share) to hold it to: on the CPU the cores it is
    pinned to (GPUMARKET_CPU_CORES); on a CUDA slice its card's share of memory
    (GPUMARKET_MEMORY_FRACTION, torch's per-process memory fraction) and of compute
    (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: held only where an MPS daemon runs, whose pipe
    directory the job is then told)."""
    env: dict[str, str] = {}
    cores = sorted({c for d in devices if not d.is_cuda for c in d.cores})
    if cores:
        env["GPUMARKET_CPU_CORES"] = ",".join(map(str, cores))
    shares = [d.share for d in devices if d.is_cuda and d.is_slice]
    if shares:
        share = min(shares)     # a lease holds one slice (a slice runs one-device jobs)
        env["GPUMARKET_MEMORY_FRACTION"] = f"{share:.6g}"
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, round(share * 100)))
        if pipes := os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
            env["CUDA_MPS_PIPE_DIRECTORY"] = pipes
    return env


def log_tail(fd: int, lines: int = 5) -> str:
    """The last lines of an open job log."""
    try:
        size = os.fstat(fd).st_size
        text = os.pread(fd, 8192, max(0, size - 8192)).decode("utf-8", "replace")
    except OSError:
        return ""
    kept = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(kept[-lines:])


def job_owner(box: Sandbox | None) -> int:
    """The uid that owns what a job writes: its own, or the daemon's."""
    return box.uid if box is not None and box.uid is not None else os.geteuid()


@dataclass
class Meanwhile:
    """What a job reported while no daemon followed it (``read_reports``)."""
    tasks: list[TaskEnded]          # of the tasks asked about, each one's first report
    checkpoint: Checkpoint | None   # its last checkpoint report
    done: Done | None               # its "done" report, if it finished


def read_reports(workdir: Path, owner: int, tasks: frozenset[int] | set[int] = frozenset()
                 ) -> Meanwhile:
    """What the job's reports file holds so far, read a chunk at a time (however much the
    job wrote, only the reports kept take memory). A reports file that is not the job's own
    plain file holds nothing."""
    out = Meanwhile([], None, None)
    try:
        fd = jobfiles.open_under(workdir, REPORTS, owner=owner)
    except (OSError, jobfiles.JobFileError):
        return out
    reader, offset, told = ReportReader(workdir), 0, set()
    try:
        while data := os.pread(fd, REPORTS_READ_BYTES, offset):
            end = data.rfind(b"\n")
            if end < 0:
                if len(data) < REPORTS_READ_BYTES:
                    break                   # a last line the job has not ended yet
                offset += len(data)         # a line longer than any report: skipped
                continue
            offset += end + 1
            for report in reader.lines(data[:end]):
                if isinstance(report, TaskEnded):
                    if report.task in tasks and report.task not in told:
                        told.add(report.task)
                        out.tasks.append(report)
                elif isinstance(report, Checkpoint):
                    out.checkpoint = report
                elif isinstance(report, Done):
                    out.done = report
    except OSError:
        pass
    finally:
        os.close(fd)
    return out


_NOT_ENDED = object()


class JobProcess:
    """One job process; ``run()`` follows it to the end, ``stop()`` ends it. However either
    ends (an exception of the daemon's own included), nothing of the job outlives it."""

    def __init__(self, module: str, workdir: Path, env: dict[str, str],
                 on_report: Callable[[Report], Awaitable[None]], max_runtime_s: float,
                 grace_s: float, forks: ForkServers | None = None,
                 sandbox: Sandbox | None = None, disk_quota_bytes: int = 0,
                 cgroup: JobCgroup | None = None, stdin: int | None = None,
                 nice: int = 0) -> None:
        self.nice = nice            # its processes' CPU priority (priority.job_priority)
        self.forks = forks          # None: start cold
        self.stdin = stdin          # a descriptor for the job's stdin (an endpoint's engine
                                    # socket), closed here once the child has it; such a
                                    # job always starts cold
        self.sandbox = sandbox
        self.cgroup = cgroup
        self.disk_quota_bytes = disk_quota_bytes
        self._disk_checked = 0.0
        self.module = module
        self.workdir = workdir
        self.env = env
        self.on_report = on_report
        self.max_runtime_s = max_runtime_s
        self.grace_s = grace_s
        self.proc: asyncio.subprocess.Process | ForkedChild | None = None
        self.pid: int | None = None
        self.leader_start: int | None = None  # when self.pid started (exits.started_at)
        self._offset = 0
        self._log_offset = 0
        self._killed = False
        self._answer_by = 0.0          # until when (monotonic) reports are read quickly
        self._poke: asyncio.Future | None = None    # wakes the follower early
        self._stop_reason = ""
        self._reader = ReportReader(workdir)
        self._ended_for: object = _NOT_ENDED    # the pid end_all() last ended everything of
        self._exit: asyncio.Task | None = None  # ends when the job's process has (exited())
        # The daemon reads the job's log and reports through descriptors it opened itself:
        # whatever the job later puts under those names is never read.
        self._log_fd = self._reports_fd = -1

    def _create_files(self) -> None:
        dir_fd = jobfiles.open_dir(self.workdir)
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            self._reports_fd = os.open(REPORTS, flags, 0o644, dir_fd=dir_fd)
            self._log_fd = os.open("job.log", flags | os.O_APPEND, 0o644, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    def close(self) -> None:
        for fd in (self._log_fd, self._reports_fd):
            if fd >= 0:
                os.close(fd)
        self._log_fd = self._reports_fd = -1

    async def start(self) -> int:
        """Start the job (forked by its kind's forkserver where there is one, else cold);
        return its pid (also its process group id)."""
        (self.workdir / "tmp").mkdir(exist_ok=True)
        self._create_files()
        if self.sandbox is not None:
            if self.sandbox.uid is not None:
                # Its uid is the device's: nothing of an earlier job may still run as it
                # when the work directory becomes that uid's.
                killed = await asyncio.to_thread(reclaim_uid, self.sandbox.uid)
                if killed:
                    log.warning("job in %s: killed %d processes left of an earlier job of"
                                " uid %d", self.workdir.name, killed, self.sandbox.uid)
            hand_over(self.workdir, self.sandbox)
        forks, self.forks = self.forks, None
        if forks is not None and self.stdin is None:
            child = await forks.spawn(self.module, self.workdir, self.env,
                                      self.sandbox.to_json() if self.sandbox else "",
                                      self._log_fd)
            if child is not None:
                log.info("job in %s: forked by the %s forkserver, pid %d", self.workdir.name,
                         self.module, child.pid)
                self.proc, self.pid = child, child.pid
                self.leader_start = started_at(self.pid)
                settle(self.pid, self.nice, self.env)
                return self.pid
        args, env = ["-m", self.module, str(self.workdir)], self.env
        if self.sandbox is not None:
            args = ["-m", "gpumarket.provider.sandbox", self.module, str(self.workdir)]
            env = {**env, SANDBOX_ENV: self.sandbox.to_json()}
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, *args, cwd=self.workdir, env=env,
            stdin=asyncio.subprocess.DEVNULL if self.stdin is None else self.stdin,
            stdout=self._log_fd, stderr=self._log_fd, start_new_session=True,
        )
        if self.stdin is not None:
            os.close(self.stdin)
            self.stdin = None
        self.pid = self.proc.pid
        self.leader_start = started_at(self.pid)
        settle(self.pid, self.nice, self.env)
        return self.pid

    def attach(self, pid: int) -> None:
        """Follow a job started by an earlier daemon, from the end of its reports so far
        (a log or reports file the job replaced by anything but its own plain file is not
        read: the job then ends without a result)."""
        self.pid, self.leader_start = pid, started_at(pid)
        owner = job_owner(self.sandbox)
        try:
            self._reports_fd = jobfiles.open_under(self.workdir, REPORTS, owner=owner)
            self._log_fd = jobfiles.open_under(self.workdir, "job.log", owner=owner)
            self._offset = os.fstat(self._reports_fd).st_size
            self._log_offset = os.fstat(self._log_fd).st_size
        except (OSError, jobfiles.JobFileError) as exc:
            log.warning("job in %s: cannot follow its files (%s)", self.workdir, exc)

    def alive(self) -> bool:
        if isinstance(self.proc, ForkedChild):
            return self.proc.running()
        if self.proc is not None:
            return self.proc.returncode is None
        return self.pid is not None and pid_runs_in(self.pid, self.workdir)

    def exited(self) -> asyncio.Task:
        """A task that ends when the job's process has ended (one for the job, shared by its
        follower and stop()): our child's exit, its forkserver's word, or the pidfd of a
        process that is not our child."""
        if self._exit is None:
            self._exit = asyncio.create_task(self._wait_exit())
        return self._exit

    async def _wait_exit(self) -> None:
        if self.proc is not None:
            await self.proc.wait()
        elif self.pid is not None:
            await pid_gone(self.pid, self.alive)

    async def _ended_within(self, seconds: float | None) -> bool:
        """Wait at most ``seconds`` (None: as long as it takes) for the job's process to
        end; whether it has."""
        exited = self.exited()
        if not exited.done():
            await asyncio.wait({exited}, timeout=seconds)
        return exited.done()

    async def run(self) -> Outcome:
        """Follow the job to its end; its outcome. Every way this ends (a result, a stop,
        an exception, a cancel) it ends all of the job first."""
        try:
            return await self._run()
        finally:
            await self.end()

    async def _run(self) -> Outcome:
        if self.pid is None:
            await self.start()
        started = time.monotonic()
        state = {"done": None, "drained": False}
        try:
            await asyncio.wait_for(self._follow(state), self.max_runtime_s)
        except TimeoutError:
            self._stop_reason = f"exceeded its time limit of {self.max_runtime_s:.0f}s"
            await self.stop()
            await self._drain_reports(state)
        code = await self.proc.wait() if self.proc is not None else None
        await self._ended_within(None)
        wall = time.monotonic() - started
        if not self._all_ended():
            await asyncio.to_thread(self.end_all)
        done = state["done"] if code in (0, None) else None
        error = ""
        if done is None and not state["drained"]:
            if self._stop_reason:
                error = f"job {self._stop_reason}"
            elif self.cgroup is not None and self.cgroup.oom_killed():
                error = ("job ran out of memory: it used more than its limit of"
                         f" {self.cgroup.limits.memory_bytes:,} bytes")
            elif code is None:
                error = "job ended without finishing"
            elif code < 0:
                error = f"job killed by signal {-code}"
            else:
                error = f"job exited with code {code}"
            tail = log_tail(self._log_fd)
            if tail and not self._killed:
                error += ": " + tail.splitlines()[-1][:500]
        self.close()
        return Outcome(code, done, state["drained"] and done is None, error, wall, self._killed)

    def end_all(self) -> None:
        """Nothing of the job outlives it: every process of its control group (however it
        forked or detached), of its process group, and of its uid; then its uid's keyrings
        are emptied."""
        pid = self.pid
        if pid is not None:
            signal_group(pid, signal.SIGKILL, self.leader_start)
        if self.cgroup is not None:
            try:
                self.cgroup.kill()
            except CgroupError as exc:
                log.error("job in %s: %s", self.workdir, exc)
        if self.sandbox is not None and self.sandbox.uid is not None:
            # One forked child kills the uid's processes and empties its keyrings (ENDER);
            # a scan verifies. Where it could not, or something was still alive after it,
            # both are done again the slow way.
            uid, keyring = self.sandbox.uid, self.sandbox.keyring
            ended = ENDER.end(uid, keyring)
            alive = kill_uid(uid, killed=ended)
            if keyring and (not ended or alive) and not keyrings.clear_as(uid):
                log.warning("job in %s: the keyrings of uid %d were not emptied (the next"
                            " job of that uid empties them first)", self.workdir.name,
                            self.sandbox.uid)
        self._ended_for = pid

    def _all_ended(self) -> bool:
        """Whether end_all() ran since the job's process started."""
        return self._ended_for is not _NOT_ENDED and self._ended_for == self.pid

    async def end(self) -> None:
        """End all of the job (unless that was done since it started) and remove its
        control group. Safe to call any number of times."""
        if not self._all_ended():
            await asyncio.to_thread(self.end_all)
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.remove)

    async def _follow(self, state: dict) -> None:
        """Read the job's reports and log every DRAIN_S (every ANSWER_DRAIN_S while a split's
        answer is awaited, ``request_split``), and at once to their end when its process
        ends (woken by that, not by a poll)."""
        exited = self.exited()
        while True:
            running = not exited.done() and self.alive()
            await self._drain_reports(state)
            await self._drain_log()
            if running and self.disk_quota_bytes and await self._over_quota():
                await self.stop(f"wrote more than {self.disk_quota_bytes:,} bytes to its work"
                                " directory (its disk quota)")
                continue
            if not running:
                await self._drain_reports(state)
                await self._drain_log(final=True)
                return
            self._poke = asyncio.get_running_loop().create_future()
            wait = ANSWER_DRAIN_S if time.monotonic() < self._answer_by else DRAIN_S
            await asyncio.wait({exited, self._poke}, timeout=wait,
                               return_when=asyncio.FIRST_COMPLETED)

    async def _drain_log(self, final: bool = False) -> None:
        """Hand the job's new stdout/stderr lines on as ``{"event": "log", "lines": [...]}``
        reports, LOG_LINES_PER_UPDATE lines at a time (a last partial line only at the end)."""
        while True:
            if self._log_fd < 0:
                return
            data = os.pread(self._log_fd, LOG_READ_BYTES, self._log_offset)
            end = data.rfind(b"\n") + 1
            if final or (end == 0 and len(data) == LOG_READ_BYTES):   # or a line of 1 MiB+
                end = len(data)
            if end <= 0:
                return
            self._log_offset += end
            lines = data[:end].decode("utf-8", "replace").splitlines()
            for i in range(0, len(lines), LOG_LINES_PER_UPDATE):
                await self.on_report(reports.log_report(lines[i:i + LOG_LINES_PER_UPDATE]))
            if not (final and len(data) == LOG_READ_BYTES):
                return

    async def _drain_reports(self, state: dict) -> None:
        while self._reports_fd >= 0:
            data = os.pread(self._reports_fd, REPORTS_READ_BYTES, self._offset)
            end = data.rfind(b"\n")
            if end < 0:
                if len(data) == REPORTS_READ_BYTES:   # a line longer than any report: skip
                    self._offset += len(data)
                    continue
                return
            self._offset += end + 1
            await self._handle_reports(data[:end], state)

    async def _handle_reports(self, data: bytes, state: dict) -> None:
        for report in self._reader.lines(data):
            if isinstance(report, Done):
                state["done"] = report
            elif isinstance(report, Drained):
                state["drained"] = True
            else:
                await self.on_report(report)

    async def _over_quota(self) -> bool:
        now = time.monotonic()
        if now - self._disk_checked < DISK_CHECK_S:
            return False
        self._disk_checked = now
        return await asyncio.to_thread(disk_usage, self.workdir) > self.disk_quota_bytes

    def request_drain(self) -> None:
        """Ask the runner to checkpoint at the end of its current step and stop."""
        if self.pid is not None and self.alive():
            try:
                os.kill(self.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass

    def request_yield(self) -> None:
        """Ask a job array's runner to stop after its current task (base.run_tasks)."""
        if self.pid is not None and self.alive():
            try:
                os.kill(self.pid, signal.SIGUSR2)
            except ProcessLookupError:
                pass

    def request_split(self) -> None:
        """Ask a job array's runner to give the later part of its tasks not started to
        another lease (base.run_tasks), and read its answer as soon as it comes."""
        if self.pid is not None and self.alive():
            try:
                os.kill(self.pid, SPLIT_SIGNAL)
            except ProcessLookupError:
                return
            self._answer_by = time.monotonic() + ANSWER_WITHIN_S
            if self._poke is not None and not self._poke.done():
                self._poke.set_result(None)

    async def stop(self, reason: str = "") -> None:
        """SIGTERM the job's process group, SIGKILL after the grace period; then whatever
        is left of the job anywhere (its control group, its uid), however it detached."""
        if reason and not self._stop_reason:
            self._stop_reason = reason
        if self.pid is not None and self.alive():
            self._killed = True
            signal_group(self.pid, signal.SIGTERM, self.leader_start)
            await self._ended_within(self.grace_s)     # woken by its end, if it comes
            signal_group(self.pid, signal.SIGKILL, self.leader_start)  # (it may outlive its leader)
            await self._ended_within(None)
        # A stopped job's follower (run) may be cancelled next: end everything here.
        await self.end()


def disk_usage(root: Path) -> int:
    """Bytes in the files under ``root`` (links not followed; hard links counted once)."""
    total, seen = 0, set()
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def hand_over(workdir: Path, box: Sandbox) -> None:
    """Make the work directory the job's: its own uid owns the directory and the files it
    writes to; what the daemon put there (job.json, inputs, the checkpoint to resume from)
    stays the daemon's and readable only."""
    for dirpath, dirs, files in os.walk(workdir):
        for name in dirs:
            os.chmod(os.path.join(dirpath, name), 0o755)
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, 0o644)
    if box.uid is None:
        return
    gid = box.gid if box.gid is not None else box.uid
    for path in (workdir, workdir / "tmp", workdir / REPORTS, workdir / "job.log"):
        os.chown(path, box.uid, gid)
    os.chmod(workdir, 0o700)

