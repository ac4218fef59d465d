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

MARKER = "COMPLETE"
_drain = False


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


def run_main(module_name: str, fn: Callable) -> int:
    """A runner's command line: ``python -m gpumarket.provider.runners.NAME WORKDIR``; a
    JobError is one line on stderr and exit 1."""
    from gpumarket.provider.runners.report import Reporter

    if len(sys.argv) != 2:
        print(f"usage: python -m gpumarket.provider.runners.{module_name} WORKDIR",
              file=sys.stderr)
        return 2
    try:
        fn(Path(sys.argv[1]), Reporter())
    except JobError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
