"""How a runner talks to the daemon: one JSON object a line on GPUMARKET_REPORT_FD."""

from __future__ import annotations

import json
import os
import sys
from typing import IO, Any


class Reporter:
    def __init__(self) -> None:
        fd = int(os.environ.get("GPUMARKET_REPORT_FD", "-1"))
        self._out: IO[str] = os.fdopen(fd, "w", buffering=1) if fd >= 0 else sys.stdout

    def send(self, event: str, **fields: Any) -> None:
        self._out.write(json.dumps({"event": event, **fields}) + "\n")
        self._out.flush()

    def progress(self, step: int, total: int, **metrics: float) -> None:
        self.send("progress", step=step, total=total, metrics=metrics)

    def checkpoint(self, step: int, path: str) -> None:
        self.send("checkpoint", step=step, path=path)

    def done(self, **metrics: float) -> None:
        self.send("done", metrics=metrics)
