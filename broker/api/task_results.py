"""A job array lease's task results as they come over the provider's session (the gateway
hands them here): receipts checked (one an update, or a task's own from older providers),
the small outputs carried with them stored, the results
recorded in one transaction with the provider's holding of those outputs, and the update
acknowledged (TaskResultsSettled) so the provider may forget it."""

from __future__ import annotations

import asyncio

from gpumarket.broker.checks import task_checks
from gpumarket.broker.jobs import arrays
from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.state import BrokerState
from gpumarket.broker.store import blob_holdings
from gpumarket.proto.errors import InvalidArgument
from gpumarket.proto.v1 import gateway_pb2 as gw

THREAD_FROM = 16        # receipts (signatures, a receipt tree's leaves) or outputs (hashes)
                        # checked off the event loop from this many


def _checked(update: gw.JobUpdate, provider_id: str):
    results = list(update.tasks.results)
    receipts = arrays.task_receipts(results, provider_id, update.tasks.receipt)
    return results, receipts, arrays.inline_outputs(update.tasks, receipts)


async def record(state: BrokerState, provider_id: str, update: gw.JobUpdate, now: int) -> None:
    """Record the update's task results (arrays.record_results; a check's lease's, with its
    check: task_checks.record_results); its outputs' bytes are
    stored first, so no task is SUCCEEDED without them, and only while the lease is the
    provider's. Raises what refuses it (nothing of it is recorded then; outputs stored before
    a refusal — the lease ended in between — stay on disk with no row). A lease the
    results show should yield to an idle lane of its array is asked to (``arrays._steal``)."""
    tasks = update.tasks
    if sum(1 for r in tasks.results if r.receipt.payload or r.outputs) + len(tasks.blobs) \
            > THREAD_FROM:
        results, receipts, blobs = await asyncio.to_thread(_checked, update, provider_id)
    else:
        results, receipts, blobs = _checked(update, provider_id)
    limit = state.config.max_key_artifact_bytes
    sizes = [(sha, len(data)) for sha, data in blobs]
    if blobs:
        # Only for a lease that is still the provider's: bytes written for another would be
        # held by no row, out of the garbage collector's reach (a disk a provider could fill).
        await state.store.read(jobs.current, update.job_id, update.epoch, provider_id)
        await _store(state, provider_id, blobs, limit)
    stolen = await state.store.write(task_checks.record_results, update.job_id, update.epoch,
                                     provider_id, results, now, receipts, sizes, limit,
                                     list(tasks.yielded))
    if tasks.yielded:
        state.placement.notify()        # tasks it gave back wait for an idle lane
    if stolen:
        # A lane of the array went idle: this lease gives the later part of the tasks it
        # has not started to it (arrays._steal).
        state.sessions.ask_to_yield(provider_id, update.job_id, update.epoch,
                                    f"a lane of the array is idle: part of {stolen} tasks"
                                    " go to it", arrays.STEAL_MIN_S, split=True)


async def lane_freed(state: BrokerState, array_id: str, now: int) -> None:
    """A lease of the array ``array_id`` ended: if that left a lane of it idle, the running
    lease with the most tasks left yields the rest to it now (arrays.steal_for_idle_lane),
    not at its next report. Counted from the tasks it reported, which lag the tasks it ran
    by up to a flush (provider/task_results.py): its provider splits only if what it has
    really left is worth a steal (YieldLease.min_left_s), else runs it out and reports the
    tasks marked as usual."""
    stolen = await state.store.write(arrays.steal_for_idle_lane, array_id, now)
    if stolen:
        provider_id, batch_id, epoch, marked = stolen
        state.sessions.ask_to_yield(provider_id, batch_id, epoch,
                                    f"a lane of the array is idle: part of {marked} tasks"
                                    " go to it", arrays.STEAL_MIN_S, split=True)


async def _store(state: BrokerState, provider_id: str, blobs: list[tuple[str, bytes]],
                 limit: int) -> None:
    """Write the outputs' bytes to the artifact store (synced), as UploadBlobs does: within
    the provider's quota (checked again, exactly, where they are recorded), each blob's
    size the one stored before it if it was."""
    store, artifacts = state.store, state.artifacts
    held = await store.read(blob_holdings.uploaded_bytes, provider_id)
    blob_holdings.check_quota(held, sum(len(d) for _, d in blobs), limit)
    stored = await store.read(blob_holdings.stored_sizes, [sha for sha, _ in blobs])
    for sha, data in blobs:
        artifacts.check_size(len(data))
        if stored.get(sha, len(data)) != len(data):
            raise InvalidArgument(f"artifact {sha[:12]}… is {stored[sha]:,} bytes, not"
                                  f" {len(data):,}")
    staged = await asyncio.to_thread(artifacts.stage_blobs, blobs)
    try:
        await asyncio.to_thread(artifacts.publish_blobs, staged)
    except BaseException:
        await asyncio.to_thread(artifacts.discard_blobs, staged)
        raise


def settled(update: gw.JobUpdate, refused: str = "") -> gw.BrokerMessage:
    """The answer to a task results update: recorded, or ``refused`` (why)."""
    return gw.BrokerMessage(tasks_settled=gw.TaskResultsSettled(
        job_id=update.job_id, epoch=update.epoch, seq=update.tasks.seq,
        accepted=not refused, reason=refused[:500]))
