"""A task's receipt as the provider signs it (provider/receipts.py): its provider's id worked
out once per identity, never another identity's; the broker's check of it unchanged."""

from __future__ import annotations

import pytest

from gpumarket.broker.jobs import arrays as broker_arrays
from gpumarket.proto.envelope import open_envelope
from gpumarket.proto.errors import BadSignature
from gpumarket.proto.identity import Identity
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.provider import receipts
from gpumarket.provider.leases import Assignment


def _assignment(provider: Identity) -> Assignment:
    lease = pb.Lease(lease_id="a-1.1", job_id="a-1", attempt=1, epoch=1,
                     provider_id=provider.id, device_indices=[0])
    return Assignment(lease, pb.JobSpec(), "client", "a" * 64)


def test_each_identity_signs_receipts_naming_itself():
    refs = [pb.ArtifactRef(name="task000001.result.json", sha256="b" * 64, size_bytes=10)]
    ones = [Identity.generate() for _ in range(12)]     # more than the ids kept at once
    for _ in range(2):
        for one in ones:
            receipt, signer = open_envelope(receipts.sign(one, _assignment(one), refs, 0.5),
                                            pb.Receipt)
            assert receipt.provider_id == signer == one.id
            assert list(receipt.outputs) == refs


def test_the_broker_refuses_a_task_receipt_another_key_signed():
    honest, other = Identity.generate(), Identity.generate()
    good = receipts.sign(honest, _assignment(honest), [], 0.1)
    forged = receipts.sign(other, _assignment(honest), [], 0.1)
    results = [gw.TaskResult(task=1, ok=True, receipt=good)]
    assert set(broker_arrays.task_receipts(results, honest.id)) == {1}
    with pytest.raises(BadSignature, match="not signed by the lease's provider"):
        broker_arrays.task_receipts([gw.TaskResult(task=2, ok=True, receipt=forged)],
                                    honest.id)
