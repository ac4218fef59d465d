"""What a job kind is, in one object: its name and number, its parameters, the rules
across them, how the broker sizes and splits it, what a provider needs to run it, and the
runner that does. A kind module (gpumarket/kinds/training.py, or a plugin's) makes one
``Kind`` and registers it; everything else asks the registry. No grpc here."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from random import Random
from typing import Any

from gpumarket.kinds.schema import TYPE_WORDS, Param, ParamError, check_values
from gpumarket.proto.v1 import types_pb2 as pb

PLUGIN_NUMBERS = range(100, 2**31)   # kinds outside this codebase take numbers from 100


class Unfinished(Exception):
    """A check's comparison ran out of its time before it compared everything it must, and
    found nothing that differs so far: neither a pass nor a disagreement. ``progress`` is
    what the broker keeps in the check's scope, so that its next pass compares the rest
    (broker/checks/verdicts.py); the message says how far it got."""

    def __init__(self, detail: str, progress: dict[str, Any]):
        super().__init__(detail)
        self.progress = progress


def in_time(items: list[int], compared: Iterable[int], seconds: float, draw: Random,
            key: str, said: str) -> Iterator[int]:
    """The ``items`` of a check's sample an earlier pass has not ``compared`` (and found
    equal), in an order ``draw`` makes (none the checked provider can aim at), for at most
    ``seconds`` after the first: the caller compares each and stops at a difference. Raises
    Unfinished (its progress: {``key``: the items found equal so far}) when the time ran
    out with items left; ``said`` names them and what equal means, for its message. At
    least one item a call, so a comparison ends within as many passes as it has items."""
    done = set(compared) & set(items)
    order = [x for x in items if x not in done]
    draw.shuffle(order)
    until = time.monotonic() + seconds
    for count, item in enumerate(order):
        if count and time.monotonic() > until:
            raise Unfinished(f"{len(done)} of the {len(items)} {said}; the rest not within"
                             f" {seconds:g}s", {key: sorted(done)})
        yield item
        done.add(item)


@dataclass(frozen=True)
class Kind:
    name: str                         # "training": the job file's kind and its table
    number: int                       # JobKind on the wire (plugins: 100 and up)
    params: tuple[Param, ...]
    runner: str                       # module run as ``python -m RUNNER WORKDIR``
    proto_field: str = ""             # the JobSpec.params field it uses; "" = custom (JSON)
    warm: bool = False                # keep a runner with its imports done, ready for a lease
    provider_engine: str = ""         # an engine a provider must have to offer the kind
    sizing: str = ""                  # the broker's sizing rule ("training", "inference")
    runner_path: tuple[str, ...] = field(default=(), compare=False)  # import roots of a plugin
    opt_in: bool = False              # a provider runs it only where its operator names it
    verify: str = ""                  # how its work is spot-checked: "replay" (segments between
                                      # checkpoints), "rows", "frames", "outputs" (its last
                                      # lease's work replayed, every output compared by the
                                      # job's declared rule); "" = not checked
    serves: bool = False              # a long-lived service: its replicas are child jobs, its
                                      # engine talks over the runner's stdin (the endpoint)
    checkpoints: bool = False         # its runner checkpoints (on a drain or preemption too)
                                      # and resumes from there: it may run interruptible

    # -- parameters ---------------------------------------------------------------------

    def param(self, name: str) -> Param:
        return next(p for p in self.params if p.name == name)

    def check(self, values: dict[str, Any], inputs: set[str]) -> None:
        """Raise ParamError for the first parameter, or combination of them, that cannot
        run. Kinds with rules across parameters extend ``rules``."""
        check_values(self.params, values, self.name, inputs)
        self.rules(values)

    def rules(self, values: dict[str, Any]) -> None:
        """Rules across parameters (raise ParamError)."""

    def values_of(self, spec: pb.JobSpec) -> dict[str, Any]:
        """The spec's parameters as plain values, every one present (its default if the
        spec leaves it out)."""
        if self.proto_field:
            if spec.WhichOneof("params") != self.proto_field:
                raise ParamError(self.proto_field, f"a {self.name} job needs a"
                                                   f" [{self.proto_field}] table")
            message = getattr(spec, self.proto_field)
            return {p.name: (list(getattr(message, p.name)) if p.type == "strings"
                             else getattr(message, p.name)) for p in self.params}
        if spec.WhichOneof("params") != "custom":
            raise ParamError(self.name, f"a {self.name} job needs a [{self.name}] table")
        try:
            raw = json.loads(spec.custom.json or "{}")
        except ValueError as exc:
            raise ParamError(self.name, "parameters are not JSON") from exc
        if not isinstance(raw, dict):
            raise ParamError(self.name, "parameters must be a table")
        unknown = sorted(set(raw) - {p.name for p in self.params})
        if unknown:
            raise ParamError(f"{self.name}.{unknown[0]}", "not a parameter of this kind")
        values = {}
        for p in self.params:
            value = raw.get(p.name, p.zero())
            if not p.accepts_type(value):
                raise ParamError(f"{self.name}.{p.name}", f"must be {TYPE_WORDS[p.type]}")
            values[p.name] = value
        return values

    def write(self, spec: pb.JobSpec, values: dict[str, Any]) -> None:
        """Put ``values`` into the spec (its typed message, or JSON for a custom kind)."""
        spec.kind = self.number
        if self.proto_field:
            message = getattr(spec, self.proto_field)
            message.CopyFrom(type(message)(**values))
        else:
            spec.custom.json = json.dumps(values, sort_keys=True, separators=(",", ":"))

    # -- what the broker and the provider ask of a job of this kind ---------------------

    def engine(self, values: dict[str, Any]) -> str:
        """The inference engine the job requires; "" for any."""
        return str(values.get("engine", ""))

    def model_name(self, values: dict[str, Any]) -> str:
        """A model the job wants from the provider's model directory; "" if none."""
        return str(values.get("model_name", ""))

    def model_input(self, values: dict[str, Any]) -> str:
        """The input that holds the model archive the job sends; "" if none."""
        return str(values.get("model", ""))

    def remote_code(self, values: dict[str, Any]) -> bool:
        """Whether the job runs its model's own code."""
        return bool(values.get("trust_remote_code", False))

    def checkpoint_every(self, values: dict[str, Any]) -> int:
        """The job's own checkpoint cadence (steps), overriding the broker's; 0 = none."""
        return int(values.get("checkpoint_every", 0))

    def config_input(self, values: dict[str, Any]) -> tuple[str, bool] | None:
        """The input holding the model's config.json for the broker's sizing, and whether
        it is inside an archive; None if the kind has none."""
        return None

    def check_config(self, values: dict[str, Any], config: dict) -> None:
        """Rules between the job's parameters and its model's config.json (the one
        ``config_input`` names): the client checks them where it holds the config, the
        broker where it reads it, before the job is queued. Raises ParamError."""

    def parts(self, values: dict[str, Any]) -> int:
        """How many parts the job runs as, each leased on its own (1: it is not split)."""
        return 1

    def part_steps(self, values: dict[str, Any], part: int, parts: int) -> range:
        """The steps (frames, ...) of part ``part`` (1-based) of ``parts``."""
        return range(0)

    def output_problem(self, values: dict[str, Any], names: set[str]) -> str:
        """Why a finished job's outputs (by name) cannot be its result; "" if they can."""
        return ""

    # -- spot checks (docs/verification.md) -----------------------------------------------

    def checked(self, values: dict[str, Any]) -> bool:
        """Whether a job with these parameters is spot-checked at all (a script: only where
        it declares how its outputs compare)."""
        return bool(self.verify)

    def check_scope(self, values: dict[str, Any], part: int, parts: int,
                    metrics: dict[str, float], done_before: int) -> dict:
        """What a check of a finished lease's work replays, picked at random where the
        provider cannot predict it, among what it did itself (``done_before``: the steps done
        before it resumed): {"position": u, "batch_size": n} (a batch of rows the checker's
        runner picks from the input it reads), {"frames": [...]}, or {"outputs": rule, ...}
        (the whole of it, every output compared by the job's rule); {} for none."""
        return {}

    def evidence(self, names: set[str]) -> set[str]:
        """Of a finished job's outputs (by name), those a replay must reproduce."""
        return set()

    def check_claimed(self, outputs: dict[str, dict]) -> dict | None:
        """Of a finished job's outputs (name -> ArtifactRef as a dict), the one a check is
        given to read (generate by fingerprints: the completions, whose tokens it
        prefills); None for a replay that reads nothing of the checked provider's."""
        return None

    def compare(self, expect: dict[str, Path], got: dict[str, Path], scope: dict
                ) -> tuple[bool, str]:
        """Whether a replay's outputs (``got``, by name) reproduce the checked provider's
        (``expect``): (agrees, what was compared or where they differ)."""
        return False, f"{self.name} jobs cannot be checked"

