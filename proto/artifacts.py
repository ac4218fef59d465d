"""Content addressing helpers shared by every role (no gRPC here)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

# Well under gRPC's default 4 MiB message limit.
CHUNK_BYTES = 1 << 20


def sha256_file(path: Path) -> tuple[str, int]:
    """Return (hex sha256, size in bytes) of a file, read in chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def iter_chunks(path: Path, offset: int = 0) -> Iterator[bytes]:
    """Yield the file's bytes from ``offset`` in CHUNK_BYTES pieces."""
    with open(path, "rb") as f:
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
