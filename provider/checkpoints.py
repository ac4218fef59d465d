"""Checkpoints as single artifacts: a deterministic tar of the runner's checkpoint directory,
and a safe way back (only the expected plain files, nothing else, nothing outside)."""

from __future__ import annotations

import os
import stat
import tarfile
from pathlib import Path

from gpumarket.proto.errors import InvalidArgument

# The plain files a checkpoint may hold, by runner: training state, the results so far of
# an inference job, or the frames rendered so far. A checkpoint is exactly one of these sets.
LAYOUTS = (
    ("model.safetensors", "state.safetensors", "state.json", "COMPLETE"),
    ("results.jsonl", "state.json", "COMPLETE"),
    ("frames.tar", "state.json", "COMPLETE"),
)
FILES = LAYOUTS[0]
MAX_MEMBER_BYTES = 1 << 40


def pack(directory: Path, target: Path) -> Path:
    """Write ``directory``'s checkpoint files into the tar ``target`` (fixed order, zeroed
    times and owners, so the same checkpoint always hashes the same)."""
    layout = next((files for files in LAYOUTS
                   if all((directory / name).is_file() for name in files)), None)
    if layout is None:
        missing = [n for n in FILES if not (directory / n).is_file()]
        raise InvalidArgument(f"checkpoint {directory.name} lacks {', '.join(missing)}")
    with tarfile.open(target, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in layout:
            # The job wrote these files: never follow a link it may have put there instead
            # (say, to the provider's key), and take only a regular file.
            try:
                fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError as exc:
                raise InvalidArgument(f"checkpoint {directory.name}: {name} is not a plain"
                                      f" file ({exc.strerror})") from exc
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise InvalidArgument(f"checkpoint {directory.name}: {name} is not a"
                                          " plain file")
                info = tarfile.TarInfo(name)
                info.size, info.mode = st.st_size, 0o644
                tar.addfile(info, f)
    return target


def unpack(archive: Path, target: Path) -> Path:
    """Extract a checkpoint tar into ``target``; refuse anything but the expected files."""
    target.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive, "r:") as tar:
            members = tar.getmembers()
            names = [m.name for m in members]
            if sorted(names) not in [sorted(files) for files in LAYOUTS] or not all(
                    m.isfile() for m in members):
                raise InvalidArgument("checkpoint archive holds unexpected entries")
            for m in members:
                if m.size > MAX_MEMBER_BYTES:
                    raise InvalidArgument(f"checkpoint entry {m.name} is too large")
                src = tar.extractfile(m)
                with open(target / m.name, "wb") as out:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
    except tarfile.TarError as exc:
        raise InvalidArgument(f"checkpoint archive is unreadable ({exc})") from exc
    return target


def step_of(directory: Path) -> int:
    import json

    try:
        return int(json.loads((directory / "state.json").read_text())["step"])
    except (OSError, ValueError, KeyError) as exc:
        raise InvalidArgument("checkpoint has no readable step") from exc



