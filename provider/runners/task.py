"""The API a ``script`` job's own code uses to talk to its provider (docs/jobs.md):

    from gpumarket.provider.runners import task

    params = task.params()          # this task's parameters ("task": its index in an array)
    start = 0
    resumed = task.resume()         # (step, directory) of the checkpoint it resumes from
    if resumed:
        start = int((resumed[1] / "step.txt").read_text())
    for step in range(start, 100):
        ...
        task.progress(step + 1, 100, loss=0.1)
        if task.checkpoint_due(step + 1):
            task.checkpoint(step + 1, my_state_dir)   # a directory of plain files
        if task.should_stop():      # the provider is draining: checkpoint, then return
            return
    (task.output_dir() / "result.json").write_text("...")   # its outputs

Everything here only writes report lines to the provider (runners/report.py) and files in
the job's work directory; the provider checks and uploads what it finds.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpumarket.provider.runners.base import Cadence, drain_requested, publish_checkpoint
from gpumarket.provider.runners.report import Reporter

if TYPE_CHECKING:
    from gpumarket.kinds.runner_job import RunnerJob

STATE_TAR = "state.tar"
_state: dict[str, Any] = {}


def _start(job: RunnerJob, workdir: Path, reporter: Reporter) -> None:
    """Set up for a job (the script runner calls this before the job's code runs)."""
    _state.clear()
    _state.update(job=job, workdir=workdir, reporter=reporter, metrics={},
                  cadence=Cadence.for_job(job))


def _need() -> dict[str, Any]:
    if not _state:
        raise RuntimeError("gpumarket task API: not running as a gpumarket script job")
    return _state


def params() -> dict[str, Any]:
    """This job's parameters (in an array: the task's, with ``task``, its index)."""
    job = _need()["job"]
    return {**job.params, "task": job.task}


def index() -> int | None:
    """This task's index in its array (0-based); None for a job that is no array."""
    return _need()["job"].task


def output_dir() -> Path:
    """Where the job puts its outputs: every plain file here is uploaded and receipted."""
    out = _need()["workdir"] / "outputs"
    out.mkdir(exist_ok=True)
    return out


def progress(step: int, total: int = 0, **metrics: float) -> None:
    """Report progress (steps of ``total``; the broker shows it and bills by it)."""
    state = _need()
    state["reporter"].progress(int(step), int(total or state["job"].params.get("steps") or 0),
                               **{k: float(v) for k, v in metrics.items()})


def metrics(**values: float) -> None:
    """Figures for the job's receipt (kept until it ends)."""
    _need()["metrics"].update({k: float(v) for k, v in values.items()})


def should_stop() -> bool:
    """True once the provider asked the job to checkpoint and stop (it is draining)."""
    return drain_requested()


def checkpoint_due(step: int) -> bool:
    """Whether to checkpoint at ``step``: every ``checkpoint_every`` steps if the job set it,
    else on the broker's interval (from this provider's measured reliability)."""
    return _need()["cadence"].due(int(step)) or drain_requested()


def checkpoint(step: int, directory: str | os.PathLike) -> None:
    """Save the plain files of ``directory`` (its top level) as the checkpoint at ``step``;
    a job resumed elsewhere gets them back from ``resume()``."""
    state = _need()
    source = Path(directory)
    started = time.monotonic()

    def write(tmp: Path) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for path in sorted(source.iterdir()):
                if path.is_file() and not path.is_symlink():
                    info = tar.gettarinfo(str(path), arcname=path.name)
                    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                    info.mode = 0o644
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
        (tmp / STATE_TAR).write_bytes(buf.getvalue())
        (tmp / "state.json").write_text(json.dumps({"step": int(step)}))

    workdir = state["workdir"]
    final = publish_checkpoint(workdir / "checkpoints", int(step), write)
    took = time.monotonic() - started
    state["cadence"].written(took)
    state["reporter"].checkpoint(int(step), str(final.relative_to(workdir)), took)
    if drain_requested():
        state["reporter"].drained(int(step))
        state["drained"] = True


def resume() -> tuple[int, Path] | None:
    """(step, directory holding the files saved then) of the checkpoint this attempt resumes
    from; None for a fresh start."""
    state = _need()
    if not state["job"].resume_from:
        return None
    source = Path(state["job"].resume_from)
    step = int(json.loads((source / "state.json").read_text())["step"])
    target = state["workdir"] / "resumed-state"
    target.mkdir(exist_ok=True)
    with tarfile.open(source / STATE_TAR) as tar:
        tar.extractall(target, filter="data")
    return step, target
