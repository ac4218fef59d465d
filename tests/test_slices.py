"""Devices offered as slices (docs/provider.md, Slices), at the domain level: the provider's
config and inventory, the offer it signs, the broker's check of it, the matcher's views and
placement's plan over them (a small job on a slice, a big one on the whole card, a card and
its slices never leased at once), and a CPU slice's cores as its own job process sees them."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpumarket.broker.api.gateway import check_offer
from gpumarket.broker.market import offers, placement, reliability
from gpumarket.broker.market.admission import Needs
from gpumarket.broker.market.matcher import Book, JobNeeds
from gpumarket.proto import slices
from gpumarket.proto.envelope import open_envelope
from gpumarket.proto.errors import InvalidArgument
from gpumarket.proto.identity import Identity
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider import config as provider_config
from gpumarket.provider.config import ProviderConfig
from gpumarket.provider.executor import JobProcess, job_env, slice_env
from gpumarket.provider.inventory import DeviceInfo, busy, config_slices, sliced
from gpumarket.provider.offering import build_offer

from tests.test_placement_plan import job

TRAIN, CPU, CUDA = pb.JOB_KIND_TRAINING, pb.ACCELERATOR_CPU, pb.ACCELERATOR_CUDA
GIB = 1 << 30
HISTORY = reliability.ProviderHistory(uptime_s=86400.0, leases_lost=0, leases_completed=10)


def cpu(index: int = 0, cores: int = 4, memory_gib: int = 16) -> DeviceInfo:
    return DeviceInfo(index=index, name="test CPU", uuid=f"CPU-test-{index}", accelerator=CPU,
                      memory_bytes=memory_gib * GIB, cpu_cores=cores,
                      cores=tuple(range(index * cores, (index + 1) * cores)))


def gpu(index: int = 0, memory_gib: int = 80) -> DeviceInfo:
    return DeviceInfo(index=index, name="NVIDIA H100", uuid=f"GPU-test-{index}",
                      accelerator=CUDA, memory_bytes=memory_gib * GIB,
                      compute_capability="9.0")


def signed(devices: list[DeviceInfo], identity: Identity | None = None, price: float = 2.0,
           limits: dict | None = None) -> pb.Offer:
    identity = identity or Identity.generate()
    config = ProviderConfig(broker="", data_dir=Path("/nonexistent"), price_per_gpu_hour=price)
    bench = pb.Benchmark(matmul_flops=1e12, matmul_dtype="fp32")
    env = build_offer(config, identity, devices, {d.index: bench for d in devices
                                                  if not d.is_slice},
                      {TRAIN}, frozenset({"transformers"}), limits=limits)
    offer, signer = open_envelope(env, pb.Offer)
    check_offer(offer, signer)
    return offer


def book_of(*offer_list: pb.Offer, busy_by: dict | None = None) -> Book:
    busy_by = busy_by or {}
    return Book([v for o in offer_list for v in offers.offer_views(
        o, HISTORY, 0.0, frozenset(busy_by.get(o.provider_id, ())))])


def need(job_id: str, memory_gib: float, gpus: int = 1, client: str = "alice",
         **more) -> JobNeeds:
    return JobNeeds(job_id=job_id, kind=TRAIN, gpus=gpus, min_memory_bytes=int(memory_gib * GIB),
                    accelerator=pb.ACCELERATOR_UNSPECIFIED, max_price_per_gpu_hour=10.0,
                    client_id=client, work_flops=1e15, **more)


# -- the provider: config, inventory, offer ----------------------------------------------


def test_config_takes_a_count_or_shares_and_refuses_what_no_card_has(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('slices = 2\n[devices.1]\nslices = [0.5, 0.25, 0.25]\n')
    settings = provider_config.load(path)
    assert settings["slices"] == (0.5, 0.5)
    assert settings["device_slices"] == {1: (0.5, 0.25, 0.25)}
    config = provider_config.build({"broker": "", "data_dir": tmp_path, **settings})
    assert config.slice_shares([cpu(0), cpu(1)]) == {0: (0.5, 0.5), 1: (0.5, 0.25, 0.25)}
    for text, why in (("slices = 1000", "2 to 8 slices"),
                      ("slices = [0.5, 0.75]", "sum to 1.25"),
                      ("slices = [-0.5, 0.5]", "share must be a number"),
                      ("slices = [0.5, nan]", "share must be a number"),
                      ('slices = "half"', "a number of slices, or a list")):
        path.write_text(text + "\n")
        with pytest.raises(InvalidArgument, match=why):
            provider_config.load(path)


def test_a_cpu_slice_has_its_own_cores_and_its_share_of_memory():
    devices = sliced([cpu(0, cores=4, memory_gib=16)], {0: (0.5, 0.25, 0.25)})
    whole, *parts = devices
    assert [d.index for d in devices] == [0, 1, 2, 3] and not whole.is_slice
    assert [(d.slice_of, d.share, d.cores, d.cpu_cores) for d in parts] == [
        (0, 0.5, (0, 1), 2), (0, 0.25, (2,), 1), (0, 0.25, (3,), 1)]
    assert [d.memory_bytes for d in parts] == [8 * GIB, 4 * GIB, 4 * GIB]
    # a card with a slice leased is busy, the slice's siblings are not; a card leased whole
    # makes every slice busy
    assert busy(devices, {2}) == {2, 0}
    assert busy(devices, {0}) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="cannot give 3 slices a core each"):
        sliced([cpu(0, cores=2)], {0: (0.34, 0.33, 0.33)})
    with pytest.raises(ValueError, match="no whole device"):
        sliced([cpu(0)], {5: (0.5, 0.5)})


def test_a_gpu_slice_is_its_cards_uuid_to_cuda_with_its_memory_fraction():
    card, s0, s1 = sliced([gpu(0)], {0: (0.5, 0.5)}, mps=False)
    assert (s0.visible_id, s1.visible_id) == (card.uuid, card.uuid)
    env = slice_env([s1])
    assert env["GPUMARKET_MEMORY_FRACTION"] == "0.5"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert "GPUMARKET_CPU_CORES" not in env and slice_env([card]) == {}


def test_the_offer_names_each_slices_card_share_and_price():
    offer = signed(sliced([cpu(0)], {0: (0.5, 0.25, 0.25)}), price=2.0,
                   limits={"memory": "cgroup v2", "pids": "cgroup v2", "cpu": "cgroup v2"})
    whole, *parts = offer.devices
    assert not whole.HasField("slice_of") and whole.price_per_hour == 0.0
    assert [(d.slice_of, d.memory_share, d.compute_share, d.price_per_hour, d.compute_held)
            for d in parts] == [(0, 0.5, 0.5, 1.0, True), (0, 0.25, 0.25, 0.5, True),
                                (0, 0.25, 0.25, 0.5, True)]
    # the offer's price per device-hour stays the whole card's
    assert offers.offer_price(offer) == 2.0
    # a CUDA slice without an MPS daemon says its compute share is not held
    gpu_offer = signed(sliced([gpu(0)], {0: (0.5, 0.5)}, mps=False))
    assert not any(d.compute_held for d in gpu_offer.devices)


# -- the broker: hostile offers ------------------------------------------------------------


def _tampered(change) -> pb.Offer:
    offer = signed(sliced([cpu(0)], {0: (0.5, 0.5)}))
    change(offer)
    return offer


@pytest.mark.parametrize("change, why", [
    (lambda o: [o.devices.append(pb.Device(index=10 + i, accelerator=CPU, memory_bytes=1,
                                            slice_of=0, memory_share=0.001,
                                            compute_share=0.001)) for i in range(998)],
     "device 0 is offered as 1,000 slices; at most 8"),
    (lambda o: setattr(o.devices[1], "memory_share", 0.75), "memory shares sum to 1.25"),
    (lambda o: setattr(o.devices[2], "compute_share", 0.9), "compute shares sum to 1.4"),
    (lambda o: setattr(o.devices[1], "memory_share", -0.5), "memory share must be a number"),
    (lambda o: setattr(o.devices[1], "compute_share", math.nan),
     "compute share must be a number"),
    (lambda o: setattr(o.devices[1], "slice_of", 7), "device 7: a slice names no whole"),
    (lambda o: setattr(o.devices[2], "slice_of", 1), "device 1: a slice names no whole"),
    (lambda o: setattr(o.devices[1], "memory_bytes", o.devices[0].memory_bytes),
     "claims more memory than its share"),
    (lambda o: setattr(o.devices[1], "accelerator", CUDA), "another accelerator"),
])
def test_the_broker_refuses_an_offer_whose_slices_break_a_rule(change, why):
    offer = _tampered(change)
    with pytest.raises(InvalidArgument, match=why):
        check_offer(offer, offer.provider_id)


# -- the matcher and the plan ----------------------------------------------------------------


def test_a_small_job_goes_to_a_slice_a_big_one_to_the_whole_card():
    offer = signed(sliced([cpu(0, memory_gib=16)], {0: (0.5, 0.5)}), price=2.0)
    book = book_of(offer)
    assert [(v.device_indices, v.slices, v.price_per_gpu_hour) for v in book.offers] == [
        ((0,), False, 2.0), ((1, 2), True, 1.0)]
    small, _ = book.place(need("small", 4))
    assert small.device_indices == (1,) and small.price_per_gpu_hour == 1.0
    assert book.offers[small.offer_index].slices
    # the card has a slice leased: a job that needs all of it waits (busy), a small one
    # takes the other slice
    placed, why = book.place(need("big", 12))
    assert placed is None and why == {"memory": 1, "busy": 1}
    other, _ = book.place(need("small2", 4))
    assert other.device_indices == (2,)
    book.release(small.offer_index, small.device_indices)
    book.release(other.offer_index, other.device_indices)
    big, _ = book.place(need("big", 12))
    assert big.device_indices == (0,) and big.price_per_gpu_hour == 2.0
    # the card is leased whole: no slice of it is free
    placed, why = book.place(need("small3", 4))
    assert placed is None and why == {"busy": 2}


def test_the_fastest_objective_takes_the_whole_card_and_two_devices_never_slices():
    offer = signed(sliced([cpu(0), cpu(1)], {0: (0.5, 0.5)}))
    book = book_of(offer)
    fast, _ = book.place(need("fast", 1, objective="fastest"))
    assert fast.device_indices in {(0,), (1,)}
    pair, _ = book_of(offer).place(need("pair", 1, gpus=2))
    assert pair.device_indices == (0, 1)
    # with card 0 sliced and leased as a slice, a two-device job waits for it
    book = book_of(offer, busy_by={offer.provider_id: {2}})
    placed, why = book.place(need("pair", 1, gpus=2))
    assert placed is None and "busy" in why


def test_leased_slices_and_cards_are_busy_as_the_broker_reads_them():
    offer = signed(sliced([cpu(0)], {0: (0.5, 0.5)}))
    pid = offer.provider_id
    assert offers.free_devices(offer, {2}) == 1              # slice 1 only
    assert offers.free_devices(offer, {0}) == 0
    book = book_of(offer, busy_by={pid: {0}})
    assert book.place(need("small", 1))[0] is None
    book = book_of(offer, busy_by={pid: {1}})
    assert book.place(need("small", 1))[0].device_indices == (2,)


def test_two_clients_jobs_run_at_once_on_two_slices_of_one_card():
    offer = signed(sliced([cpu(0, memory_gib=16)], {0: (0.5, 0.5)}), price=2.0)
    def queued(job_id, client, created, memory_gib):
        j = job(job_id, client, created=created)
        stored = Needs(kind=TRAIN, gpus=1, min_memory_bytes=memory_gib * GIB,
                       accelerator=pb.ACCELERATOR_UNSPECIFIED, max_price_per_gpu_hour=10.0)
        return placement.Queued(j, stored, stored.view(j.id, j.client_id))

    jobs = [queued("a", "alice", 1, 4), queued("b", "bob", 2, 4), queued("c", "carol", 3, 12)]
    p = placement.plan(jobs, book_of(offer), {}, {offer.provider_id}, 60_000)
    assert sorted((x.job.id, x.terms.device_indices, x.terms.price_per_gpu_hour)
                  for x in p.leases) == [("a", (1,), 1.0), ("b", (2,), 1.0)]
    assert p.reasons["c"].startswith("waiting: of 2 offers") and [j.id for j, _ in p.blocked] == ["c"]


# -- the provider: a slice's share inside its job ------------------------------------------


SEES = """
import json, os, sys
from gpumarket.provider.runners.base import apply_share
import torch
notes = apply_share()
out = open(os.environ["GPUMARKET_REPORT_FILE"], "a")
print("sees", json.dumps({"cores": sorted(os.sched_getaffinity(0)),
                          "threads": torch.get_num_threads(), "notes": notes}))
out.write(json.dumps({"event": "done", "metrics": {}}) + "\\n")
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_cpu_slices_job_runs_on_its_cores_with_as_many_threads(tmp_path):
    """A real job process started by the executor with the environment a lease on a CPU
    slice gets (executor.job_env + slice_env): the runners' start pins every thread to the
    slice's cores and torch runs that many threads."""
    host = sorted(os.sched_getaffinity(0))
    card = DeviceInfo(index=0, name="CPU", uuid="CPU-x", accelerator=CPU,
                      memory_bytes=8 * GIB, cpu_cores=len(host), cores=tuple(host))
    _, first, second = sliced([card], {0: (0.5, 0.5)})
    seen = {}
    for d in (first, second):
        workdir = tmp_path / f"work{d.index}"
        workdir.mkdir()
        (tmp_path / "pkgs").mkdir(exist_ok=True)
        (tmp_path / "pkgs" / "sees.py").write_text(SEES)
        env = {**job_env(workdir, "", d.cpu_cores), **slice_env([d]),
               "PYTHONPATH": os.pathsep.join([str(tmp_path / "pkgs"), *sys.path])}

        async def on_report(r):
            pass

        outcome = asyncio.run(JobProcess("sees", workdir, env, on_report, max_runtime_s=120,
                                         grace_s=1.0).run())
        assert outcome.succeeded, outcome.error
        line = next(x for x in (workdir / "job.log").read_text().splitlines()
                    if x.startswith("sees "))
        seen[d.index] = json.loads(line[5:])
    assert seen[1] == {"cores": list(first.cores), "threads": len(first.cores), "notes": []}
    assert seen[2] == {"cores": list(second.cores), "threads": len(second.cores), "notes": []}
    assert not set(first.cores) & set(second.cores)


def test_the_provider_refuses_a_lease_of_a_card_and_its_slice_together():
    devices = sliced([cpu(0)], {0: (0.5, 0.5)})
    pairs = [(d.index, d.slice_of) for d in devices]
    assert slices.overlapping(pairs, {0, 1}) and slices.overlapping(pairs, {1, 2})
    assert not slices.overlapping(pairs, {1}) and not slices.overlapping(pairs, {0})


def test_config_slices_says_why_in_one_line():
    config = ProviderConfig(broker="", data_dir=Path("."), slices=(0.5, 0.5))
    with pytest.raises(InvalidArgument, match="slices: device 0: its 1 core"):
        config_slices([cpu(0, cores=1)], config)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_provider_devices_shows_the_slices_and_refuses_bad_ones_in_one_line():
    from tests.helpers import BIN

    r = subprocess.run([str(BIN / "gpumarket-provider"), "devices", "--cpu-only", "--slices",
                        "2", "--json"], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    whole, *parts = json.loads(r.stdout)
    assert whole["slice_of"] is None and [(p["slice_of"], p["share"]) for p in parts] == [
        (0, 0.5), (0, 0.5)]
    assert not set(parts[0]["cores"]) & set(parts[1]["cores"])
    r = subprocess.run([str(BIN / "gpumarket-provider"), "devices", "--cpu-only", "--slices",
                        "0.5,0.75"], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and "sum to 1.25" in r.stderr and "Traceback" not in r.stderr


def test_a_slices_hold_and_quote_are_timed_at_the_slices_speed(tmp_path):
    """A job placed on a slice is timed (its hold, its quote, a deadline's promotion) on the
    slice's own view: half the card's speed, at half its price — not at the card's speed and
    the slice's price, which would hold half of what the lease costs."""
    from gpumarket.broker.money import credit_holds
    from gpumarket.broker.store.schema import migrations
    from gpumarket.broker.store.store import connect

    db = connect(tmp_path / "broker.db")
    migrations.apply(db)
    offer = signed(sliced([cpu(0, memory_gib=16)], {0: (0.5, 0.5)}), price=2.0)
    book = book_of(offer)
    job = need("small", 4)
    found, _ = book.candidates(job, 2)
    by_view = {e.offer_index: e for e in found}
    assert set(by_view) == {0, 1} and by_view[1].price_per_gpu_hour == 1.0
    timed = {t.estimate.offer_index: t for t in credit_holds.timed(db, book, job, found)}
    assert timed[1].raw_s == pytest.approx(2 * timed[0].raw_s)
    # a lease on a slice is found on the slices' view (deadlines price it there)
    assert book.view_of(offer.provider_id, [2]) == 1 and book.view_of(offer.provider_id, [0]) == 0
    assert book.view_of(offer.provider_id, [9]) is None


def test_mig_instances_are_devices_of_their_own_as_nvml_lists_them():
    """On a GPU in MIG mode, each instance NVML enumerates is a device (its MIG-… uuid, its
    memory, its GPU named), an empty slot is skipped; pynvml's own error class stands in for
    the driver's answer."""
    import types

    import pynvml
    from gpumarket.provider.inventory import _mig_instances

    slots = {0: ("MIG-aaa", 10 * GIB, "NVIDIA H100 MIG 1g.10gb"), 2: ("MIG-ccc", 20 * GIB,
                                                                     "NVIDIA H100 MIG 2g.20gb")}

    def handle_by_index(handle, j):
        if j not in slots:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return j

    nvml = types.SimpleNamespace(
        NVMLError=pynvml.NVMLError,
        nvmlDeviceGetMaxMigDeviceCount=lambda h: 7,
        nvmlDeviceGetMigDeviceHandleByIndex=handle_by_index,
        nvmlDeviceGetUUID=lambda h: slots[h][0],
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=slots[h][1]),
        nvmlDeviceGetName=lambda h: slots[h][2])
    parent = dataclasses.replace(gpu(0), mig_mode="enabled")
    found = _mig_instances(nvml, "gpu-handle", parent)
    assert [(d.uuid, d.memory_bytes, d.mig_parent_uuid, d.visible_id, d.compute_capability)
            for d in found] == [("MIG-aaa", 10 * GIB, parent.uuid, "MIG-aaa", "9.0"),
                                ("MIG-ccc", 20 * GIB, parent.uuid, "MIG-ccc", "9.0")]
    # a MIG instance is not sliced further
    with pytest.raises(ValueError, match="no whole device"):
        sliced([dataclasses.replace(found[0], index=1)], {1: (0.5, 0.5)})
