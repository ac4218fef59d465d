"""Runs one job attempt in its own child process and work directory.

The child reports on a pipe (one JSON object a line, see runners/report.py); its
stdout and stderr go to ``job.log`` in the work directory. The child leads its own
process group, so a cancel reaches everything it started: SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAX_LINE = 1 << 20

# Only what a job needs from the daemon's environment; never the daemon's secrets.
PASSTHROUGH_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "VIRTUAL_ENV")


@dataclass
class Outcome:
    exit_code: int
    done: dict | None          # the runner's final "done" report, if it got that far
    error: str                 # last lines of the log for a failure
    wall_seconds: float
    killed: bool               # ended by cancel or time limit


def job_env(workdir: Path, visible_devices: str, threads: int | None) -> dict[str, str]:
    env = {k: os.environ[k] for k in PASSTHROUGH_ENV if k in os.environ}
    env.update({
        "HOME": str(workdir),
        "TMPDIR": str(workdir / "tmp"),
        "CUDA_VISIBLE_DEVICES": visible_devices,
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    })
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _tail(path: Path, lines: int = 5) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    kept = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(kept[-lines:])


class JobProcess:
    """One running child; ``run()`` returns its Outcome, ``stop()`` ends it."""

    def __init__(self, module: str, workdir: Path, env: dict[str, str],
                 on_report: Callable[[dict], Awaitable[None]], max_runtime_s: float,
                 grace_s: float) -> None:
        self.module = module
        self.workdir = workdir
        self.env = env
        self.on_report = on_report
        self.max_runtime_s = max_runtime_s
        self.grace_s = grace_s
        self.proc: asyncio.subprocess.Process | None = None
        self._killed = False
        self._stop_reason = ""

    async def run(self) -> Outcome:
        (self.workdir / "tmp").mkdir(exist_ok=True)
        read_fd, write_fd = os.pipe()
        log_file = open(self.workdir / "job.log", "ab")
        start = time.monotonic()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", self.module, str(self.workdir),
                cwd=self.workdir, env={**self.env, "GPUMARKET_REPORT_FD": str(write_fd)},
                stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                pass_fds=(write_fd,), start_new_session=True,
            )
        finally:
            os.close(write_fd)
            log_file.close()
        done = None
        try:
            done = await asyncio.wait_for(self._read_reports(read_fd), self.max_runtime_s)
        except TimeoutError:
            self._stop_reason = f"exceeded its time limit of {self.max_runtime_s:.0f}s"
            await self.stop()
        code = await self.proc.wait()
        wall = time.monotonic() - start
        error = ""
        if code != 0 or done is None:
            tail = _tail(self.workdir / "job.log")
            if self._stop_reason:
                error = f"job {self._stop_reason}"
            elif code < 0:
                error = f"job killed by signal {-code}"
            else:
                error = f"job exited with code {code}"
            if tail and not self._killed:
                error += ": " + tail.splitlines()[-1][:500]
        return Outcome(code, done if code == 0 else None, error, wall, self._killed)

    async def _read_reports(self, read_fd: int) -> dict | None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=MAX_LINE)
        pipe = os.fdopen(read_fd, "rb", buffering=0)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe)
        done = None
        try:
            while line := await reader.readline():
                try:
                    report = json.loads(line)
                except ValueError:
                    log.warning("job wrote an unreadable report line")
                    continue
                if not isinstance(report, dict):
                    continue
                if report.get("event") == "done":
                    done = report
                else:
                    await self.on_report(report)
        finally:
            transport.close()
        return done

    async def stop(self, reason: str = "") -> None:
        """SIGTERM the job's process group, SIGKILL after the grace period."""
        if reason and not self._stop_reason:
            self._stop_reason = reason
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        self._killed = True
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.grace_s)
        except TimeoutError:
            _signal_group(proc.pid, signal.SIGKILL)
            await proc.wait()
        # Children the job left behind in its group go too.
        _signal_group(proc.pid, signal.SIGKILL)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
