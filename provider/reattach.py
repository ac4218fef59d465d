"""An attempt a previous daemon started, taken up by a restarted one: follow its job
process where it still runs, or sign the receipt of a job that finished while no daemon
watched it. What the job reported meanwhile (an array's tasks, its newest checkpoint) is
read back from its report file first. provider/recovery.py decides which applies."""

from __future__ import annotations

import asyncio
import os

from gpumarket.proto.errors import GpumarketError
from gpumarket.provider.attempt import Attempt
from gpumarket.provider.executor import read_reports
from gpumarket.provider.reports import Done
from gpumarket.provider.sandbox import kill_uid


def reattach(job: Attempt, pid: int) -> asyncio.Task:
    """Follow the job process ``pid`` a previous daemon started; the task that ends with
    its final update handed to the daemon."""
    job.process = job.new_process()
    if job.engine is not None:      # its engine lost its link with the old daemon: it ends
        os.close(job.engine.child_fd)
        job.engine.close()
    job.process.attach(pid)
    job.task = asyncio.create_task(_follow(job))
    return job.task


async def _follow(job: Attempt) -> None:
    meanwhile = await asyncio.to_thread(read_reports, job.workdir, job.job_uid,
                                        job.task_results.open)
    for report in meanwhile.tasks:
        job.task_ended(report)
    if meanwhile.checkpoint is not None:
        await job.on_report(meanwhile.checkpoint)
    final = await job.follow()
    if final is not None and not job.cancelled:
        await job.host.finished(job, final)


def done_meanwhile(job: Attempt) -> Done | None:
    """The job's "done" report, if it finished while no daemon watched it (None
    otherwise)."""
    return read_reports(job.workdir, job.job_uid).done


def finish_meanwhile(job: Attempt, done: Done) -> asyncio.Task:
    """Sign the receipt of a job that finished while no daemon watched it (its array's
    tasks passed on first); the task that hands the final update to the daemon."""
    async def finish() -> None:
        if job.host.isolation.uids is not None and job.job_uid != os.geteuid():
            # Whatever it left running goes before its outputs are read.
            await asyncio.to_thread(kill_uid, job.job_uid)
        meanwhile = await asyncio.to_thread(read_reports, job.workdir, job.job_uid,
                                            job.task_results.open)
        for report in meanwhile.tasks:
            job.task_ended(report)
        await job.task_results.settle(dropped=job.cancelled)
        try:
            seconds = done.metrics.get("train_seconds", 0.0)
            final = job.update(receipt=await job.receipt(done, seconds))
        except GpumarketError as exc:
            final = job.update(failed=job.failure(str(exc), ran=True))
        await job.host.finished(job, final)

    job.task = asyncio.create_task(finish())
    return job.task
