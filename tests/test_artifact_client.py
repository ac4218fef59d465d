"""The Artifacts client's rules that need no broker: what it does when gRPC hides the
broker's answer behind its own failure to send."""

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
