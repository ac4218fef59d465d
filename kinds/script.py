"""Script: the client's own Python entry point and files, for work that is none of the
built-in kinds (evaluation, simulation, rollouts). It runs in the provider's sandbox like any
job, with per-task arguments in a job array, and reports progress and checkpoints through
``gpumarket.provider.runners.task`` (docs/jobs.md). A provider runs it only where its operator
names it in ``kinds`` (it is off by default).

Its outputs are spot-checked only where the job says how they compare (``outputs_compare``):
the client's own code need not be deterministic, so a replay that differs proves nothing
unless the client has declared that it must not (docs/verification.md, Script jobs)."""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from gpumarket.kinds.base import Kind
from gpumarket.kinds.output_compare import RULES, compare_outputs, compare_task_outputs
from gpumarket.kinds.schema import Param, ParamError
from gpumarket.proto.v1 import types_pb2 as pb


class Script(Kind):
    def rules(self, values: dict[str, Any]) -> None:
        entry = PurePosixPath(values["entry"])
        if len(values["entry"]) > 256 or entry.is_absolute() or ".." in entry.parts \
                or entry.suffix != ".py":
            raise ParamError("script.entry", f"{values['entry']!r} is not a .py file inside"
                                             " the code")
        rule = values.get("outputs_compare", "none")
        if rule != "json" and (values.get("outputs_rtol") or values.get("outputs_atol")):
            raise ParamError("script.outputs_rtol", "a tolerance needs outputs_compare ="
                                                    f" \"json\" (it is {rule!r})")

    # A check replays the work of the job's last lease (from the checkpoint it resumed from,
    # or the start) on another provider and compares every file it delivered by the job's
    # declared rule; "none" (the default) is never checked and reads "unverified".
    def checked(self, values: dict[str, Any]) -> bool:
        return values.get("outputs_compare", "none") in RULES

    def check_scope(self, values: dict[str, Any], part: int, parts: int,
                    metrics: dict[str, float], done_before: int) -> dict:
        if not self.checked(values):
            return {}
        return {"outputs": values["outputs_compare"],
                "rtol": float(values.get("outputs_rtol", 0.0)),
                "atol": float(values.get("outputs_atol", 0.0))}

    def evidence(self, names: set[str]) -> set[str]:
        return set(names)

    def compare(self, expect: dict[str, Path], got: dict[str, Path], scope: dict
                ) -> tuple[bool, str]:
        """Every output file by the job's rule; an array check's (its scope names the
        ``tasks`` it replayed) task by task within the broker's time for a pass, going on
        from the tasks an earlier pass ``compared_tasks`` (Unfinished when time ran out:
        broker/checks/verdicts.py)."""
        if "tasks" in scope:
            return compare_task_outputs(
                expect, got, list(scope["tasks"]), scope["outputs"],
                float(scope.get("rtol", 0.0)), float(scope.get("atol", 0.0)),
                scope.get("compared_tasks", ()))
        return compare_outputs(expect, got, scope["outputs"], float(scope.get("rtol", 0.0)),
                               float(scope.get("atol", 0.0)))


KIND = Script(
    name="script", number=pb.JOB_KIND_SCRIPT, runner="gpumarket.provider.runners.script",
    warm=True, opt_in=True, checkpoints=True, verify="outputs",
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
        Param("outputs_compare", "str", default="none", choices=("none", *RULES),
              doc="how a spot check compares a replay's output files with the provider's:"
                  " \"exact\" (every file byte for byte), \"json\" (JSON and JSON-lines"
                  " files by value, numbers within the tolerances; other files byte for"
                  " byte) or \"none\" (not checked: the work reads unverified)"),
        Param("outputs_rtol", "float", min=0.0, max=1.0,
              doc="json: relative tolerance on numbers (|a - b| <= atol + rtol x max(|a|,"
                  " |b|))"),
        Param("outputs_atol", "float", min=0.0, max=1e6,
              doc="json: absolute tolerance on numbers"),
    ),
)
