"""What a provider hands a job's runner: the ``job.json`` in its work directory, typed. The
daemon makes it from a checked lease (provider/leases.py ``runner_config``) and writes it
with ``to_json``; every runner reads it with ``from_json`` and its fields by attribute.
The kind's own parameters stay a read-only mapping, checked against the kind's schema
(kinds/schema.py) where the daemon makes it. No grpc here, nothing but the standard
library at import: runners import this in the job's own process."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

DEVICES = ("cpu", "cuda")
MAX_BYTES = 256 << 20      # a job.json larger than this is refused (an array's tasks,
                           # each with its parameters, fit in far less)


class RunnerJobError(ValueError):
    """A job.json that is no runner job: the field and what is wrong with it."""


def _frozen(params: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params):
        raise RunnerJobError(f"{where}: must be an object of named parameters")
    return MappingProxyType(dict(params))


@dataclass(frozen=True)
class ArrayTask:
    """One task of a job array's lease: its index in the array and its parameters (the
    array's, with the task's own line of the tasks input over them)."""

    task: int
    params: Mapping[str, Any]

    def __post_init__(self) -> None:
        if isinstance(self.task, bool) or not isinstance(self.task, int) or self.task < 0:
            raise RunnerJobError("tasks[].task: must be a task index (0 or more)")
        object.__setattr__(self, "params", _frozen(self.params, "tasks[].params"))


@dataclass(frozen=True)
class RunnerJob:
    """One job (or a task of an array, as run_tasks hands it over) as its runner sees it."""

    params: Mapping[str, Any] = field(default_factory=dict)  # the kind's, every one present
    inputs: Mapping[str, str] = field(default_factory=dict)  # input name -> local path
    job_id: str = ""
    attempt: int = 0
    kind: str = ""                     # the kind's name
    tasks: tuple[ArrayTask, ...] | None = None   # a job array's lease: its tasks; else None
    task: int | None = None            # the task of an array this job is (run_tasks sets it)
    checkpoint_every: int = 0          # steps between checkpoints (0: by checkpoint_interval_s)
    checkpoint_interval_s: float = 0.0  # the broker's first interval, seconds (0: none)
    provider_mtbf_s: float = 0.0       # this provider's time between failures, seconds
    device: str = "cpu"                # one of DEVICES
    resume_from: str | None = None     # the unpacked checkpoint to resume from, if any
    world_size: int = 1                # processes (devices) of one training job
    model_dir: str | None = None       # a model the provider holds, by the job's model name
    part: int = 0                      # a split job's part (0: not split) ...
    parts: int = 0                     # ... of this many
    # A check lease (a replay of another provider's work); empty for any other job:
    check_of: str = ""                 # set: this is a check; its own name (never the
                                       # checked job's: a check lease does not say it)
    stop_at: int = 0                   # training: the step to train up to and stop at
    check_position: float = 0.0        # inference: where in the range the batch checked is
    check_batch_size: int = 0          # ... the batch size of the checked job
    check_from_row: int = 0            # ... and the row its range starts at (render: the
                                       # frames of its part done before the checked lease)
    check_claimed: str = ""            # generate: the checked provider's completions (a
                                       # path): prefill their tokens, do not generate
    check_frames: tuple[int, ...] = ()  # render: the frames to render again

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "params", _frozen(self.params, "params"))
        put(self, "inputs", _frozen(self.inputs, "inputs"))
        if not all(isinstance(v, str) for v in self.inputs.values()):
            raise RunnerJobError("inputs: each must be a path")
        for name, want in (("job_id", str), ("kind", str), ("check_of", str),
                           ("device", str), ("check_claimed", str)):
            if not isinstance(getattr(self, name), want):
                raise RunnerJobError(f"{name}: must be a string")
        if self.device not in DEVICES:
            raise RunnerJobError(f"device: must be one of {list(DEVICES)}")
        for name in ("attempt", "checkpoint_every", "world_size", "part", "parts", "stop_at",
                     "check_batch_size", "check_from_row"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RunnerJobError(f"{name}: must be a whole number (0 or more)")
        if self.world_size < 1:
            raise RunnerJobError("world_size: must be at least 1")
        for name in ("checkpoint_interval_s", "provider_mtbf_s", "check_position"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise RunnerJobError(f"{name}: must be a number (0 or more)")
            put(self, name, float(value))
        for name in ("resume_from", "model_dir"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise RunnerJobError(f"{name}: must be a path or null")
        if self.task is not None and (isinstance(self.task, bool)
                                      or not isinstance(self.task, int) or self.task < 0):
            raise RunnerJobError("task: must be a task index (0 or more) or null")
        if self.tasks is not None:
            put(self, "tasks", tuple(t if isinstance(t, ArrayTask) else _task(t)
                                     for t in self.tasks))
        frames = self.check_frames
        if not isinstance(frames, (list, tuple)) or any(
                isinstance(f, bool) or not isinstance(f, int) for f in frames):
            raise RunnerJobError("check_frames: must be a list of frame numbers")
        put(self, "check_frames", tuple(frames))

    def for_task(self, task: ArrayTask) -> RunnerJob:
        """The job of one task of this array lease: the task's parameters, no tasks of its
        own, and nothing to resume (a task cut short runs again from its start). Both are
        checked already: made without checking again (once a task, in a tight loop)."""
        job = copy.copy(self)
        for name, value in (("params", task.params), ("task", task.task), ("tasks", None),
                            ("resume_from", None)):
            object.__setattr__(job, name, value)
        return job

    def to_json(self) -> str:
        """job.json as the daemon writes it: every field, a check lease's only if it is one
        (the keys runners of plugin kinds have always read)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["params"], out["inputs"] = dict(self.params), dict(self.inputs)
        out["tasks"] = (None if self.tasks is None else
                        [{"task": t.task, "params": dict(t.params)} for t in self.tasks])
        if self.task is None:
            del out["task"]
        check = {"check_of": self.check_of}
        if self.check_batch_size:
            check.update(check_position=self.check_position,
                         check_batch_size=self.check_batch_size,
                         check_from_row=self.check_from_row)
            if self.check_claimed:
                check["check_claimed"] = self.check_claimed
        elif self.check_frames:
            check.update(check_frames=list(self.check_frames),
                         check_from_row=self.check_from_row)
        else:
            check["stop_at"] = self.stop_at
        for name in ("check_of", "stop_at", "check_position", "check_batch_size",
                     "check_from_row", "check_frames", "check_claimed"):
            del out[name]
        if self.check_of:
            out.update(check)
        return json.dumps(out, indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> RunnerJob:
        """The job a job.json holds; a field it leaves out (or null) takes its default.
        RunnerJobError naming the field if it is not one (a field no runner knows is
        ignored: a newer daemon may add some)."""
        if len(text) > MAX_BYTES:
            raise RunnerJobError(f"more than {MAX_BYTES:,} bytes")
        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RunnerJobError(f"not JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise RunnerJobError("must be an object")
        known = {f.name for f in fields(cls)}
        given = {k: v for k, v in raw.items() if k in known and v is not None}
        if "tasks" in given:
            if not isinstance(given["tasks"], list):
                raise RunnerJobError("tasks: must be a list of tasks or null")
            given["tasks"] = tuple(_task(t) for t in given["tasks"])
        try:
            return cls(**given)
        except TypeError as exc:    # a mapping's keys that are not its own
            raise RunnerJobError(str(exc)) from exc


def _task(raw: Any) -> ArrayTask:
    if not isinstance(raw, dict) or "task" not in raw:
        raise RunnerJobError("tasks[]: must be an object with its task and params")
    return ArrayTask(raw["task"], raw.get("params") or {})


def check_params(kind, params: Mapping[str, Any], inputs: set[str]) -> None:
    """Raise kinds.ParamError unless ``params`` hold every parameter of ``kind`` (a
    kinds.base.Kind), each of its type and in its range, naming only ``inputs``."""
    from gpumarket.kinds.schema import TYPE_WORDS, ParamError, check_values

    for p in kind.params:
        if p.name not in params:
            raise ParamError(f"{kind.name}.{p.name}", "missing")
        if not p.accepts_type(params[p.name]):
            raise ParamError(f"{kind.name}.{p.name}", f"must be {TYPE_WORDS[p.type]}")
    check_values(kind.params, dict(params), kind.name, inputs)
