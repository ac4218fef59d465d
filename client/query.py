"""The offer query grammar of ``gpumarket offers``.

    query   := clause { [","] clause }
    clause  := FIELD OP VALUE | FIELD "in" "[" VALUE { "," VALUE } "]"
    OP      := "=" | "==" | "!=" | "<" | "<=" | ">" | ">="

Numeric fields compare as numbers; text fields compare case-insensitively, and "=" on a
text field means "contains" (gpu_name=h100 matches "NVIDIA H100 80GB HBM3").
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpumarket.proto.errors import InvalidArgument

FIELDS: dict[str, tuple[str, str]] = {
    # name: (type, description)
    "gpus": ("number", "whole devices in the offer"),
    "free_gpus": ("number", "devices (slices counted) free to lease right now"),
    "gpu_ram": ("number", "memory per device, GiB (the smallest whole device)"),
    "slices": ("number", "slices the offer's devices are also offered as"),
    "slice_ram": ("number", "memory of its smallest slice, GiB (0: no slices)"),
    "gpu_name": ("text", "device model, e.g. H100"),
    "accelerator": ("text", "cpu or cuda"),
    "compute_cap": ("number", "CUDA compute capability, e.g. 8.0 (0 on CPU)"),
    "tflops": ("number", "benchmarked dense matmul TFLOP/s per device"),
    "bandwidth": ("number", "benchmarked memory bandwidth per device, GB/s"),
    "price": ("number", "credits per device-hour (standard tier)"),
    "interruptible_price": ("number", "credits per device-hour of an interruptible lease"),
    "reliability": ("number", "the broker's reliability score, 0 to 1"),
    "mtbf_h": ("number", "estimated mean time between failures, hours"),
    "uptime": ("number", "share of the last 7 days online, 0 to 1"),
    "completed": ("number", "leases completed with a valid receipt"),
    "figures": ("text", "claimed, measured (receipts back them) or contradicted"),
    "lost": ("number", "leases lost"),
    "check_rate": ("number", "share of its work the broker spot-checks now, 0.05 to 1"),
    "checks_passed": ("number", "spot checks passed since its last failed one"),
    "kind": ("text", "a job kind the provider runs (training, generate, embed, render)"),
    "limits": ("text", "how its jobs are limited, e.g. memory:cgroup-v2 pids:rlimit cpu:none"),
    "provider": ("text", "provider id"),
}
CLAUSE = re.compile(
    r"\s*,?\s*(?P<field>[A-Za-z_][A-Za-z0-9_]*)\s*"
    r"(?:(?P<op>>=|<=|!=|==|=|>|<)\s*(?P<value>[^\s,\[\]]+)"
    r"|\s+in\s+\[(?P<list>[^\]]*)\])"
)
NUMBER_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "=": operator.eq, "==": operator.eq, "!=": operator.ne, "<": operator.lt,
    "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}


@dataclass(frozen=True)
class Clause:
    field: str
    op: str
    values: tuple[Any, ...]

    def matches(self, row: dict[str, Any]) -> bool:
        actual = row[self.field]
        kind = FIELDS[self.field][0]
        if kind == "number":
            if self.op == "in":
                return actual in self.values
            return NUMBER_OPS[self.op](actual, self.values[0])
        texts = [a.lower() for a in (actual if isinstance(actual, list) else [actual])]
        if self.op == "in":
            return any(v in t for v in self.values for t in texts)
        if self.op in ("=", "=="):
            return any(self.values[0] in t for t in texts)
        if self.op == "!=":
            return all(self.values[0] not in t for t in texts)
        raise InvalidArgument(f"query: {self.field} is text; use =, != or in")


def _value(field: str, raw: str) -> Any:
    raw = raw.strip()
    if FIELDS[field][0] == "number":
        try:
            return float(raw)
        except ValueError as exc:
            raise InvalidArgument(f"query: {field} takes a number, got {raw!r}") from exc
    if not raw:
        raise InvalidArgument(f"query: empty value for {field}")
    return raw.lower()


def parse(text: str) -> list[Clause]:
    """Parse a query; raise InvalidArgument pointing at the first thing that does not parse."""
    clauses, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = CLAUSE.match(text, pos)
        if not m or m.end() == pos:
            rest = text[pos:].strip()
            raise InvalidArgument(f"query: cannot parse {rest!r} (expected FIELD OP VALUE, "
                                  "e.g. gpu_ram>=24)")
        field = m.group("field")
        if field not in FIELDS:
            raise InvalidArgument(f"query: unknown field {field!r} (see gpumarket offers --fields)")
        if m.group("list") is not None:
            items = [v for v in m.group("list").split(",") if v.strip()]
            if not items:
                raise InvalidArgument(f"query: empty list for {field}")
            clauses.append(Clause(field, "in", tuple(_value(field, v) for v in items)))
        else:
            clauses.append(Clause(field, m.group("op"), (_value(field, m.group("value")),)))
        pos = m.end()
    return clauses


def sort_key(field: str) -> tuple[str, bool]:
    """``price`` or ``-reliability`` → (field, descending)."""
    name, desc = (field[1:], True) if field.startswith("-") else (field, False)
    if name not in FIELDS:
        raise InvalidArgument(f"--sort: unknown field {name!r} (see gpumarket offers --fields)")
    return name, desc
