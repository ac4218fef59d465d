"""The provider's cache of artifacts by sha256: each input or checkpoint is downloaded (and
its hash checked) once per host, then linked into every work directory that needs it."""

from __future__ import annotations

import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

from gpumarket.link.artifacts import ArtifactsClient
from gpumarket.proto.v1 import types_pb2 as pb


class ArtifactCache:
    def __init__(self, root: Path,
                 download: Callable[[Callable[[ArtifactsClient], Awaitable]], Awaitable],
                 on_new: Callable[[], None]) -> None:
        self.root = root                # DATA_DIR/cache
        self.download = download        # runs an Artifacts call, waiting out outages
        self.on_new = on_new            # called when the cache holds a new artifact

    async def put(self, ref: pb.ArtifactRef, target: Path) -> None:
        """Put a verified copy of an artifact at ``target``."""
        self.root.mkdir(parents=True, exist_ok=True)
        cached = self.root / ref.sha256
        if not cached.exists():
            await self.download(lambda a: a.download(ref, cached))
            self.on_new()
        target.unlink(missing_ok=True)
        try:
            target.hardlink_to(cached)
        except OSError:
            shutil.copyfile(cached, target)
