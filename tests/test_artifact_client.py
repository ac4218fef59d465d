"""The Artifacts client's rules that need no broker: what it does when gRPC hides the
broker's answer behind its own failure to send, and when another upload of the same bytes
moves the broker's partial copy."""

from __future__ import annotations

import asyncio

import pytest

from gpumarket.link.artifacts import ArtifactsClient
from gpumarket.proto.errors import Internal, ResourceExhausted


def test_a_refusal_hidden_by_a_failed_send_is_asked_for(tmp_path, monkeypatch):
    """The broker refuses an upload at its header (over the key's quota) while the data is
    still going out; gRPC then raises its own INTERNAL ("Failed execute_batch"), not the
    broker's RESOURCE_EXHAUSTED. The client asks about the blob and gets the refusal (seen
    once in tests/test_hostile_peers.py under load, as INTERNAL)."""
    blob = tmp_path / "b.bin"
    blob.write_bytes(b"x" * 1000)
    client = ArtifactsClient.__new__(ArtifactsClient)
    sent = []

    async def send(*args):
        sent.append(args)
        raise Internal("Internal error from Core")

    async def stat(sha, size):
        raise ResourceExhausted("1,000 bytes more would be over this broker's limit")

    monkeypatch.setattr(client, "_send", send)
    monkeypatch.setattr(client, "stat", stat)
    with pytest.raises(ResourceExhausted, match="over this broker's limit"):
        asyncio.run(client.upload(blob, "b.bin"))
    assert len(sent) == 1


def test_a_partial_copy_moved_by_another_upload_of_the_same_bytes_is_asked_about_again(
        tmp_path, monkeypatch):
    """Two uploads of the same bytes by one key at once (a cheating test provider's blank
    frames, seen in a fresh-clone run under load): the second is refused while the first is
    in progress, asks, is told 85 bytes are there, and by the time it continues from them the
    first has ended and the broker's copy moved ("must continue at offset 0, not 85"). It
    asks again, finds the blob stored, and is done, where it used to fail its lease."""
    from types import SimpleNamespace

    from gpumarket.link import artifacts
    from gpumarket.proto.errors import FailedPrecondition

    monkeypatch.setattr(artifacts, "RESUME_WAIT_S", 0.0)
    blob = tmp_path / "b.bin"
    blob.write_bytes(b"x" * 85)
    client = ArtifactsClient.__new__(ArtifactsClient)
    sends = [FailedPrecondition("an upload of it by this key is in progress"),
             FailedPrecondition("upload of it must continue at offset 0, not 85")]
    stats = [SimpleNamespace(complete=False, received_bytes=85),
             SimpleNamespace(complete=True, received_bytes=85)]
    offsets = []

    async def send(source, sha, size, offset, on_bytes):
        offsets.append(offset)
        raise sends.pop(0)

    async def stat(sha, size):
        return stats.pop(0)

    monkeypatch.setattr(client, "_send", send)
    monkeypatch.setattr(client, "stat", stat)
    ref = asyncio.run(client.upload(blob, "b.bin"))
    assert ref.size_bytes == 85 and offsets == [0, 85] and not stats
