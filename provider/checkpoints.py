"""Checkpoints as single artifacts: a deterministic tar of the runner's checkpoint directory,
and a safe way back (only the expected plain files, nothing else, nothing outside)."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

from gpumarket.proto.errors import InvalidArgument
from gpumarket.provider.jobfiles import JobFileError, open_beneath, open_dir

# The plain files a checkpoint may hold, by runner: training state, the results so far of
# an inference job, or the frames rendered so far. A checkpoint is exactly one of these sets.
LAYOUTS = (
    ("model.safetensors", "state.safetensors", "state.json", "COMPLETE"),
    ("results.jsonl", "state.json", "COMPLETE"),
    ("frames.tar", "state.json", "COMPLETE"),
    ("state.tar", "state.json", "COMPLETE"),         # a script job's own files
)
FILES = LAYOUTS[0]
MAX_MEMBER_BYTES = 1 << 40


def pack(directory: Path | int, target: Path, owner: int | None = None,
         name: str = "") -> Path:
    """Write the checkpoint files of ``directory`` (a path, or a descriptor the caller
    opened without following links) into the tar ``target`` (fixed order, zeroed times and
    owners, so the same checkpoint always hashes the same). The job wrote these files: a
    link it may have put there instead (say, to the provider's key), or anything but a plain
    file (of ``owner``, if given), is refused (InvalidArgument)."""
    if isinstance(directory, Path):
        name = name or directory.name
        dir_fd = open_dir(directory)
        try:
            return pack(dir_fd, target, owner, name)
        finally:
            os.close(dir_fd)
    dir_fd, name = directory, name or "checkpoint"
    present = set(os.listdir(dir_fd))
    layout = next((files for files in LAYOUTS if set(files) <= present), None)
    if layout is None:
        missing = [n for n in FILES if n not in present]
        raise InvalidArgument(f"checkpoint {name} lacks {', '.join(missing)}")
    with tarfile.open(target, "w", format=tarfile.PAX_FORMAT) as tar:
        for member in layout:
            try:
                fd = open_beneath(dir_fd, member, owner=owner)
            except JobFileError as exc:
                raise InvalidArgument(f"checkpoint {name}: {member} is not a plain file"
                                      f" of the job ({exc.message})") from exc
            with os.fdopen(fd, "rb") as f:
                info = tarfile.TarInfo(member)
                info.size, info.mode = os.fstat(f.fileno()).st_size, 0o644
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



