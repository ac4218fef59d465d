"""Blobs on disk named by their sha256, written atomically; partial uploads resume."""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from gpumarket.proto.artifacts import CHUNK_BYTES
from gpumarket.proto.errors import FailedPrecondition, InvalidArgument, NotFound
from gpumarket.proto.jobspec import check_sha256

SYNC_THREADS = 16       # small blobs synced at once
_staged = itertools.count()


@dataclass(frozen=True)
class BlobStat:
    complete: bool
    size_bytes: int
    received_bytes: int


class ArtifactStore:
    """Files under ``root/blobs/ab/<sha256>``; uploads in progress under ``root/partial``."""

    def __init__(self, root: Path, max_blob_bytes: int) -> None:
        self.root = root
        self.max_blob_bytes = max_blob_bytes
        self.active: set[tuple[str, str]] = set()   # (sha256, uploader) being streamed now
        self.orphans_due = 0.0      # monotonic time of the next sweep for files no row holds
        self._syncs = ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="blob-sync")
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        (root / "partial").mkdir(parents=True, exist_ok=True)

    def blob_path(self, sha256: str) -> Path:
        check_sha256(sha256, "sha256")
        return self.root / "blobs" / sha256[:2] / sha256

    def _partial_path(self, sha256: str, uploader: str) -> Path:
        """Each uploader's partial upload of a blob is its own file: no one can add bytes
        to another's upload."""
        check_sha256(sha256, "sha256")
        if not uploader.isalnum():
            raise InvalidArgument("uploader must be a key id")
        return self.root / "partial" / f"{sha256}.{uploader}"

    def stat(self, sha256: str, uploader: str) -> BlobStat:
        path = self.blob_path(sha256)
        if path.exists():
            size = path.stat().st_size
            return BlobStat(True, size, size)
        return BlobStat(False, 0, self.received(sha256, uploader))

    def received(self, sha256: str, uploader: str) -> int:
        """Bytes of ``uploader``'s partial upload of the blob kept so far."""
        partial = self._partial_path(sha256, uploader)
        return partial.stat().st_size if partial.exists() else 0

    def check_size(self, size_bytes: int) -> None:
        if size_bytes > self.max_blob_bytes:
            raise InvalidArgument(
                f"artifact of {size_bytes} bytes is over the broker's limit of"
                f" {self.max_blob_bytes} bytes"
            )

    def begin_upload(self, sha256: str, size_bytes: int, offset: int, uploader: str,
                     may_skip: bool = True) -> "Upload | None":
        """Start or continue ``uploader``'s upload of a blob; None if the blob is stored
        already and ``may_skip``. Without it, every byte (even of a stored blob: that is how
        an uploader proves it has it), checked like a new blob."""
        self.check_size(size_bytes)
        if may_skip and self.blob_path(sha256).exists():
            return None
        received = self.received(sha256, uploader)
        if offset != received:
            raise FailedPrecondition(
                f"upload of {sha256[:12]} must continue at offset {received}, not {offset}"
            )
        if (sha256, uploader) in self.active:
            raise FailedPrecondition(f"an upload of {sha256[:12]} by this key is in progress")
        return Upload(self, sha256, size_bytes, offset, self._partial_path(sha256, uploader),
                      uploader)

    def stage_blobs(self, blobs: list[tuple[str, bytes]]) -> list[tuple[Path, Path]]:
        """Write whole small blobs (sha256, bytes; each hash-checked by the caller) that are
        not stored yet, each to a temporary file of its own, synced; return (temporary,
        final) paths for publish_blobs or discard_blobs. The files are synced together, by
        one sync of their file system where the platform has it (syncfs): staging 500
        small files cost 185 ms of CPU and 0.46-0.57 s with an fsync each (at once, in
        threads), 19 ms and 60-76 ms with one sync (load 11 here); elsewhere an fsync each,
        all at once (in threads, sharing journal commits). One sync waits for every dirty
        page of that file system, a large upload's being written beside it included."""
        staged: list[tuple[int, Path, Path]] = []
        try:
            for sha, data in dict(blobs).items():
                target = self.blob_path(sha)
                if target.exists():
                    _touch(target)      # in use again: not an orphan to sweep (old_files)
                    continue
                tmp = self.root / "partial" / f"{sha}.{os.getpid()}.{next(_staged)}.blob"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                staged.append((fd, tmp, target))
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            if staged and not _sync_file_system(staged[0][0]):
                list(self._syncs.map(os.fsync, [fd for fd, _, _ in staged]))
        except BaseException:
            self.discard_blobs([(tmp, target) for _, tmp, target in staged])
            raise
        finally:
            for fd, _, _ in staged:
                os.close(fd)
        return [(tmp, target) for _, tmp, target in staged]

    def publish_blobs(self, staged: list[tuple[Path, Path]]) -> None:
        """Move staged blobs into place (each one atomically), their directories synced:
        once this returns, every blob the caller staged or found stored is durable. (A blob
        found stored may be another call's, moved into place and not yet synced: the one
        sync of the file system covers it too. Without syncfs, the directories of this
        call's blobs are synced, at once, as the files were.)"""
        dirs: set[Path] = set()
        for tmp, target in staged:
            if target.parent not in dirs:
                target.parent.mkdir(exist_ok=True)
                dirs.add(target.parent)
            os.replace(tmp, target)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            synced = _sync_file_system(fd)
        finally:
            os.close(fd)
        if not synced:
            list(self._syncs.map(_sync_dir, dirs))

    @staticmethod
    def discard_blobs(staged: list[tuple[Path, Path]]) -> None:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)

    def old_files(self, before: float) -> list[tuple[str, Path]]:
        """Stored blobs (sha256, path) and staged files ("", path) last written before
        ``before`` (a time.time()): what garbage collection looks at for files no row holds
        — a call refused after its blobs were published, a broker killed between writing a
        blob and recording it. A blob written again is touched (stage_blobs), so one being
        recorded now is never this old."""
        found: list[tuple[str, Path]] = []
        for entry in _entries(self.root / "partial"):
            if entry.name.endswith(".blob") and entry.stat().st_mtime < before:
                found.append(("", Path(entry.path)))
        for shard in _entries(self.root / "blobs"):
            if not shard.is_dir():
                continue
            for entry in _entries(Path(shard.path)):
                if entry.stat().st_mtime < before:
                    found.append((entry.name, Path(entry.path)))
        return found

    def read_blob(self, sha256: str, limit: int) -> bytes:
        """The bytes of a stored blob of at most ``limit`` bytes (NotFound; InvalidArgument
        for a larger one)."""
        try:
            with open(self.blob_path(sha256), "rb") as f:
                data = f.read(limit + 1)
        except FileNotFoundError as exc:
            raise NotFound(f"no artifact {sha256}") from exc
        if len(data) > limit:
            raise InvalidArgument(f"artifact {sha256[:12]}… is over {limit:,} bytes: download"
                                  " it on its own")
        return data

    def drop_partial(self, sha256: str, uploader: str) -> bool:
        """Delete an abandoned partial upload (not one being streamed now)."""
        if (sha256, uploader) in self.active:
            return False
        self._partial_path(sha256, uploader).unlink(missing_ok=True)
        return True

    def open_read(self, sha256: str, offset: int):
        path = self.blob_path(sha256)
        try:
            f = open(path, "rb")
        except FileNotFoundError as exc:
            raise NotFound(f"no artifact {sha256}") from exc
        f.seek(offset)
        return f


class Upload:
    """One upload stream's writer; finish() verifies the hash and publishes the blob."""

    def __init__(self, store: ArtifactStore, sha256: str, size_bytes: int, offset: int,
                 path: Path, uploader: str) -> None:
        self.store = store
        self.sha256 = sha256
        self.size_bytes = size_bytes
        self.received = offset
        self.path = path
        self._file = open(self.path, "ab")
        self._key = (sha256, uploader)
        store.active.add(self._key)

    def write(self, data: bytes) -> None:
        if len(data) > CHUNK_BYTES:
            raise InvalidArgument(f"upload chunk of {len(data)} bytes is over {CHUNK_BYTES}")
        if self.received + len(data) > self.size_bytes:
            raise InvalidArgument(f"upload of {self.sha256[:12]} is longer than its declared size")
        self._file.write(data)
        self.received += len(data)

    def close(self) -> None:
        """Keep what arrived (flushed) so a broken upload can resume."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        self.store.active.discard(self._key)

    def finish(self) -> int:
        """Verify and publish; return the size. The partial file is dropped on a mismatch."""
        self.close()
        if self.received != self.size_bytes:
            raise FailedPrecondition(
                f"upload of {self.sha256[:12]} ended at {self.received} of {self.size_bytes} bytes;"
                " resume it"
            )
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                h.update(chunk)
        if h.hexdigest() != self.sha256:
            self.path.unlink(missing_ok=True)
            raise InvalidArgument(
                f"uploaded bytes hash to {h.hexdigest()[:12]}…, not {self.sha256[:12]}…"
            )
        target = self.store.blob_path(self.sha256)
        target.parent.mkdir(exist_ok=True)
        os.replace(self.path, target)
        return self.size_bytes


def _entries(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except FileNotFoundError:
        pass


_syncfs: list = []      # libc's syncfs, looked up on first use; [None] where there is none


def _sync_file_system(fd: int) -> bool:
    """Make everything written to the file system that holds ``fd`` durable, with one
    syncfs(2) (OSError if it fails); False where the platform has no syncfs (the caller
    syncs each file then)."""
    if not _syncfs:
        try:
            _syncfs.append(getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None))
        except OSError:
            _syncfs.append(None)
    if _syncfs[0] is None:
        return False
    if _syncfs[0](fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs: {os.strerror(err)}")
    return True


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
