"""How a runner talks to the daemon: one JSON object a line, appended to a reports file.

A file (not a pipe) so that a job survives its daemon: a restarted daemon re-attaches to the
running job and goes on reading where the file ends.
"""

from __future__ import annotations

import json
import os
import sys
from typing import IO, Any


class Reporter:
    def __init__(self) -> None:
        path = os.environ.get("GPUMARKET_REPORT_FILE")
        self._out: IO[str] = open(path, "a", buffering=1) if path else sys.stdout

    def send(self, event: str, **fields: Any) -> None:
        self._out.write(json.dumps({"event": event, **fields}) + "\n")
        self._out.flush()

    def progress(self, step: int, total: int, **metrics: float) -> None:
        self.send("progress", step=step, total=total, metrics=metrics)

    def checkpoint(self, step: int, path: str, write_seconds: float) -> None:
        self.send("checkpoint", step=step, path=path, write_seconds=write_seconds)

    def drained(self, step: int) -> None:
        self.send("drained", step=step)

    def done(self, **metrics: float) -> None:
        self.send("done", metrics=metrics)
