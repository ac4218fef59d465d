"""Following a job: its events as lines, its progress as a bar."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from gpumarket.proto.jobspec import TERMINAL_STATES, state_name
from gpumarket.proto.v1 import types_pb2 as pb

if TYPE_CHECKING:   # annotations only: commands get it from the cli group
    from gpumarket.client.console import ConsoleOnUse
    from gpumarket.link.client import BrokerClient

EXIT_BY_STATE = {pb.JOB_STATE_SUCCEEDED: 0, pb.JOB_STATE_FAILED: 3, pb.JOB_STATE_CANCELLED: 4,
                 pb.JOB_STATE_PAUSED: 5}


def _metrics(progress: pb.Progress) -> str:
    return "  ".join(f"{k} {v:.4g}" for k, v in sorted(progress.metrics.items()))


async def follow(broker: BrokerClient, job_id: str, as_json: bool,
                 printer: ConsoleOnUse) -> int:
    """Print the job's events until it ends, as JSON lines or through ``printer`` (its rich
    Console, with a progress bar on a terminal); return its final state."""
    state = pb.JOB_STATE_UNSPECIFIED
    if as_json:
        from google.protobuf.json_format import MessageToDict

        async for ev in broker.watch(job_id):
            d = MessageToDict(ev, preserving_proto_field_name=True)
            d["state"] = state_name(ev.state)
            print(json.dumps(d), flush=True)
            state = ev.state
            if ev.type == "paused":
                break
        return state
    from rich.progress import (
        BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn,
    )

    console = printer.rich
    live = console.is_terminal
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeRemainingColumn(), TextColumn("{task.fields[metrics]}"),
                        console=console, disable=not live)
    task = None
    last_tenth = -1
    with progress:
        notice = lambda text: progress.console.print(f"{'':22} ({text})")  # noqa: E731
        async for ev in broker.watch(job_id, on_retry=notice):
            state = ev.state
            if ev.type == "progress":
                p = ev.progress
                if task is None:
                    task = progress.add_task(f"attempt {ev.attempt}", total=p.total, metrics="")
                progress.update(task, completed=p.step, total=p.total, metrics=_metrics(p),
                                description=f"attempt {ev.attempt}")
                tenth = p.step * 10 // max(p.total, 1)
                if not live and tenth != last_tenth:
                    last_tenth = tenth
                    console.print(f"  step {p.step}/{p.total}  {_metrics(p)}")
                continue
            stamp = f"{state_name(ev.state):9} {ev.type}"
            progress.console.print(f"{stamp:22} {ev.message}".rstrip())
            if ev.state in TERMINAL_STATES or ev.type == "paused":
                break
    return state
