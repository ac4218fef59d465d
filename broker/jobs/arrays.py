"""Job arrays (docs/jobs.md): one signed spec, many tasks. The array is a job row; its
tasks are rows of ``array_tasks``; they run in batches, each batch a job row under the array
(``parent_id``) that is matched, leased, lost, requeued and paid like any job, its lease
naming the tasks it runs. A task that fails runs again in a later batch until it has used
the job's attempts, without failing its siblings; the array ends when every task has.
Each function runs inside one write transaction (see Store.write). No grpc here."""

from __future__ import annotations

import hashlib
import json

from sqlite_utils import Database

from gpumarket.broker.jobs import transitions as jobs
from gpumarket.broker.jobs.job import Job, add_to_job, update_job
from gpumarket.broker.market.admission import NewJob
from gpumarket.broker.store import blob_holdings
from gpumarket.kinds import arrays, receipt_tree
from gpumarket.proto.envelope import open_envelope
from gpumarket.proto.errors import BadSignature, FailedPrecondition, InvalidArgument
from gpumarket.proto.jobspec import TERMINAL_STATES, check_artifact_name, check_sha256
from gpumarket.proto.v1 import gateway_pb2 as gw
from gpumarket.proto.v1 import types_pb2 as pb

QUEUED, RUNNING = pb.JOB_STATE_QUEUED, pb.JOB_STATE_RUNNING
LEASED, PAUSED = pb.JOB_STATE_LEASED, pb.JOB_STATE_PAUSED
SUCCEEDED, FAILED, CANCELLED = pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED
VERIFYING = pb.JOB_STATE_VERIFYING
OPEN = (QUEUED, RUNNING)            # a task's states before it ends
# A batch's states while it holds a lane of its array or waits for one; not VERIFYING: its
# lease ended and its checks run elsewhere (its lane is free).
IN_LANE = (QUEUED, LEASED, RUNNING, PAUSED)
STATE_FIELDS = {QUEUED: "queued", RUNNING: "running", SUCCEEDED: "succeeded",
                FAILED: "failed", CANCELLED: "cancelled"}
# A task's mark (array_tasks.yielded, ``yield_lease``): its lease was asked to stop (its device
# frees) or to split (it goes on); unreported when it ends, it goes back without an attempt.
STOP, SPLIT = 1, 2
# Work stealing (``_steal``): a lease of an array splits, giving the later part of its tasks
# not started to a lane of the array gone idle, when the tasks it has not reported would take
# it at least this long at its pace: its tasks' own time as reported or its wall time a task
# reported since it started, the larger (and at least the floor). A split costs the lease
# nothing and the idle lane one new lease (0.06-0.2 s here, counted by the runner's split,
# provider/runners/base.py split_point); its provider decides again on what it has really
# left (its reports come up to a second apart). (0.75 s before splits: docs/jobs.md.)
STEAL_MIN_S = 0.3
STEAL_TASK_FLOOR_S = 0.001


def spec_of(envelope: bytes) -> pb.JobSpec:
    env = pb.Envelope()
    env.ParseFromString(envelope)
    spec = pb.JobSpec()
    spec.ParseFromString(env.payload)
    return spec


def submit(db: Database, job: NewJob, now: int, lanes: int = 0) -> None:
    """Store a new array: its row (as any job's: nonce, hold, events), a row per task, and
    its first batches; ``lanes``: how many leases the broker spreads it over where its spec
    does not say how many tasks a lease runs (0: the default)."""
    spec = spec_of(job.spec)
    jobs.submit(db, job, now)
    tasks = arrays.task_indices(spec)
    count = len(tasks)
    update_job(db, job.id, None, tasks=count, parts=0, progress_total=count,
               lanes=max(0, min(lanes, count)))
    db.conn.executemany("INSERT INTO array_tasks (array_id, task, state, updated_at_ms)"
                   " VALUES (?, ?, ?, ?)", [(job.id, t, QUEUED, now) for t in tasks])
    add_batches(db, job.id, now)


def add_batches(db: Database, array_id: str, now: int, lanes: int = 0) -> int:
    """Put the array's tasks that no batch runs into new batches, spread over ``lanes`` of
    its lanes (0: all of them); return how many."""
    waiting = [r[0] for r in db.execute(
        "SELECT task FROM array_tasks WHERE array_id = ? AND state = ? AND batch_id IS NULL"
        " ORDER BY task", [array_id, QUEUED])]
    if not waiting:
        return 0
    top = jobs.job_row(db, array_id)
    size = arrays.per_lease(spec_of(top.spec), top.lanes)
    if top.parts and top.lanes:
        # Tasks back in the queue (yielded to an idle lane or another client, or failed)
        # spread over the array's lanes, not one batch that one device runs while the others
        # idle.
        size = min(size, -(-len(waiting) // (lanes or top.lanes)))
    made = top.parts or 0
    for batch in arrays.batches(waiting, size):
        made += 1
        batch_id = f"{array_id}-{made}"
        jobs.spawn(db, top, "batch", batch_id, f"{top.name} tasks {batch[0]}-{batch[-1]}",
                   now, part=made, tasks=len(batch), progress_total=len(batch))
        db.conn.executemany("UPDATE array_tasks SET batch_id = ?, updated_at_ms = ?"
                       " WHERE array_id = ? AND task = ?",
                       [(batch_id, now, array_id, t) for t in batch])
        jobs.append_event(db, batch_id, "submitted", QUEUED, 1, now, mirror=False,
                          message=f"{len(batch)} tasks of array {array_id}")
    update_job(db, array_id, None, parts=made)
    return made - (top.parts or 0)


def lease_tasks(db: Database, batch_id: str) -> list[int]:
    """The tasks a new lease of the batch runs: those of its tasks not ended yet."""
    return [r[0] for r in db.execute(
        "SELECT task FROM array_tasks WHERE batch_id = ? AND state IN (?, ?) ORDER BY task",
        [batch_id, *OPEN])]


def task_receipts(results: list[gw.TaskResult], provider_id: str,
                  update_receipt: pb.Envelope | None = None) -> dict[int, pb.Receipt]:
    """The receipts that came with task results, by task, each signed by the lease's
    provider (BadSignature if one is not): a task's own (for its outputs alone, as
    providers before issue 32 sign them), or the update's one receipt (``update_receipt``)
    for the outputs its results name, by the root of their hash tree (kinds/receipt_tree.py;
    BadSignature unless it is exactly theirs). For such a task the receipt here names its
    outputs, and its result in ``results`` is replaced by a copy given that envelope and
    its path up the tree, as the task's row keeps them (the update itself is left as it
    came). No database here: the signatures are checked before the write."""
    out: dict[int, pb.Receipt] = {}
    for i, r in enumerate(results):
        if r.receipt_path:                  # (the broker's to set)
            results[i] = r = _copy(r)
            r.ClearField("receipt_path")
        if r.receipt.payload:
            if r.outputs:
                raise InvalidArgument(f"task {r.task}: a result with a receipt of its own"
                                      " names its outputs in it")
            receipt, signer = open_envelope(r.receipt, pb.Receipt)
            if signer != provider_id or receipt.provider_id != provider_id:
                raise BadSignature(f"task {r.task}: its receipt is not signed by the lease's"
                                   " provider")
            if receipt.tasks_root:
                raise BadSignature(f"task {r.task}: its receipt is an update's")
            if r.task in out:
                raise InvalidArgument(f"task {r.task}: two receipts in one update")
            out[r.task] = receipt
    covered = [i for i, r in enumerate(results) if r.ok and r.outputs]
    if not covered:
        return out
    if update_receipt is None or not update_receipt.payload:
        raise BadSignature(f"task {results[covered[0]].task}: its outputs are signed by no"
                           " receipt")
    receipt, signer = open_envelope(update_receipt, pb.Receipt)
    if signer != provider_id or receipt.provider_id != provider_id:
        raise BadSignature("the update's receipt is not signed by the lease's provider")
    if receipt.outputs:
        raise InvalidArgument("an update's receipt names its tasks' outputs by its tasks_root"
                              " alone")
    root, paths = receipt_tree.tree([receipt_tree.task_leaf(results[i].task,
                                                            results[i].outputs)
                                     for i in covered])
    if receipt.tasks_root != root:
        raise BadSignature("the update's receipt does not sign its tasks' outputs")
    for i, path in zip(covered, paths):
        results[i] = r = _copy(results[i])
        own = pb.Receipt()
        own.CopyFrom(receipt)
        own.outputs.extend(r.outputs)
        if r.task in out:
            raise InvalidArgument(f"task {r.task}: two receipts in one update")
        out[r.task] = own
        r.receipt.CopyFrom(update_receipt)
        r.receipt_path = path
    return out


def _copy(result: gw.TaskResult) -> gw.TaskResult:
    copy = gw.TaskResult()
    copy.CopyFrom(result)
    return copy


def inline_outputs(update: gw.TaskResults, receipts: dict[int, pb.Receipt]
                   ) -> list[tuple[str, bytes]]:
    """The small outputs a task results update carries (sha256, bytes), each hash-checked,
    within the bounds (kinds/arrays.py: INLINE_OUTPUT_BYTES each, INLINE_UPDATE_BYTES and
    INLINE_UPDATE_BLOBS in all), and each one an output a succeeded result's receipt names
    (``task_receipts``); InvalidArgument for the first that is not. No database here."""
    if len(update.blobs) > arrays.INLINE_UPDATE_BLOBS:
        raise InvalidArgument(f"tasks.blobs: at most {arrays.INLINE_UPDATE_BLOBS:,} outputs"
                              " in one update (upload the others)")
    named = {ref.sha256 for r in update.results if r.ok and r.task in receipts
             for ref in receipts[r.task].outputs}
    found: dict[str, bytes] = {}
    total = 0
    for i, blob in enumerate(update.blobs):
        if len(blob.data) > arrays.INLINE_OUTPUT_BYTES:
            raise InvalidArgument(f"tasks.blobs[{i}]: {len(blob.data):,} bytes, over the"
                                  f" {arrays.INLINE_OUTPUT_BYTES:,} an output sent with its"
                                  " task results may have (upload it)")
        total += len(blob.data)
        if total > arrays.INLINE_UPDATE_BYTES:
            raise InvalidArgument(f"tasks.blobs: over {arrays.INLINE_UPDATE_BYTES:,} bytes of"
                                  " outputs in one update (upload the others)")
        if blob.sha256 not in named:
            raise InvalidArgument(f"tasks.blobs[{i}]: no receipt of these results names it")
        if hashlib.sha256(blob.data).hexdigest() != blob.sha256:
            raise InvalidArgument(f"tasks.blobs[{i}]: its bytes hash to something else")
        found[blob.sha256] = blob.data
    return list(found.items())


def _task_outputs(batch: Job, epoch: int, task: int, receipt: pb.Receipt) -> None:
    """Raise unless a task's own receipt is for this lease and names its outputs alone."""
    if receipt.job_id != batch.id or receipt.epoch != epoch or \
            receipt.spec_sha256 != batch.spec_sha256:
        raise BadSignature(f"task {task}: its receipt names another lease or spec")
    if len(receipt.outputs) > arrays.TASK_OUTPUTS:
        raise InvalidArgument(f"task {task}: a task's receipt names at most"
                              f" {arrays.TASK_OUTPUTS:,} outputs")
    for ref in receipt.outputs:
        named = arrays.output_task(ref.name)
        if named is None or named[0] != task:
            raise InvalidArgument(f"task {task}: its receipt names {ref.name}, not its own")


def receipted_outputs(db: Database, batch: Job, epoch: int, provider_id: str,
                      receipts: dict[int, pb.Receipt]) -> dict[int, list[dict]]:
    """The outputs of these succeeded tasks as their own receipts name them, each one a
    blob the provider uploaded intact (checked for all of them in one query)."""
    for task, receipt in receipts.items():
        _task_outputs(batch, epoch, task, receipt)
        for i, ref in enumerate(receipt.outputs):
            check_artifact_name(ref.name, f"task {task}: receipt.outputs[{i}].name")
            check_sha256(ref.sha256, f"task {task}: receipt.outputs[{i}].sha256")
    held = blob_holdings.held_sizes(db, provider_id, [ref.sha256 for r in receipts.values()
                                                      for ref in r.outputs])
    out: dict[int, list[dict]] = {}
    for task, receipt in receipts.items():
        for ref in receipt.outputs:
            if held.get(ref.sha256) != ref.size_bytes:
                raise FailedPrecondition(f"task {task}: output {ref.name} was not uploaded"
                                         " intact by this provider")
        out[task] = [{"name": ref.name, "sha256": ref.sha256, "size_bytes": ref.size_bytes}
                     for ref in receipt.outputs]
    return out


def record_results(db: Database, batch_id: str, epoch: int, provider_id: str,
                   results: list[gw.TaskResult], now: int,
                   receipts: dict[int, pb.Receipt] | None = None,
                   blobs: list[tuple[str, int]] = (), quota: int = 0,
                   yielded: list[int] = ()) -> int:
    """Tasks of the provider's current lease of the batch ended (``gw.TaskResult``s): each
    succeeded, or failed and runs again later while it has attempts left. A succeeded task
    with its own receipt (``task_receipts``, checked) has its outputs from it at once.
    ``blobs`` (sha256, size): outputs that came with the results (``inline_outputs``),
    stored already; the provider holds them from here on as if it had uploaded them
    (counted against its ``quota`` of bytes: ResourceExhausted, nothing recorded, over it).
    A task's first result in the update counts; one of a task that is not this batch's, or
    ended already, is ignored. A few statements for the whole update, not a few a task.
    ``yielded``: tasks the lease gives back without running them, having split (``split``).
    Returns how many of the lease's tasks it yields to a lane of the array gone idle
    (``_steal``; 0: none): its provider is to be asked to split."""
    batch, lease = jobs.current(db, batch_id, epoch, provider_id)
    if len(results) > arrays.MAX_PER_LEASE or len(yielded) > arrays.MAX_PER_LEASE:
        raise InvalidArgument(f"at most {arrays.MAX_PER_LEASE:,} task results (and as many"
                              " tasks given back) at once")
    if blobs:
        blob_holdings.record_many(db, list(blobs), provider_id, quota, now)
    array_id = batch.parent_id
    open_rows = dict(_open_tasks(db, array_id, batch_id, [r.task for r in results]))
    told: list[gw.TaskResult] = []
    attempts: dict[int, int] = {}
    for r in results:
        if r.task in open_rows and r.task not in attempts:
            attempts[r.task] = open_rows[r.task]
            told.append(r)
    receipts = receipts or {}
    outputs = receipted_outputs(db, batch, epoch, provider_id, {
        r.task: receipts[r.task] for r in told if r.ok and r.task in receipts})
    # The client's to read, kept from garbage collection.
    blob_holdings.refer_many(db, sorted({ref["sha256"] for refs in outputs.values()
                                         for ref in refs}), batch_id, "output")
    succeeded = []
    for r in told:
        seconds = max(0.0, min(float(r.seconds), 1e9)) if r.seconds == r.seconds else 0.0
        if r.ok:
            refs = outputs.get(r.task)
            succeeded.append((SUCCEEDED, provider_id, seconds, now,
                              None if refs is None else json.dumps(refs),
                              None if refs is None else r.receipt.SerializeToString(),
                              r.receipt_path if refs is not None and r.receipt_path else None,
                              array_id, r.task))
        else:
            _task_failed(db, array_id, r.task, attempts[r.task], batch.max_attempts,
                         r.error[:1000] or "failed", provider_id, now, seconds)
    db.conn.executemany("UPDATE array_tasks SET state = ?, provider_id = ?, error = '',"
                        " seconds = ?, updated_at_ms = ?, outputs = ?, receipt = ?,"
                        " receipt_path = ?, yielded = 0 WHERE array_id = ? AND task = ?",
                        succeeded)
    # The lease's progress is its tasks reported (its provider sends no progress beside them).
    add_to_job(db, batch_id, now, progress_step=len(told))
    if yielded:
        split(db, array_id, jobs.job_row(db, batch_id), yielded, now)
    _follow(db, array_id, now)
    if not succeeded:
        return 0
    return _steal(db, batch, epoch, _pace(lease["started_at_ms"], batch.progress_step
                                          + len(told), sum(row[2] for row in succeeded)
                                          / len(succeeded), now), now)


def split(db: Database, array_id: str, batch: Job, tasks: list[int], now: int) -> int:
    """The batch's lease split (asked by ``_steal``): those of ``tasks`` that the steal
    marked and it has not reported leave the batch, without an attempt, for new batches on
    the array's idle lanes (not this one's: it runs the rest); the split's marks on the
    tasks it keeps are cleared (it may split again), not a stop's asked since (those go
    back when it ends). Only marked tasks move: a provider gives back what it was asked
    for, not its tasks at will (each would rerun without an attempt). Returns how many."""
    moved = db.execute(
        "UPDATE array_tasks SET state = ?, batch_id = NULL, yielded = 0, updated_at_ms = ?"
        " WHERE batch_id = ? AND state = ? AND yielded != 0 AND task IN"
        " (SELECT CAST(value AS INTEGER) FROM json_each(?))",
        [QUEUED, now, batch.id, RUNNING, json.dumps(sorted(set(tasks)))]).rowcount
    if not moved:
        return 0
    db.execute("UPDATE array_tasks SET yielded = 0 WHERE batch_id = ? AND state = ? AND"
               " yielded = ?", [batch.id, RUNNING, SPLIT])
    left = max(1, (batch.tasks or 0) - moved)
    update_job(db, batch.id, None, tasks=left, progress_total=left)
    jobs.append_event(db, batch.id, "split", RUNNING, batch.attempt, now, mirror=False,
                      message=f"{moved} of its tasks not started go to another lease")
    lanes = jobs.job_row(db, array_id).lanes or 1
    add_batches(db, array_id, now, lanes=max(1, lanes - _in_lane(db, array_id)[0]))
    return moved


def _in_lane(db: Database, array_id: str) -> tuple[int, int]:
    """The array's batches in a lane or waiting for one (``IN_LANE``); of those, waiting."""
    return tuple(db.execute(
        f"SELECT count(*), coalesce(sum(CASE WHEN state = ? THEN 1 ELSE 0 END), 0) FROM jobs"
        f" WHERE parent_id = ? AND state IN ({', '.join(str(s) for s in IN_LANE)})",
        [QUEUED, array_id]).fetchone())


def _pace(started_at_ms: int | None, reported: int, task_s: float, now: int) -> float:
    """Seconds a task costs a lease: its tasks' own time (``task_s``) or its wall time a
    task reported since it started (what a task costs it beside its own run), the larger."""
    return max((now - (started_at_ms or now)) / 1000 / max(1, reported), task_s)


def _steal(db: Database, batch: Job, epoch: int, pace: float, now: int) -> int:
    """Work stealing: where fewer of the array's batches are in a lane than it has lanes
    (``IN_LANE``), none of them waiting for a device (a lane ended its lease, or waits for
    its checks, and has nothing left to take), this
    lease is asked to split if the tasks it has not reported would take it at least
    STEAL_MIN_S at ``pace`` (seconds a task; ``split``). Returns how many are marked
    (``yield_lease``). The tasks not reported include those its provider ran and holds (up
    to a flush, provider/task_results.py): the provider, asked with STEAL_MIN_S
    (YieldLease.min_left_s), splits only if what it has really left is worth it, and
    reports the marked tasks it ran either way (recorded as usual, their marks cleared).
    One that gave nothing (declined, or its runner kept all) tells the broker nothing: it
    is asked again at its next report while the lane is idle (a pending split ignores it)."""
    top = jobs.job_row(db, batch.parent_id)
    if top.state in TERMINAL_STATES or top.lanes < 2:
        return 0
    open_batches, waiting = _in_lane(db, top.id)
    if waiting or open_batches >= top.lanes:
        return 0
    left = db.execute("SELECT count(*) FROM array_tasks WHERE batch_id = ? AND state = ?"
                      " AND yielded != ?", [batch.id, RUNNING, STOP]).fetchone()[0]
    if left < 2 or left * max(STEAL_TASK_FLOOR_S, pace) < STEAL_MIN_S:
        return 0
    return yield_lease(db, batch.id, epoch, now, split=True,
                       why=f"a lane of the array is idle ({open_batches} of its {top.lanes}"
                           f" lanes busy)")


def steal_for_idle_lane(db: Database, array_id: str, now: int) -> tuple[str, str, int, int] | None:
    """A lease of the array ended (a lane may be idle): the running lease of the array with
    the most tasks not reported yet yields them (``_steal``'s rule, at its pace so far), at
    once rather than at that lease's next report. Returns (provider, batch, epoch, tasks
    marked) for the broker to ask its provider, or None."""
    row = db.execute(
        "SELECT j.id, j.epoch, l.started_at_ms, j.progress_step, count(t.task) FROM jobs j"
        " JOIN leases l ON l.id = j.lease_id JOIN array_tasks t ON t.batch_id = j.id"
        " AND t.state = ? AND t.yielded != ? WHERE j.parent_id = ? AND j.state = ?"
        " GROUP BY j.id, l.started_at_ms ORDER BY count(t.task) DESC, j.id LIMIT 1",
        [RUNNING, STOP, array_id, RUNNING]).fetchone()
    if row is None or not row[3] or row[2] is None:
        return None        # no lease running, or none that has reported a task: no pace yet
    batch = jobs.job_row(db, row[0])
    done = db.execute("SELECT coalesce(avg(seconds), 0) FROM array_tasks WHERE batch_id = ?"
                      " AND state = ?", [batch.id, SUCCEEDED]).fetchone()[0]
    marked = _steal(db, batch, row[1], _pace(row[2], row[3], float(done), now), now)
    return (batch.provider_id or "", batch.id, row[1], marked) if marked else None


def _open_tasks(db: Database, array_id: str, batch_id: str, tasks: list[int]) -> list[tuple]:
    """(task, attempts) of those of these tasks that the batch runs and that have not
    ended yet."""
    return db.execute(
        "SELECT task, attempts FROM array_tasks WHERE array_id = ? AND batch_id = ? AND"
        " state IN (?, ?) AND task IN (SELECT CAST(value AS INTEGER) FROM json_each(?))",
        [array_id, batch_id, *OPEN, json.dumps(sorted(set(tasks)))]).fetchall()


def _task_failed(db: Database, array_id: str, task: int, attempts: int, max_attempts: int,
                 error: str, provider_id: str, now: int, seconds: float = 0.0) -> None:
    attempts += 1
    state = FAILED if attempts >= max_attempts else QUEUED
    db.execute("UPDATE array_tasks SET state = ?, attempts = ?, error = ?, provider_id = ?,"
               " seconds = ?, updated_at_ms = ?, yielded = 0, batch_id = CASE WHEN ? = ?"
               " THEN NULL ELSE batch_id END WHERE array_id = ? AND task = ?",
               [state, attempts, error, provider_id, seconds, now, state, QUEUED,
                array_id, task])


def failed_on(db: Database, batch_id: str) -> set[str]:
    """The providers that the batch's tasks failed on before (a task that failed runs
    again in a new batch: the scheduler places it on another provider first)."""
    return {r[0] for r in db.execute(
        "SELECT DISTINCT provider_id FROM array_tasks WHERE batch_id = ? AND attempts > 0"
        " AND provider_id != ''", [batch_id])}


def yield_lease(db: Database, batch_id: str, epoch: int, now: int,
                why: str = "another client waits", split: bool = False) -> int:
    """The broker asks the batch's running lease (of ``epoch``) to yield its device after
    its current task: its tasks not reported yet are marked to go back to the queue when it
    ends, without counting an attempt (a task that still reports meanwhile is recorded as
    usual). With ``split`` it is asked to give the later part of them to another lease
    instead (the marked tasks it gives back leave it then, ``split``); a split frees no
    device and its answer may be none (or not come): it may be asked again, or to stop.
    Returns how many are marked (0: the lease is not running, or asked to stop already)."""
    batch = jobs.job_row(db, batch_id)
    if batch.epoch != epoch or batch.state != RUNNING or not batch.parent_id:
        return 0
    mark = SPLIT if split else STOP
    new = db.execute("UPDATE array_tasks SET yielded = ?, updated_at_ms = ? WHERE batch_id = ?"
                     " AND state = ? AND yielded != ? AND NOT EXISTS (SELECT 1 FROM array_tasks"
                     " y WHERE y.batch_id = ? AND y.state = ? AND y.yielded = ?)",
                     [mark, now, batch_id, RUNNING, mark, batch_id, RUNNING, STOP]).rowcount
    marked = new if not split else db.execute(
        "SELECT count(*) FROM array_tasks WHERE batch_id = ? AND state = ? AND yielded = ?",
        [batch_id, RUNNING, SPLIT]).fetchone()[0]
    if new:
        jobs.append_event(db, batch_id, "yielding", RUNNING, batch.attempt, now,
                          mirror=False, message=f"asked to split: {why}; of its {marked} tasks"
                          f" not reported, those it has not started go back to the queue"
                          if split else f"asked to stop after its current task: {why};"
                          f" {marked} tasks go back to the queue")
    return marked


def running_leases(db: Database) -> list[dict]:
    """The running leases of job arrays' batches, for the scheduler's fair share: each
    with its client, provider, epoch, devices, tasks not reported yet, and whether it was
    asked to stop already (a split frees no device: not counted)."""
    rows = db.execute(
        "SELECT j.id, j.epoch, j.client_id, j.provider_id, l.device_indices, j.updated_at_ms,"
        " count(t.task), coalesce(max(CASE WHEN t.yielded = ? THEN 1 ELSE 0 END), 0)"
        " FROM jobs j JOIN leases l ON l.id = j.lease_id"
        " LEFT JOIN array_tasks t ON t.batch_id = j.id AND t.state = ?"
        " WHERE j.state = ? AND j.tasks > 0 AND j.parent_id IS NOT NULL"
        " GROUP BY j.id, l.device_indices",
        [STOP, RUNNING, RUNNING]).fetchall()
    return [{"id": r[0], "epoch": r[1], "client_id": r[2], "provider_id": r[3],
             "devices": len(json.loads(r[4])), "updated_at_ms": r[5], "open": r[6],
             "yielding": bool(r[7])} for r in rows]


def follow_batch(db: Database, array_id: str, batch_id: str, type_: str, now: int) -> None:
    """A batch moved (``type_``, its event): its tasks follow, and the array follows them."""
    batch = jobs.job_row(db, batch_id)
    state = batch.state
    if type_ in ("leased", "started"):
        db.execute("UPDATE array_tasks SET state = ?, provider_id = ?, updated_at_ms = ?"
                   " WHERE batch_id = ? AND state = ?",
                   [RUNNING, batch.provider_id or "", now, batch_id, QUEUED])
    elif state == QUEUED and type_ == "requeued":
        # Its lease was lost (or given back): the batch runs its open tasks again, a yield
        # asked of that lease forgotten.
        db.execute("UPDATE array_tasks SET state = ?, yielded = 0, updated_at_ms = ? WHERE"
                   " batch_id = ? AND state = ?", [QUEUED, now, batch_id, RUNNING])
        if not lease_tasks(db, batch_id):     # every task told before the lease was lost
            jobs.set_job(db, batch_id, now, state=SUCCEEDED)
            jobs.append_event(db, batch_id, "succeeded", SUCCEEDED, batch.attempt, now,
                              mirror=False, message="every task had ended")
    elif state in TERMINAL_STATES:
        _batch_ended(db, array_id, batch, now)
    elif state == VERIFYING:
        # Its lease ended with its receipt and its checks run elsewhere: the tasks it did
        # not run go on now, not when those checks end (minutes, a replay on another
        # provider).
        _lease_over(db, array_id, batch, now)
    _follow(db, array_id, now)


def _batch_ended(db: Database, array_id: str, batch: Job, now: int) -> None:
    """The batch ended: its receipt's outputs go to their tasks; the rest as
    ``_lease_over``."""
    if batch.receipt:
        env = pb.Envelope()
        env.ParseFromString(batch.receipt)
        receipt = pb.Receipt()
        receipt.ParseFromString(env.payload)
        by_task: dict[int, list[dict]] = {}
        for out in receipt.outputs:
            named = arrays.output_task(out.name)
            if named is not None:
                by_task.setdefault(named[0], []).append(
                    {"name": out.name, "sha256": out.sha256, "size_bytes": out.size_bytes})
        db.conn.executemany("UPDATE array_tasks SET outputs = ?, receipt = NULL WHERE"
                            " array_id = ? AND task = ? AND batch_id = ?",
                            [(json.dumps(refs), array_id, task, batch.id)
                             for task, refs in by_task.items()])
    _lease_over(db, array_id, batch, now)


def _lease_over(db: Database, array_id: str, batch: Job, now: int) -> None:
    """The batch's last lease is over (the batch ended, or waits for its checks): tasks it
    did not report failed this run (or are cancelled with it); those it yielded and those
    left to run get new batches. Once for a batch's tasks: a second call finds none."""
    open_tasks = db.execute("SELECT task, attempts, yielded FROM array_tasks WHERE"
                            " batch_id = ? AND state IN (?, ?)", [batch.id, *OPEN]).fetchall()
    top = db.execute("SELECT state FROM jobs WHERE id = ?", [array_id]).fetchone()
    if batch.state == CANCELLED or top[0] in TERMINAL_STATES:
        db.execute("UPDATE array_tasks SET state = ?, error = ?, updated_at_ms = ? WHERE"
                   " batch_id = ? AND state IN (?, ?)",
                   [CANCELLED, batch.error or "cancelled", now, batch.id, *OPEN])
        return
    # Tasks its lease yielded before running them go back to the queue as they were.
    db.execute("UPDATE array_tasks SET state = ?, batch_id = NULL, yielded = 0,"
               " updated_at_ms = ? WHERE batch_id = ? AND state IN (?, ?) AND yielded != 0",
               [QUEUED, now, batch.id, *OPEN])
    error = (batch.error or "its lease ended without a result for it")[:1000]
    for task, attempts, yielded in open_tasks:
        if not yielded:
            _task_failed(db, array_id, task, attempts, batch.max_attempts, error,
                         batch.provider_id or "", now)
    add_batches(db, array_id, now)


def counts(db: Database, array_id: str) -> dict[str, int]:
    """The array's tasks by state: queued, running, succeeded, failed, cancelled."""
    out = dict.fromkeys(STATE_FIELDS.values(), 0)
    for state, n in db.execute("SELECT state, count(*) FROM array_tasks WHERE array_id = ?"
                               " GROUP BY state", [array_id]):
        out[STATE_FIELDS.get(state, "queued")] += n
    return out


def _follow(db: Database, array_id: str, now: int) -> None:
    """Set the array's state and progress from its tasks'."""
    top = jobs.job_row(db, array_id)
    if top.state in TERMINAL_STATES:
        return
    c = counts(db, array_id)
    ended = c["succeeded"] + c["failed"] + c["cancelled"]
    batches_open = db.execute(
        f"SELECT count(*) FROM jobs WHERE parent_id = ? AND state NOT IN"
        f" ({', '.join(str(s) for s in TERMINAL_STATES)})", [array_id]).fetchone()[0]
    if ended == top.tasks and not batches_open:   # (a batch's receipt may be on its way)
        state = SUCCEEDED if ended == c["succeeded"] else FAILED if c["failed"] else CANCELLED
    else:
        # Every task ended, its last leases' receipts on their way: it is finishing, not
        # waiting (it said "requeued" there).
        state = RUNNING if c["running"] or (batches_open and not c["queued"]) else QUEUED
    error = (f"{c['failed']:,} of {top.tasks:,} tasks failed" if state == FAILED else "")
    if state == top.state and ended == top.progress_step:
        return
    if state == SUCCEEDED:
        jobs.set_job(db, array_id, now, progress_step=ended)
        jobs.finished(db, jobs.job_row(db, array_id), now, f"all {ended:,} tasks succeeded")
        return
    jobs.set_job(db, array_id, now, state=state, progress_step=ended, error=error)
    summary = ", ".join(f"{v:,} {k}" for k, v in c.items() if v)
    if state != top.state:
        jobs.append_event(db, array_id, jobs.PARENT_EVENT[state], state, top.attempt, now,
                          message=f"tasks: {summary}")
    else:
        jobs.append_event(db, array_id, "progress", state, top.attempt, now,
                          progress={"step": ended, "total": top.tasks, "metrics": {
                              k: float(c[k]) for k in ("running", "failed") if c[k]}})


def cancelled(db: Database, array_id: str, now: int) -> None:
    """The array was cancelled: its tasks not ended are too."""
    db.execute("UPDATE array_tasks SET state = ?, error = 'cancelled by client',"
               " updated_at_ms = ? WHERE array_id = ? AND state IN (?, ?)",
               [CANCELLED, now, array_id, *OPEN])


def tasks(db: Database, array_id: str, from_task: int, limit: int,
          states: list[int]) -> tuple[list[dict], int]:
    """Up to ``limit`` of the array's tasks from ``from_task`` (of ``states``; all if
    empty); and where the next page starts (0: none)."""
    where, args = "array_id = ? AND task >= ?", [array_id, from_task]
    if states:
        where += f" AND state IN ({', '.join('?' for _ in states)})"
        args += states
    cur = db.execute(f"SELECT * FROM array_tasks WHERE {where} ORDER BY task LIMIT ?",
                     [*args, limit + 1])
    cols = [d[0] for d in cur.description]
    rows = [dict(zip(cols, r)) for r in cur.fetchall()]
    more = len(rows) > limit
    return rows[:limit], (rows[limit]["task"] if more else 0)
