"""A job's own PID namespace: the job sees only its own processes (with a /proc of its own,
provider/mounts.py), and when it ends the kernel kills whatever is left in the namespace.

``unshare(CLONE_NEWPID)`` puts the caller's next child into the new namespace as its pid 1,
not the caller. So the job's process — the one the daemon started or its forkserver forked,
and knows by its pid — becomes three:

- the stand-in, the process the daemon knows, outside the namespace: it waits for the
  namespace's init and then ends as the job did (its exit code, or killed by the same
  signal), so the daemon sees the job as before. It passes the drain request on (SIGUSR1,
  which the daemon sends to its pid alone; a yield's and a split's alike) and ignores
  SIGTERM and the like, which the daemon sends to the job's whole process group: the job
  gets them itself, and the stand-in ends after it, not before.
- the init, pid 1 of the namespace: it reaps the job's orphans and passes the drain request
  on; when the job's process ends it reports how and exits, and with it the kernel kills
  every process left in the namespace, however it detached.
- the job's process, pid 2, which returns from ``start_job`` and runs the job.

All three stay in the job's process group and control group; the stand-in and the init take
the job's uid too. So every way the daemon ends a job (its process group, its control group,
its uid) still reaches all of it. No torch here: this runs before anything of the job.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import struct
import sys
from typing import NoReturn

CLONE_NEWPID = 0x20000000
# Sent to the job's pid alone: drain, yield, split (provider/runners/base.py)
FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGURG)
HELD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)   # to its group
SIGNALS = FORWARDED + HELD
STATUS = struct.Struct("i")


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()      # or a child would write the parent's buffer again
        except (OSError, ValueError):
            pass


def _forward_to(pid: int):
    def forward(signum, frame) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    return forward


def enter(uid: int | None, gid: int | None) -> int:
    """Make a new PID namespace and return in its pid 1 (the init to be, which goes on to
    enter the rest of the sandbox); the calling process stays outside as the stand-in, takes
    ``uid`` and never returns. Returns the descriptor on which the init reports the job's
    end (for ``start_job``). Raises OSError."""
    if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWPID) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"no PID namespace ({os.strerror(err)})")
    status_r, status_w = os.pipe()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    _flush()
    pid = os.fork()
    if pid:
        os.close(status_w)
        _stand_in(pid, status_r, mask, uid, gid)
    os.close(status_r)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return status_w


def _stand_in(init: int, status_r: int, mask, uid: int | None, gid: int | None) -> NoReturn:
    code = 1
    try:
        for signum in HELD:
            signal.signal(signum, signal.SIG_IGN)
        for signum in FORWARDED:
            signal.signal(signum, _forward_to(init))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if uid is not None:
            os.setgroups([])
            os.setgid(gid if gid is not None else uid)
            os.setuid(uid)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        _, status = os.waitpid(init, 0)
        reported = os.read(status_r, STATUS.size)
        if len(reported) == STATUS.size:
            status = STATUS.unpack(reported)[0]     # the job's own, not the init's
        if os.WIFSIGNALED(status):
            signum = os.WTERMSIG(status)
            signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
            os.kill(os.getpid(), signum)
            code = 128 + signum          # a signal that does not end a process
        else:
            code = os.waitstatus_to_exitcode(status)
    except BaseException:  # noqa: BLE001 (it never returns into the job's code)
        try:
            os.kill(init, signal.SIGKILL)
        except OSError:
            pass
    os._exit(code)


def start_job(status_w: int) -> None:
    """In the namespace's init (after the rest of the sandbox): fork the job's process and
    return in it. The init reaps every orphan of the job and passes the drain request on
    until the job's process ends, reports its wait status to the stand-in, and exits: the
    kernel then kills whatever is left in the namespace. Raises OSError."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    _flush()
    pid = os.fork()
    if pid == 0:
        os.close(status_w)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return
    _init(pid, status_w, mask)


def _init(job: int, status_w: int, mask) -> NoReturn:
    code = 0
    try:
        # pid 1 gets no signal it has no handler for (SIGKILL from outside excepted): the
        # job's process group's SIGTERM is the job's to handle, not the init's.
        for signum in HELD:
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for signum in FORWARDED:
            signal.signal(signum, _forward_to(job))
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        while True:
            pid, status = os.wait()
            if pid == job:
                os.write(status_w, STATUS.pack(status))
                break
    except BaseException:  # noqa: BLE001 (it never returns into the job's code)
        code = 1            # the stand-in then ends as the init did
    os._exit(code)
