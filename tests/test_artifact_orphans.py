"""Files in the artifact store that no row holds are collected: an UploadBlobs call refused
after publishing its blobs (its key went over quota meanwhile), a broker killed between
writing a blob and recording it. Before, garbage collection went by rows only, and such
files stayed on disk for ever."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from types import SimpleNamespace

import pytest

from gpumarket.broker.config import BrokerConfig
from gpumarket.broker.market import scheduler
from gpumarket.broker.store import blob_holdings
from gpumarket.broker.store.artifact_store import ArtifactStore
from gpumarket.proto.errors import ResourceExhausted

DAY = 24 * 3600


def blob(text: str) -> tuple[str, bytes]:
    data = text.encode()
    return hashlib.sha256(data).hexdigest(), data


def age(path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_blobs_no_row_holds_are_swept_after_the_grace(store, tmp_path):
    artifacts = ArtifactStore(tmp_path / "artifacts", 1 << 20)
    state = SimpleNamespace(config=BrokerConfig(data_dir=tmp_path), store=store,
                            artifacts=artifacts)
    kept, refused, young = blob("kept"), blob("refused"), blob("young")

    async def scenario():
        now = int(time.time() * 1000)
        # A key 10 bytes under its quota: the call's blobs are published, then recording
        # them finds the key over quota (another call of it was recorded meanwhile).
        artifacts.publish_blobs(artifacts.stage_blobs([kept, refused, young]))
        await store.write(blob_holdings.record_many, [(kept[0], 4)], "k1", 10, now)
        with pytest.raises(ResourceExhausted):
            await store.write(blob_holdings.record_many, [(refused[0], 7)], "k1", 10, now)
        leftover = artifacts.stage_blobs([blob("staged, never published")])
        for sha, _ in (kept, refused):
            age(artifacts.blob_path(sha), 2 * DAY)
        age(leftover[0][0], 2 * DAY)
        # `kept` is unreferenced too, but its row is only a day old by its own clock: the
        # row-based collection leaves it (its grace runs from the row's created_at).
        await store.write(lambda db: db.execute("UPDATE artifacts SET created_at_ms = ?",
                                                [now]))
        assert await scheduler.collect_garbage(state) == 0
        assert artifacts.blob_path(kept[0]).exists()             # a row holds it
        assert not artifacts.blob_path(refused[0]).exists()      # no row: swept
        assert artifacts.blob_path(young[0]).exists()            # within its grace
        assert not leftover[0][0].exists()                       # a stage never published
        # Written again (the same bytes uploaded once more), an old file is young again:
        # never swept between its write and its row.
        age(artifacts.blob_path(young[0]), 2 * DAY)
        assert artifacts.stage_blobs([young]) == []
        assert artifacts.blob_path(young[0]).stat().st_mtime > time.time() - 60
        # The sweep lists every blob: at most once an hour.
        age(artifacts.blob_path(young[0]), 2 * DAY)
        await scheduler.collect_garbage(state)
        assert artifacts.blob_path(young[0]).exists()

    asyncio.run(scenario())
