"""Reading what a job left in its work directory without letting the job point the daemon
elsewhere.

A job owns its work directory: it can replace any name in it (``outputs``, a checkpoint
directory, ``job.log``) with a link to anything the daemon can read, the provider's key
included, at any moment. So the daemon never resolves a path the job controls: it walks from
a directory it opened itself, one component at a time, opening each with ``O_NOFOLLOW``
relative to the last, and takes only plain files that the job's own uid owns. What it reads
it reads from the descriptor it checked, never by name again.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from gpumarket.proto.errors import InvalidArgument

MAX_ENTRIES = 10_000     # more than any runner writes into one directory


class JobFileError(InvalidArgument):
    """What the job left is not what the daemon may take (a link, a device, another's file)."""


def open_dir(path: Path) -> int:
    """A descriptor of ``path`` itself (a directory the daemon made; not a link)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def _parts(rel: str) -> tuple[str, ...]:
    parts = PurePosixPath(rel).parts
    if not parts or rel.startswith("/") or any(p in (".", "..") for p in parts):
        raise JobFileError(f"{rel!r} is not a plain path inside the work directory")
    return parts


def open_beneath(dir_fd: int, rel: str, *, directory: bool = False,
                 owner: int | None = None) -> int:
    """Open ``rel`` below the directory ``dir_fd`` without following any link; return the
    descriptor of a plain file (or a directory). If ``owner`` is given, the file must be
    owned by that uid. Raises JobFileError."""
    parts = _parts(rel)
    fd = os.dup(dir_fd)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            if not last or directory:
                flags |= os.O_DIRECTORY
            try:
                nfd = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                where = "/".join(parts[:i + 1])
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    link = exc.errno == errno.ELOOP or stat.S_ISLNK(
                        os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode)
                    raise JobFileError(f"{where} is {'a link' if link else 'not a directory'}"
                                       ) from exc
                raise JobFileError(f"{where}: {exc.strerror}") from exc
            os.close(fd)
            fd = nfd
        st = os.fstat(fd)
        if not (stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)):
            raise JobFileError(f"{rel} is not a {'directory' if directory else 'plain file'}")
        if owner is not None and st.st_uid != owner:
            raise JobFileError(f"{rel} belongs to uid {st.st_uid}, not to the job")
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_under(workdir: Path, rel: str, *, directory: bool = False,
               owner: int | None = None) -> int:
    """``open_beneath`` from the work directory itself (opened here, not followed)."""
    root = open_dir(workdir)
    try:
        return open_beneath(root, rel, directory=directory, owner=owner)
    finally:
        os.close(root)


@contextmanager
def plain_files(dir_fd: int, rel: str, owner: int | None = None
                ) -> Iterator[list[tuple[str, int]]]:
    """The plain files directly in directory ``rel`` below ``dir_fd``, sorted by name, as
    open descriptors (closed on exit). Anything else in there is an error: a job's outputs
    are plain files. Raises JobFileError."""
    sub = open_beneath(dir_fd, rel, directory=True)
    opened: list[tuple[str, int]] = []
    try:
        names = sorted(os.listdir(sub))
        if len(names) > MAX_ENTRIES:
            raise JobFileError(f"{rel} holds {len(names):,} entries, more than"
                               f" {MAX_ENTRIES:,}")
        for name in names:
            opened.append((name, open_beneath(sub, name, owner=owner)))
        yield opened
    finally:
        for _, fd in opened:
            os.close(fd)
        os.close(sub)

