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

    python -m gpumarket.provider.keyrings UID     # as root: empty UID's keyrings

No torch here: this runs in the job process before anything of the job.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import subprocess
import sys

SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}
KEYCTL_GET_KEYRING_ID, KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_CLEAR = 0, 1, 7
KEYCTL_UNLINK, KEYCTL_GET_PERSISTENT = 9, 22
KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = -3, -4, -5
CLEAR_TIMEOUT_S = 30.0


class KeyringError(Exception):
    def __init__(self, message: str, err: int) -> None:
        super().__init__(message)
        self.errno = err


def keyctl(op: int, *args: int | bytes | None) -> int:
    """keyctl(2); its result, or KeyringError (with the errno) if it failed."""
    number = SYS_KEYCTL.get(platform.machine())
    if number is None:
        raise KeyringError(f"keyctl is not known on {platform.machine()}", errno.ENOSYS)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
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


def main() -> int:
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
