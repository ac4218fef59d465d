"""Job kinds: one module each (training, generate, embed, render, and any plugin's), and
the registry everything else asks: a kind's name and number, parameters and their checks,
job-file fields, sizing and split rules, and its runner.

A plugin kind is a module with a ``KIND`` (a ``gpumarket.kinds.base.Kind`` numbered from
100), named in ``$GPUMARKET_KINDS`` (comma-separated modules) or in an installed package's
``gpumarket.kinds`` entry points; the broker and the provider load them in their
``main()`` with ``load_plugins``, the client as a command runs (client/console.py
``load_plugin_kinds``: its --help imports no kinds). No grpc here.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from typing import Any

from gpumarket.kinds import arrays, embed, endpoint, generate, render, script, training
from gpumarket.kinds.base import PLUGIN_NUMBERS, Kind
from gpumarket.kinds.schema import ParamError
from gpumarket.proto import jobspec
from gpumarket.proto.errors import InvalidArgument
from gpumarket.proto.v1 import types_pb2 as pb

__all__ = ["Kind", "ParamError", "all_kinds", "check_spec", "get", "load_plugins", "register",
           "values_of"]

_BY_NUMBER: dict[int, Kind] = {k.number: k for k in
                               (training.KIND, generate.KIND, embed.KIND, render.KIND,
                                            endpoint.KIND, script.KIND)}


def register(kind: Kind) -> Kind:
    """Add a plugin kind; raise InvalidArgument if its number or name is taken."""
    if kind.number not in PLUGIN_NUMBERS:
        raise InvalidArgument(f"kind {kind.name!r}: a plugin kind's number must be 100 or more")
    for other in _BY_NUMBER.values():
        if (other.number == kind.number or other.name == kind.name) and other != kind:
            raise InvalidArgument(f"kind {kind.name!r} ({kind.number}) clashes with"
                                  f" {other.name!r} ({other.number})")
    _BY_NUMBER[kind.number] = kind
    jobspec.KIND_NAMES[kind.number] = kind.name     # what kind_name() says of it
    jobspec.KINDS_BY_NAME[kind.name] = kind.number
    return kind


def load_plugins(modules: str = "") -> list[Kind]:
    """Register the kinds of installed ``gpumarket.kinds`` entry points and of ``modules``
    (comma-separated module names, as in $GPUMARKET_KINDS); return them."""
    found = []
    for ep in importlib.metadata.entry_points(group="gpumarket.kinds"):
        found.append(ep.load())
    for name in filter(None, (m.strip() for m in modules.split(","))):
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise InvalidArgument(f"kind module {name!r} cannot be imported ({exc})") from exc
        kind = getattr(module, "KIND", None)
        if not isinstance(kind, Kind):
            raise InvalidArgument(f"kind module {name!r} has no KIND")
        found.append(_with_path(kind, module))
    return [register(k) for k in found]


def _with_path(kind: Kind, module) -> Kind:
    """The kind, noting the import root its runner needs (a plugin named by module, maybe
    outside site-packages: a job's environment carries no PYTHONPATH of its own)."""
    from dataclasses import replace

    root = module.__file__
    for _ in range(module.__name__.count(".") + 1):
        root = os.path.dirname(root)
    return replace(kind, runner_path=(root,))


def get(key: int | str) -> Kind:
    """The kind by number or name; InvalidArgument if there is none."""
    kind = _BY_NUMBER.get(key) if isinstance(key, int) else next(
        (k for k in _BY_NUMBER.values() if k.name == key), None)
    if kind is None:
        raise InvalidArgument("kind: not set to a known job kind")
    return kind


def serves(number: int) -> bool:
    """Whether kind ``number`` is a long-lived service whose replicas are child jobs (the
    endpoint); False for a kind this process does not know (a plugin no longer loaded)."""
    kind = _BY_NUMBER.get(number)
    return kind is not None and kind.serves


def all_kinds() -> list[Kind]:
    return sorted(_BY_NUMBER.values(), key=lambda k: k.number)


def values_of(spec: pb.JobSpec) -> dict[str, Any]:
    """The spec's parameters, every one present (InvalidArgument naming the field)."""
    try:
        return get(spec.kind).values_of(spec)
    except ParamError as exc:
        raise InvalidArgument(str(exc)) from exc


def check_tier(spec: pb.JobSpec, kind: Kind) -> None:
    """Raise InvalidArgument unless the spec's tier suits its kind: an endpoint is served at
    the serving tier (and only an endpoint); an interruptible job of a kind that cannot
    checkpoint must accept restarts (``preemptible``), or it would buy the interruptible
    price with a standard job's protection."""
    if kind.serves and spec.tier not in (pb.TIER_UNSPECIFIED, pb.TIER_SERVING):
        raise InvalidArgument("tier: an endpoint's replicas are always of the serving tier")
    if not kind.serves and spec.tier == pb.TIER_SERVING:
        raise InvalidArgument("tier: serving is the tier of endpoints (a job is standard or"
                              " interruptible)")
    if spec.tier == pb.TIER_INTERRUPTIBLE and not kind.checkpoints and not spec.preemptible:
        raise InvalidArgument(f"tier: a {kind.name} job cannot checkpoint, so a preemption"
                              " restarts it from the start: say preemptible = true to accept"
                              " that, or use tier standard")


def check_spec(spec: pb.JobSpec) -> dict[str, Any]:
    """Raise InvalidArgument naming the first field that makes ``spec`` unrunnable (its
    common fields, then its kind's parameters); return the parameters."""
    if spec.kind not in _BY_NUMBER:
        raise InvalidArgument("kind: not set to a known job kind")
    jobspec.check_common(spec)
    kind = get(spec.kind)
    check_tier(spec, kind)
    values = values_of(spec)
    try:
        kind.check(values, {ref.name for ref in spec.inputs})
        if arrays.is_array(spec):
            arrays.check_array(spec, kind)
    except ParamError as exc:
        raise InvalidArgument(str(exc)) from exc
    return values
