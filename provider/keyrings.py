"""A job's kernel keyrings (keyrings(7)): nothing of the daemon's, nothing of an earlier job.

A process's session keyring is inherited, and whoever holds it as its session keyring
possesses it, so a job that kept the daemon's could read what is in it. The uid's own
keyrings — its user keyring ``@u``, user session keyring ``@us`` and persistent keyring — live
in the kernel beyond the uid's processes, so a job could leave keys there for the next job of
its uid (the next lease on its device) or read what an earlier one left.

So a job's process, right after it takes the job's uid and before anything of the job runs,
joins a new anonymous session keyring and empties the uid's own ones (``fresh``); and the daemon
empties them again when the job has ended (``clear_as``, in a child that takes the uid: the
kernel lets only a keyring's possessor or owner clear it, not root as such).

A job's end does that for every lease: rather than start an interpreter each time (most of a
short lease's end), the daemon keeps one ``Ender`` (this file run with ``--serve``: the
standard library alone, no threads, so forking it is safe and cheap) that forks a child per
order; the child takes the uid, sends SIGKILL to every process of it (``kill(-1)``: the
kernel reaches all of them at once, and a fork racing it is either reached or fails) and
then empties its keyrings.

    python -m gpumarket.provider.keyrings UID     # as root: empty UID's keyrings

No torch here: this runs in the job process before anything of the job.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import signal
import subprocess
import sys
import threading

SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}
KEYCTL_GET_KEYRING_ID, KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_CLEAR = 0, 1, 7
KEYCTL_UNLINK, KEYCTL_GET_PERSISTENT = 9, 22
KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = -3, -4, -5
CLEAR_TIMEOUT_S = 30.0


class KeyringError(Exception):
    def __init__(self, message: str, err: int) -> None:
        super().__init__(message)
        self.errno = err


_libc: list = []


def keyctl(op: int, *args: int | bytes | None) -> int:
    """keyctl(2); its result, or KeyringError (with the errno) if it failed."""
    number = SYS_KEYCTL.get(platform.machine())
    if number is None:
        raise KeyringError(f"keyctl is not known on {platform.machine()}", errno.ENOSYS)
    if not _libc:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        _libc.append(libc)
    libc = _libc[0]
    wire = [ctypes.c_char_p(a) if isinstance(a, bytes) or a is None else ctypes.c_long(a)
            for a in args]
    result = libc.syscall(ctypes.c_long(number), ctypes.c_long(op), *wire)
    if result < 0:
        err = ctypes.get_errno()
        raise KeyringError(f"keyctl {op}: {os.strerror(err)}", err)
    return result


def session_id() -> int:
    """The id of this process's session keyring (0 if it has none yet)."""
    try:
        return keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 0)
    except KeyringError as exc:
        if exc.errno == errno.ENOKEY:
            return 0
        raise


def fresh(clear: bool) -> None:
    """Join a new anonymous session keyring; if ``clear``, empty this uid's user, user
    session and persistent keyrings too (call as the job's uid, not as the daemon's: they
    are the uid's own). Raises KeyringError."""
    keyctl(KEYCTL_JOIN_SESSION_KEYRING, None)
    if not clear:
        return
    for spec in (KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING):
        keyctl(KEYCTL_CLEAR, spec)
    try:        # linked into the new session keyring to be reached, emptied, unlinked
        persistent = keyctl(KEYCTL_GET_PERSISTENT, -1, KEY_SPEC_SESSION_KEYRING)
    except KeyringError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
            return          # a kernel without persistent keyrings
        raise
    keyctl(KEYCTL_CLEAR, persistent)
    keyctl(KEYCTL_UNLINK, persistent, KEY_SPEC_SESSION_KEYRING)


def clear_as(uid: int) -> bool:
    """Empty ``uid``'s keyrings from the daemon (root): a child of its own started as root
    takes the uid, then clears them (``fresh``). False if that failed."""
    try:
        # This file alone, run by path without site (it imports only the standard library):
        # a Python's start-up, no more.
        r = subprocess.run([sys.executable, "-I", "-S", os.path.abspath(__file__), str(uid)],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env={}, close_fds=True,
                           timeout=CLEAR_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


class Ender:
    """The daemon's end of one ``--serve`` process (started on first use, again if it died):
    ``end(uid, keyrings)`` kills every process of ``uid`` and, if ``keyrings``, empties its
    keyrings, in a child forked for it. Thread-safe (one order at a time)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None

    def end(self, uid: int, keyrings: bool) -> bool:
        """True if the child killed and (if asked) emptied; False if it failed or there is no
        server (the caller then does it the slow way)."""
        if uid <= 0:
            return False
        with self.lock:
            for _ in range(2):      # a server that died is started once more
                try:
                    if self.proc is None or self.proc.poll() is not None:
                        self.proc = subprocess.Popen(
                            [sys.executable, "-I", "-S", os.path.abspath(__file__), "--serve"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env={}, close_fds=True,
                            start_new_session=True)
                    self.proc.stdin.write(f"{uid} {int(keyrings)}\n".encode())
                    self.proc.stdin.flush()
                    answer = self.proc.stdout.readline()
                    if answer:
                        return answer.strip() == b"0"
                except OSError:
                    pass
                self.close()
            return False

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass


def _end(uid: int, clear: bool) -> int:
    """In a forked child: take ``uid``, SIGKILL all of its processes, empty its keyrings."""
    try:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        try:
            os.kill(-1, signal.SIGKILL)     # every process of the uid but this one
        except ProcessLookupError:
            pass                            # none
        if clear:
            fresh(clear=True)
    except (OSError, KeyringError):
        return 1
    return 0


def serve() -> int:
    """Answer "UID KEYRINGS" lines on stdin, "0" (done) or "1" (failed) each, until EOF."""
    for line in sys.stdin.buffer:
        parts = line.split()
        if len(parts) != 2 or not parts[0].isdigit() or int(parts[0]) <= 0:
            code = 1
        else:
            pid = os.fork()
            if pid == 0:
                os._exit(_end(int(parts[0]), parts[1] == b"1"))
            _, status = os.waitpid(pid, 0)
            code = 0 if os.waitstatus_to_exitcode(status) == 0 else 1
        sys.stdout.write(f"{code}\n")
        sys.stdout.flush()
    return 0


def main() -> int:
    if sys.argv[1:] == ["--serve"]:
        return serve()
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        print("usage: python -m gpumarket.provider.keyrings UID", file=sys.stderr)
        return 2
    uid = int(sys.argv[1])
    try:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        fresh(clear=True)
    except (OSError, KeyringError) as exc:
        print(f"error: keyrings of uid {uid}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
