"""Content addressing helpers shared by every role (no gRPC here)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from typing import BinaryIO
from pathlib import Path

# Well under gRPC's default 4 MiB message limit.
CHUNK_BYTES = 1 << 20


def _open(source: Path | int) -> BinaryIO:
    """A file object for a path, or for a descriptor the caller keeps open (a duplicate, so
    closing it leaves the caller's; reads start at the beginning)."""
    if isinstance(source, int):
        f = os.fdopen(os.dup(source), "rb")
        f.seek(0)
        return f
    return open(source, "rb")


def sha256_file(source: Path | int) -> tuple[str, int]:
    """Return (hex sha256, size in bytes) of a file (a path or an open descriptor), read
    in chunks."""
    h = hashlib.sha256()
    size = 0
    with _open(source) as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def iter_chunks(source: Path | int, offset: int = 0) -> Iterator[bytes]:
    """Yield the file's bytes from ``offset`` in CHUNK_BYTES pieces."""
    with _open(source) as f:
        f.seek(offset)
        while chunk := f.read(CHUNK_BYTES):
            yield chunk


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file, fsync and rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def upload_requests(path: Path | int, sha256: str, size: int, offset: int = 0,
                    on_bytes=None):
    """The messages of one Artifacts.Upload stream: the header, then the file's chunks
    from ``offset`` (to continue a partial upload)."""
    from gpumarket.proto.v1 import artifacts_pb2 as ap

    yield ap.UploadRequest(header=ap.UploadHeader(sha256=sha256, size_bytes=size, offset=offset))
    for chunk in iter_chunks(path, offset):
        if on_bytes is not None:
            on_bytes(len(chunk))
        yield ap.UploadRequest(data=chunk)


async def receive(responses, partial: Path, size_bytes: int, *, append: bool) -> None:
    """Write a Download stream's chunks to ``partial`` (never past the expected size), fsynced."""
    with open(partial, "ab" if append else "wb") as f:
        async for part in responses:
            f.write(part.data)
            if f.tell() > size_bytes:
                break
        f.flush()
        os.fsync(f.fileno())


def publish_verified(partial: Path, target: Path, sha256: str, size_bytes: int) -> bool:
    """Move ``partial`` to ``target`` if its bytes hash to ``sha256``; else delete it and
    return False."""
    digest, size = sha256_file(partial)
    if digest != sha256 or size != size_bytes:
        partial.unlink(missing_ok=True)
        return False
    os.replace(partial, target)
    return True
