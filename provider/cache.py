"""The provider's cache of artifacts by sha256: each input or checkpoint is downloaded (and
its hash checked) once per host, then linked into every work directory that needs it."""

from __future__ import annotations

import asyncio
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
        self.fetching: dict[str, asyncio.Future] = {}    # downloads under way, by sha256

    async def put(self, ref: pb.ArtifactRef, target: Path) -> None:
        """Put a verified copy of an artifact at ``target``."""
        self.root.mkdir(parents=True, exist_ok=True)
        cached = self.root / ref.sha256
        if not cached.exists():
            await self.fetched(ref, cached)
        target.unlink(missing_ok=True)
        try:
            target.hardlink_to(cached)
        except OSError:
            shutil.copyfile(cached, target)

    async def fetched(self, ref: pb.ArtifactRef, cached: Path) -> None:
        """Download an artifact into the cache once, however many leases want it at once
        (each its own download would write the same partial file); a lease that is
        cancelled meanwhile stops waiting, not the download the others wait for."""
        fetching = self.fetching.get(ref.sha256)
        if fetching is None:
            fetching = asyncio.ensure_future(self._fetch(ref, cached))
            self.fetching[ref.sha256] = fetching
            fetching.add_done_callback(lambda f: self._fetch_ended(ref.sha256, f))
        await asyncio.shield(fetching)

    async def _fetch(self, ref: pb.ArtifactRef, cached: Path) -> None:
        await self.download(lambda a: a.download(ref, cached))
        self.on_new()

    def _fetch_ended(self, sha256: str, fetching: asyncio.Future) -> None:
        self.fetching.pop(sha256, None)
        if not fetching.cancelled():
            fetching.exception()        # retrieved: its waiters, if any, raised it
