"""Checkpoint safety: a write killed halfway, archives that try to smuggle files, hashes that
do not match, and the interval from reliability."""

from __future__ import annotations

import asyncio
import hashlib
import math
import pickle
import tarfile

import pytest
import torch

from gpumarket.broker.jobs import endings
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs.job import LeaseTerms
from gpumarket.broker.market import reliability
from gpumarket.broker.store import blob_holdings
from gpumarket.broker.store.store import Store
from gpumarket.proto.envelope import seal
from gpumarket.proto.errors import InvalidArgument
from gpumarket.proto.identity import Identity
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider import checkpoints as packing
from gpumarket.provider.runners import checkpoint
from tests.test_broker_domain import new_job


def tiny_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def test_a_write_killed_halfway_leaves_the_previous_checkpoint(tmp_path):
    model, opt, sched = tiny_state()
    good = checkpoint.save(tmp_path, 10, model, opt, sched, {"losses": [[10, 1.0]]})
    # A later write died: its temp dir is half written, and a renamed dir lacks its marker.
    half = tmp_path / ".tmp-step-00000020"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"\x00" * 10)
    torn = tmp_path / "step-00000030"
    torn.mkdir()
    (torn / "state.json").write_text("{")
    assert checkpoint.latest(tmp_path) == good
    model2, opt2, sched2 = tiny_state()
    with torch.no_grad():
        model2.weight.zero_()
    meta = checkpoint.load(good, model2, opt2, sched2)
    assert meta["step"] == 10
    assert torch.equal(model2.weight, model.weight)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        checkpoint.load(torn, model2, opt2, sched2)


def test_checkpoint_archives_round_trip_and_refuse_anything_else(tmp_path):
    model, opt, sched = tiny_state()
    ckpt = checkpoint.save(tmp_path / "c", 5, model, opt, sched, {"losses": []})
    a, b = packing.pack(ckpt, tmp_path / "a.tar"), packing.pack(ckpt, tmp_path / "b.tar")
    assert a.read_bytes() == b.read_bytes()  # deterministic: same checkpoint, same hash
    out = packing.unpack(a, tmp_path / "out")
    assert packing.step_of(out) == 5

    evil = tmp_path / "evil.tar"
    payload = tmp_path / "payload.pkl"
    payload.write_bytes(pickle.dumps({"x": 1}))
    with tarfile.open(evil, "w") as tar:
        for name in packing.FILES:
            tar.add(ckpt / name, arcname=name)
        tar.add(payload, arcname="../../escape.pkl")
    with pytest.raises(InvalidArgument, match="unexpected entries"):
        packing.unpack(evil, tmp_path / "evil-out")
    assert not (tmp_path / "escape.pkl").exists()
    link = tmp_path / "link.tar"
    with tarfile.open(link, "w") as tar:
        for name in packing.FILES[:-1]:
            tar.add(ckpt / name, arcname=name)
        info = tarfile.TarInfo("COMPLETE")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    with pytest.raises(InvalidArgument):
        packing.unpack(link, tmp_path / "link-out")


def test_a_pickled_checkpoint_is_never_unpickled(tmp_path):
    model, opt, sched = tiny_state()
    ckpt = checkpoint.save(tmp_path, 1, model, opt, sched, {"losses": []})
    marker = tmp_path / "pwned"

    class Boom:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (ckpt / "model.safetensors").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(Exception):
        checkpoint.load(ckpt, model, opt, sched)
    assert not marker.exists()


def test_broker_records_only_checkpoints_uploaded_intact(tmp_path):
    store = Store(tmp_path / "b.db")
    store.open()
    broker, client = Identity.generate(), Identity.generate()
    data = b"checkpoint bytes"
    sha = hashlib.sha256(data).hexdigest()

    async def scenario():
        await store.write(jobs.submit, new_job(client), 1)
        await store.write(jobs.create_lease, LeaseTerms("j1", "p1", (0,),
                          1.0, 60_000, 0), 2, lambda lease: seal(broker, lease))
        ref = pb.ArtifactRef(name="checkpoint.tar", sha256=sha, size_bytes=len(data))
        with pytest.raises(InvalidArgument, match="not uploaded intact"):
            await store.write(jobs.record_checkpoint, "j1", 1, "p1", 10, ref, 0.1, 3)
        await store.write(lambda db: db["artifacts"].insert(
            {"sha256": sha, "size_bytes": len(data) + 1, "created_at_ms": 3}))
        with pytest.raises(InvalidArgument, match="not uploaded intact"):  # size differs
            await store.write(jobs.record_checkpoint, "j1", 1, "p1", 10, ref, 0.1, 3)
        await store.write(lambda db: db.execute(
            "UPDATE artifacts SET size_bytes = ? WHERE sha256 = ?", [len(data), sha]))
        with pytest.raises(InvalidArgument, match="not uploaded intact by this provider"):
            await store.write(jobs.record_checkpoint, "j1", 1, "p1", 10, ref, 0.1, 3)
        await store.write(blob_holdings.record, sha, len(data), "p1", 3)    # p1 uploaded it
        assert await store.write(jobs.record_checkpoint, "j1", 1, "p1", 10, ref, 0.1, 3)
        assert not await store.write(jobs.record_checkpoint, "j1", 1, "p1", 5, ref, 0.1, 4)
        await store.write(endings.lose_lease, "j1.1", "missed heartbeats", 5)
        envelope = await store.write(jobs.create_lease, LeaseTerms("j1", "p2", (0,),
                                     1.0, 60_000, 0), 6, lambda lease: seal(broker, lease))
        lease = pb.Lease.FromString(envelope.payload)
        assert lease.resume_from.sha256 == sha and lease.attempt == 2 and lease.epoch == 2

    try:
        asyncio.run(scenario())
    finally:
        store.close()


def test_mtbf_and_young_interval():
    new = reliability.ProviderHistory(uptime_s=0, leases_lost=0, leases_completed=0)
    steady = reliability.ProviderHistory(uptime_s=30 * 86400, leases_lost=2, leases_completed=90)
    flaky = reliability.ProviderHistory(uptime_s=3600, leases_lost=9, leases_completed=1)
    assert reliability.mtbf_s(new) == reliability.PRIOR_UPTIME_S
    assert reliability.mtbf_s(steady) > reliability.mtbf_s(new) > reliability.mtbf_s(flaky)
    assert reliability.checkpoint_interval_s(2.0, 3600) == pytest.approx(math.sqrt(2 * 2 * 3600))
    assert reliability.checkpoint_interval_s(0.001, 10) == reliability.MIN_INTERVAL_S
    assert reliability.checkpoint_interval_s(60, 10**7) == reliability.MAX_INTERVAL_S


def test_a_bloated_safetensors_header_is_refused_before_it_is_read(tmp_path):
    """A checkpoint whose tensor file claims a 1 TiB header (or one longer than the file):
    refused by safetensors' own bound, without reading or allocating it."""
    import resource
    import struct

    model, opt, sched = tiny_state()
    ckpt = checkpoint.save(tmp_path, 1, model, opt, sched, {"losses": []})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for claimed, match in ((1 << 40, "header too large"), (50_000_000, "invalid header length")):
        (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", claimed) + b'{"a":' + b" " * 64)
        with pytest.raises(Exception, match=match):
            checkpoint.load(ckpt, model, opt, sched)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 * 1024, f"peak memory grew by {grown_kib} KiB"
