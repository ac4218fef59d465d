"""A job's own view of the filesystem (a mount namespace): private scratch directories and
only the paths it needs inside directories that are closed to it.

In a new mount namespace (root only), before the job drops to its uid:

- every shared scratch directory (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``) is
  covered by a fresh tmpfs of bounded size, so nothing a job leaves there outlives it or is
  seen by the next job, and it cannot fill the host's disk through them;
- a directory on the way to something the job needs (the interpreter, its packages, the work
  directory, the models) that its uid may not pass through or may not list (a Python under
  ``/root``, a data directory under a closed home, the provider's data and jobs directories)
  is covered by an empty tmpfs that shows only those paths, bind-mounted back: the job
  reaches what it needs and sees nothing else there, not even the names (another job's work
  directory is not there to find);
- the control-group directory that holds the job's group beside the other jobs' groups
  (named by their work directories) shows it only its own (``hide_beside``);
- in a job's own PID namespace, ``/proc`` is a new procfs of that namespace: the job sees
  its own processes and no others (``mount_proc``).

Mount events do not propagate back to the host (the new namespace is made private first).
No torch here: this runs in the job process before anything of the job.
"""

from __future__ import annotations

import ctypes
import os
import stat
from pathlib import PurePosixPath

CLONE_NEWNS, CLONE_NEWIPC = 0x00020000, 0x08000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
COVER_BYTES = 1 << 20        # a tmpfs that only holds the mount points of what it shows
MAX_COVERS = 64


class MountError(Exception):
    pass


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    enc = (lambda s: s.encode() if s is not None else None)
    if _libc().mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise MountError(f"mount {fstype or 'bind'} on {target}: {os.strerror(err)}")


def unshare_mounts() -> None:
    """A mount and IPC namespace of this process's own, detached from the host's."""
    if _libc().unshare(CLONE_NEWNS | CLONE_NEWIPC) != 0:
        raise MountError(f"no mount namespace ({os.strerror(ctypes.get_errno())})")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)


def passable(path: str, uid: int, gid: int, *, listable: bool = False) -> bool:
    """Whether ``uid``/``gid`` (with no other groups) may pass through directory ``path``
    (and, with ``listable``, also read its names)."""
    st = os.stat(path)
    if st.st_uid == uid:
        bits = stat.S_IXUSR | (stat.S_IRUSR if listable else 0)
    elif st.st_gid == gid:
        bits = stat.S_IXGRP | (stat.S_IRGRP if listable else 0)
    else:
        bits = stat.S_IXOTH | (stat.S_IROTH if listable else 0)
    return st.st_mode & bits == bits


def _ancestors(path: str) -> list[str]:
    p = PurePosixPath(path)
    return [str(a) for a in reversed(p.parents)] + [str(p)]


def _cover(directory: str, needed: list[str], options: str) -> None:
    """Mount a tmpfs on ``directory`` that shows, of what was there, only the entries on
    the way to ``needed`` paths (bind-mounted back from the originals)."""
    keep = sorted({PurePosixPath(p).relative_to(directory).parts[0] for p in needed
                   if PurePosixPath(p).is_relative_to(directory) and p != directory})
    handles = {}
    try:
        for name in keep:
            handles[name] = os.open(os.path.join(directory, name), os.O_PATH | os.O_NOFOLLOW)
        _mount("tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV, options)
        for name, fd in handles.items():
            target = os.path.join(directory, name)
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.mkdir(target)
            else:
                os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o600))
            _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
    finally:
        for fd in handles.values():
            os.close(fd)


def private_view(needed: list[str], uid: int, gid: int, scratch_bytes: int) -> list[str]:
    """In a new mount namespace, give the job private scratch directories of at most
    ``scratch_bytes`` each and a way through closed directories to ``needed`` paths (real
    paths, no symlinks). Returns what it did, for the job's log. Raises MountError."""
    needed = sorted({os.path.realpath(p) for p in needed if os.path.exists(p)})
    unshare_mounts()
    done = []
    for d in SCRATCH_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            _cover(d, needed, f"size={scratch_bytes},mode=1777")
            done.append(d)
    covered = []
    for _ in range(MAX_COVERS):
        closed = next((a for p in needed for a in _ancestors(p)[:-1]
                       if a not in covered and not passable(a, uid, gid, listable=True)),
                      None)
        if closed is None:
            break
        _cover(closed, needed, f"size={COVER_BYTES},mode=711")
        covered.append(closed)
    else:
        raise MountError("too many closed directories on the way to the job's paths")
    shown = ", ".join(done) or "none"
    return [f"private {shown}"] + ([f"only the job's paths in {', '.join(covered)}"]
                                   if covered else [])


def mount_proc() -> None:
    """A procfs of this process's PID namespace on /proc (in its own mount namespace, as
    the first process of a new PID namespace): the job's processes, and only those."""
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def hide_beside(paths: list[str]) -> None:
    """Cover the directory holding each of ``paths`` so that it shows that path alone (a
    job's own control group, not the groups of the jobs beside it). In the job's own mount
    namespace (``private_view``); raises MountError."""
    for path in paths:
        _cover(os.path.dirname(path), [path], f"size={COVER_BYTES},mode=755")
