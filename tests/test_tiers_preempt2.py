"""Devices freed for a waiting job are its own (docs/tiers.md, Preemption): a standard job
needing two devices preempts two interruptible leases; the first to yield frees a device
that no interruptible job may take at the next pass (it would be preempted again, before
its start: bench/tiers.py counted twice the preemptions, and a pass for each), and once the
second yields the standard job is leased both. A replica that fits once one device is free
is not held back. Domain level: the broker's own placement pass over a real store."""

from __future__ import annotations

import dataclasses

from gpumarket.broker.jobs import preemption as rows
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs.job import LeaseTerms
from gpumarket.broker.market import preemption, providers, scheduler
from gpumarket.broker.money import ledger
from gpumarket.proto.envelope import open_envelope, seal
from gpumarket.proto.identity import Identity
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import types_pb2 as pb

from tests.servicers import Servicers
from tests.test_ledger import new_job, sign


def two_devices(key: Identity) -> pb.Envelope:
    devices = [pb.Device(index=i, name="fake CPU", uuid=f"FAKE-{i}",
                         accelerator=pb.ACCELERATOR_CPU, memory_bytes=64 << 30, cpu_cores=8,
                         benchmark=pb.Benchmark(matmul_flops=1e11, matmul_dtype="fp32"))
               for i in range(2)]
    return seal(key, pb.Offer(provider_id=key.id, devices=devices, price_per_gpu_hour=0.5,
                              interruptible_price_per_gpu_hour=0.2,
                              kinds=[pb.JOB_KIND_TRAINING], engines=["transformers"],
                              created_at_ms=now_ms(), software_version="0.1.0"))


def market(tmp_path):
    broker = Servicers(tmp_path / "broker")
    provider = Identity.generate()
    offer = two_devices(provider)
    parsed, _ = open_envelope(offer, pb.Offer)
    broker.write(providers.online, provider.id, provider.public_key, 1)
    broker.write(providers.store_offer, provider.id, offer.SerializeToString(), parsed, 1)
    session = broker.state.sessions.open(provider.id)
    session.offer, session.offer_envelope = parsed, seal(provider, parsed)
    broker.write(ledger.credit, "ca", 10**9, "client", "", "op", "k", 1)
    return broker, provider.id


def submit(broker, job_id: str, tier: str, gpus: int = 1) -> None:
    job = new_job(job_id, "ca", 20_000_000, True, gpus=gpus)
    broker.write(jobs.submit, dataclasses.replace(job, needs=dataclasses.replace(
        job.needs, tier=tier)), now_ms())


def leased(broker, provider_id: str) -> dict[str, list[int]]:
    return {job: sorted(map(int, devices.strip("[]").split(","))) for job, devices in
            broker.read(lambda db: db.execute(
                "SELECT job_id, device_indices FROM leases WHERE state = 'active'"
                " AND provider_id = ?", [provider_id]).fetchall())}


def test_a_device_freed_for_a_waiting_job_is_not_leased_to_a_lower_tier(tmp_path):
    broker, p = market(tmp_path)
    try:
        for job_id in ("i1", "i2", "i3"):
            submit(broker, job_id, "interruptible")
        for job_id, device in (("i1", 0), ("i2", 1)):
            broker.write(jobs.create_lease, LeaseTerms(job_id, p, (device,), 0.2, 60_000, 10),
                         now_ms(), sign)
        submit(broker, "s", "standard", gpus=2)
        # The pass: s fits no free device; both interruptible leases yield to it.
        assert broker.run(scheduler.place_queued(broker.state)) == 0
        assert broker.read(rows.waiting_for) == {"s"}
        broker.write(rows.release, "i1", 1, p, "preempted", now_ms())
        # Device 0 is free, kept for s (it needs both): i3 and i1 wait.
        assert broker.run(scheduler.place_queued(broker.state)) == 0
        assert leased(broker, p) == {"i2": [1]}
        broker.write(rows.release, "i2", 1, p, "preempted", now_ms())
        assert broker.run(scheduler.place_queued(broker.state)) == 1
        assert leased(broker, p) == {"s": [0, 1]}
    finally:
        broker.close()


def test_a_job_that_fits_once_a_device_is_free_is_not_held_back(tmp_path, monkeypatch):
    monkeypatch.setattr(preemption, "SERVING_BACKUP", True)
    broker, p = market(tmp_path)
    try:
        for job_id in ("i1", "i2"):
            submit(broker, job_id, "interruptible")
        for job_id, device in (("i1", 0), ("i2", 1)):
            broker.write(jobs.create_lease, LeaseTerms(job_id, p, (device,), 0.2, 60_000, 10),
                         now_ms(), sign)
        # A replica (one device) with a second set of leases: both leases yield to it.
        submit(broker, "r", "serving")
        broker.run(scheduler.place_queued(broker.state))
        asked = broker.read(rows.interruptible_leases, now_ms())
        assert {x.preempt_for for x in asked} == {"r"}
        broker.write(rows.release, asked[0].job_id, 1, p, "preempted", now_ms())
        # The first to yield: the replica takes its device, the other still yielding.
        assert broker.run(scheduler.place_queued(broker.state)) == 1
        assert leased(broker, p) == {"r": list(asked[0].devices),
                                     asked[1].job_id: list(asked[1].devices)}
    finally:
        broker.close()
