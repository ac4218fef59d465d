"""Many small blobs in one call (Artifacts.UploadBlobs, DownloadBlobs), the servicer called
directly on a real store: each blob hash-checked, a call refused whole (nothing of it stored)
for a bad blob, too many or too large ones, or over the caller's quota; and a provider's
artifact calls budgeted per device it offers."""

from __future__ import annotations

import asyncio
import hashlib
import os

import grpc
import pytest
from gpumarket.broker.api import auth
from gpumarket.broker.api.artifacts import MAX_BLOBS, ArtifactsServicer
from gpumarket.broker.config import BrokerConfig
from gpumarket.broker.state import BrokerState
from gpumarket.broker.store import blob_holdings
from gpumarket.broker.store.artifact_store import ArtifactStore
from gpumarket.broker.store.store import Store
from gpumarket.proto.artifacts import CHUNK_BYTES
from gpumarket.proto.identity import Identity
from gpumarket.proto.v1 import artifacts_pb2 as ap
from gpumarket.proto.v1 import types_pb2 as pb


class Refused(Exception):
    def __init__(self, code, message):
        super().__init__(message)
        self.code, self.message = code, message


class Context:
    async def abort(self, code, message):
        raise Refused(code, message)

    def peer(self):
        return "ipv4:127.0.0.1:1"


@pytest.fixture
def servicer(tmp_path):
    store = Store(tmp_path / "broker.db")
    store.open()
    state = BrokerState(BrokerConfig(data_dir=tmp_path, max_key_artifact_bytes=200_000),
                        Identity.generate(), store,
                        ArtifactStore(tmp_path / "artifacts", 1 << 30))
    yield ArtifactsServicer(state)
    store.close()


def blob(data: bytes) -> ap.Blob:
    return ap.Blob(sha256=hashlib.sha256(data).hexdigest(), data=data)


async def stream(items):
    for i in range(0, len(items), 3):       # three blobs a message
        yield ap.Blobs(blobs=items[i:i + 3])


def upload(servicer, key: str, blobs: list[ap.Blob]):
    async def call():
        auth._caller.set(key)
        return await servicer.UploadBlobs(stream(blobs), Context())
    return asyncio.run(call())


def download(servicer, key: str, shas: list[str]) -> list[ap.Blob]:
    async def call():
        auth._caller.set(key)
        return [b async for m in servicer.DownloadBlobs(ap.DownloadBlobsRequest(sha256=shas),
                                                         Context()) for b in m.blobs]
    return asyncio.run(call())


def stored(servicer, sha: str) -> bool:
    on_disk = servicer.state.artifacts.blob_path(sha).exists()
    held = asyncio.run(servicer.state.store.read(blob_holdings.stored_sizes, [sha]))
    assert on_disk == bool(held), sha      # a blob is on disk exactly when it is recorded
    return on_disk


def download_one(servicer, key: str, sha: str, offset: int = 0) -> bytes:
    async def call():
        auth._caller.set(key)
        return b"".join([r.data async for r in servicer.Download(
            ap.DownloadRequest(sha256=sha, offset=offset), Context())])
    return asyncio.run(call())


def test_small_blobs_go_up_and_come_back_many_to_a_call(servicer):
    a, b = b'{"task": 1}', b'{"task": 2}'
    answer = upload(servicer, "k1", [blob(a), blob(b), blob(a), blob(b"")])
    assert [(r.sha256, r.size_bytes) for r in answer.blobs] == [
        (blob(a).sha256, len(a)), (blob(b).sha256, len(b)), (blob(a).sha256, len(a)),
        (blob(b"").sha256, 0)]
    assert not any(r.already_present for r in answer.blobs)
    for data in (a, b, b""):
        assert servicer.state.artifacts.blob_path(blob(data).sha256).read_bytes() == data
        assert asyncio.run(servicer.state.store.read(blob_holdings.holds, "k1", blob(data).sha256))
    # Several to a message each way; read back whole, in one call or on their own.
    assert [g.data for g in download(servicer, "k1", [blob(b).sha256, blob(a).sha256])] \
        == [b, a]
    assert download_one(servicer, "k1", blob(a).sha256, offset=3) == a[3:]
    # Another key that sends the same bytes holds them too; the blob is not written again.
    again = upload(servicer, "k2", [blob(a)])
    assert again.blobs[0].already_present
    got = download(servicer, "k2", [blob(a).sha256, blob(a).sha256])
    assert [g.data for g in got] == [a, a]


@pytest.mark.parametrize("bad, words", [
    (ap.Blob(sha256=hashlib.sha256(b"x").hexdigest(), data=b"y"), "hash to something else"),
    (ap.Blob(sha256="nothex", data=b"y"), "not a lowercase hex sha256"),
    (blob(os.urandom(CHUNK_BYTES + 1)), "a blob sent whole is at most"),
])
def test_a_call_with_a_bad_blob_stores_nothing(servicer, bad, words):
    good = blob(b"good")
    with pytest.raises(Refused) as exc:
        upload(servicer, "k1", [good, bad])
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in exc.value.message
    assert not stored(servicer, good.sha256)
    assert not os.listdir(servicer.state.artifacts.root / "partial")


def test_a_call_is_bounded_in_blobs_and_by_the_callers_quota(servicer):
    with pytest.raises(Refused) as exc:
        upload(servicer, "k1", [blob(str(i).encode()) for i in range(MAX_BLOBS + 1)])
    assert f"at most {MAX_BLOBS:,} blobs" in exc.value.message
    assert not stored(servicer, blob(b"0").sha256)
    big = [blob(os.urandom(80_000)) for _ in range(3)]     # 240,000 bytes, quota 200,000
    with pytest.raises(Refused) as exc:
        upload(servicer, "k1", big)
    assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not any(stored(servicer, b.sha256) for b in big)
    upload(servicer, "k1", big[:2])
    assert all(stored(servicer, b.sha256) for b in big[:2])


def test_blobs_are_read_only_by_whom_may_read_them(servicer):
    mine = blob(b"mine")
    upload(servicer, "k1", [mine])
    with pytest.raises(Refused) as exc:
        download(servicer, "k2", [mine.sha256])
    assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(Refused) as exc:
        download(servicer, "k1", [mine.sha256] * (MAX_BLOBS + 1))
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_providers_artifact_calls_have_a_budget_for_each_device_it_offers(servicer):
    """A provider running a lease on each of its devices uploads for each: its artifact
    calls are not held to one key's rate, nor do they use up its other calls."""
    state = servicer.state
    state.config = BrokerConfig(data_dir=state.config.data_dir, rate_limit_per_s=2.0)
    checker = auth.Authenticator(state, "broker", plaintext=True)
    session = state.sessions.open("p1")
    session.offer = pb.Offer(devices=[pb.Device(index=i) for i in range(4)])
    upload_call = "/gpumarket.v1.Artifacts/UploadBlobs"
    # Bursts of 5x the rate: 10 calls for a client, 40 artifact calls for a 4-device provider.
    assert sum(checker._allow("client", upload_call) for _ in range(60)) == 10
    assert sum(checker._allow("p1", upload_call) for _ in range(60)) == 40
    assert sum(checker._allow("p1", "/gpumarket.v1.Marketplace/GetJob") for _ in range(60)) \
        == 10
