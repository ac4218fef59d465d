"""Script: the client's own Python entry point and files, for work that is none of the
built-in kinds (evaluation, simulation, rollouts). It runs in the provider's sandbox like any
job, with per-task arguments in a job array, and reports progress and checkpoints through
``gpumarket.provider.runners.task`` (docs/jobs.md). A provider runs it only where its operator
names it in ``kinds`` (it is off by default)."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from gpumarket.kinds.base import Kind
from gpumarket.kinds.schema import Param, ParamError
from gpumarket.proto.v1 import types_pb2 as pb


class Script(Kind):
    def rules(self, values: dict[str, Any]) -> None:
        entry = PurePosixPath(values["entry"])
        if len(values["entry"]) > 256 or entry.is_absolute() or ".." in entry.parts \
                or entry.suffix != ".py":
            raise ParamError("script.entry", f"{values['entry']!r} is not a .py file inside"
                                             " the code")


KIND = Script(
    name="script", number=pb.JOB_KIND_SCRIPT, runner="gpumarket.provider.runners.script",
    warm=True, opt_in=True, checkpoints=True,
    params=(
        Param("code", "file_or_dir", required=True, input_name="code.tar",
              doc="a .py file, or a directory (sent as a tar) holding the entry point"),
        Param("entry", "str", default="main.py",
              doc="the file run as __main__, inside the directory (a single file: itself)"),
        Param("args", "strings", max_items=256, max_chars=4096,
              doc="its command-line arguments (sys.argv[1:])"),
        Param("steps", "int", max=1_000_000_000,
              doc="the steps it reports progress in, for estimates; 0 = unknown"),
        Param("checkpoint_every", "int", max=1_000_000_000,
              doc="steps between checkpoints it is asked for; 0 = the broker's interval"),
    ),
)
