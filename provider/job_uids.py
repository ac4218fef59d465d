"""Each daemon's own range of job uids.

Jobs run as unprivileged uids (one per leased device, so jobs on other devices never share
one). Two daemons on one host must never share a uid: one's clean-up would kill the other's
jobs, and their jobs could read each other's work. So each daemon claims a range of its own
from a pool: a lock file per range under ``/run/gpumarket/job-uids``, held (``flock``) for as
long as the daemon runs. A daemon tries the range its provider id hashes to first, so a
restarted daemon gets its old range back when it is free. Ranges that overlap a user of the
host (``/etc/passwd``) or a subordinate-id range (``/etc/subuid``) are skipped.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

POOL = (70_000, 99_999)      # between regular users (..60000) and subordinate ids (100000..)
RANGE_SIZE = 64              # uids per daemon: one per device index
LOCK_DIR = Path("/run/gpumarket/job-uids")


class UidRangeError(Exception):
    pass


@dataclass(frozen=True)
class UidRange:
    first: int
    size: int
    lock_fd: int = -1        # held while the daemon runs

    def uid(self, device_index: int) -> int:
        """The uid of a job whose lowest leased device is ``device_index``."""
        if not 0 <= device_index < self.size:
            raise UidRangeError(f"device index {device_index} is outside the job uid range")
        return self.first + device_index

    def release(self) -> None:
        if self.lock_fd >= 0:
            os.close(self.lock_fd)


def _taken() -> list[tuple[int, int]]:
    """Uid ranges the host already uses: its users and subordinate-id ranges."""
    spans = []
    try:
        for line in Path("/etc/passwd").read_text().splitlines():
            fields = line.split(":")
            if len(fields) > 2 and fields[2].isdigit():
                spans.append((int(fields[2]), int(fields[2])))
    except OSError:
        pass
    try:
        for line in Path("/etc/subuid").read_text().splitlines():
            fields = line.split(":")
            if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
                spans.append((int(fields[1]), int(fields[1]) + int(fields[2]) - 1))
    except OSError:
        pass
    return spans


def claim(owner: str, pool: tuple[int, int] = POOL, lock_dir: Path = LOCK_DIR) -> UidRange:
    """Claim a free range of job uids for the daemon ``owner`` (its provider id); raise
    UidRangeError if the pool has none left (or the lock directory cannot be made)."""
    first, last = pool
    slots = (last - first + 1) // RANGE_SIZE
    if slots <= 0:
        raise UidRangeError(f"job uid pool {first}-{last} is smaller than {RANGE_SIZE} uids")
    try:
        lock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise UidRangeError(f"cannot make {lock_dir} ({exc.strerror})") from exc
    taken = _taken()
    start = int(hashlib.sha256(owner.encode()).hexdigest(), 16) % slots
    for i in range(slots):
        lo = first + ((start + i) % slots) * RANGE_SIZE
        hi = lo + RANGE_SIZE - 1
        if any(a <= hi and lo <= b for a, b in taken):
            continue
        fd = os.open(lock_dir / str(lo), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{owner} {os.getpid()}\n".encode(), 0)
        return UidRange(lo, RANGE_SIZE, fd)
    raise UidRangeError(f"every job uid range of the pool {first}-{last} is in use")
