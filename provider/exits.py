"""How the end of a job's process is noticed when it is not the daemon's own child: a job
forked by a forkserver (``ForkedChild``: its forkserver tells its exit; once the forkserver
is gone, its pid is followed) and a job a restarted daemon re-attached to (executor.py). A
pid is followed through its pidfd (``os.pidfd_open``, Linux 5.3+; it serves any process,
child or not), which the event loop watches: its exit wakes the follower at once. Only where
no pidfd can be had is the pid polled, every POLL_S."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

POLL_S = 0.05                  # how often a process is polled where no pidfd can be had


def pid_runs_in(pid: int, workdir: Path) -> bool:
    """True if ``pid`` is alive and is a job process for ``workdir`` (started for it, or a
    forkserver's child that moved into it)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    if state == "Z" or b"gpumarket.provider.runners" not in b" ".join(cmd):
        return False
    return str(workdir).encode() in cmd or cwd == str(workdir)


def started_at(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot: /proc/PID/stat's field 22), None
    if there is none. With its pid, what tells a process from a later one given that pid."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def signal_group(pgid: int, sig: int, started: int | None = None) -> None:
    """Send ``sig`` to the process group ``pgid`` (a job's: its leader's pid). ``started``:
    when that leader started (``started_at``). Where a process of that pid lives but started
    at another time, the leader was reaped and its group emptied (the kernel gives no pid
    away while a group still uses it) and the pid went to someone else: nothing is sent. On
    a host of 32,768 pids, a late kill of a job's group (after its grace period, or at its
    end) could otherwise end a stranger's process group."""
    if started is not None and started_at(pgid) not in (None, started):
        return
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class ForkedChild:
    """A job process forked by a forkserver (provider/forkservers.py), as much of an
    ``asyncio.subprocess.Process`` as JobProcess uses. The forkserver, its parent, reports
    its end; if the forkserver dies first, the child is followed by pid until it is gone,
    and ``wait()`` returns None (its exit code went with its parent)."""

    def __init__(self, pid: int, workdir: Path) -> None:
        self.pid = pid
        self.workdir = workdir
        self.returncode: int | None = None
        self._orphaned = False
        self._known = asyncio.Event()    # its end was reported, or its forkserver is gone

    def exited(self, code: int) -> None:
        self.returncode = code
        self._known.set()

    def orphaned(self) -> None:
        self._orphaned = True
        self._known.set()

    def running(self) -> bool:
        if self.returncode is not None:
            return False
        return not self._orphaned or pid_runs_in(self.pid, self.workdir)

    async def wait(self) -> int | None:
        await self._known.wait()
        if self.returncode is None:
            await pid_gone(self.pid, self.running)
        return self.returncode


async def pid_gone(pid: int, running: Callable[[], bool]) -> None:
    """Return once ``running()`` is false: checked when the process ``pid`` exits, which its
    pidfd tells the event loop (a pidfd serves any process, our child or not); polled every
    POLL_S where no pidfd can be had (no pidfd_open, or the kernel refuses it)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = -1         # gone already (checked below), or no pidfds here
    try:
        # The pidfd was opened before this check: if the process was the one asked about
        # then, its pidfd is this process's, and its exit is not missed.
        while running():
            if fd < 0:
                await asyncio.sleep(POLL_S)
                continue
            loop = asyncio.get_running_loop()
            readable = loop.create_future()
            try:
                loop.add_reader(fd, _settle, readable)
            except (OSError, ValueError):
                os.close(fd)
                fd = -1
                continue
            try:
                await readable
            finally:
                loop.remove_reader(fd)
            os.close(fd)
            fd = -1     # it exited: should the pid still look alive, it is polled
    finally:
        if fd >= 0:
            os.close(fd)


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
