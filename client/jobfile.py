"""Job files (TOML) → a JobSpec plus the local files to upload as its inputs.

Every problem is one JobFileError naming the file and the field.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumarket.proto.errors import JobFileError
from gpumarket import kinds
from gpumarket.client import arrays as job_arrays
from gpumarket.kinds.schema import TYPE_WORDS, UINT32, UINT64
from gpumarket.proto.jobspec import (
    ACCELERATORS_BY_NAME, MAX_CREDITS, MAX_PRICE, OBJECTIVES_BY_NAME,
)
from gpumarket.proto.money import units
from gpumarket.proto.v1 import types_pb2 as pb

DEFAULT_EXPIRY_S = 24 * 3600
# The top-level numbers' ranges: what the spec's fields hold and the broker accepts.
NUMBER_RANGES = {"max_runtime": (0, UINT32), "max_attempts": (0, 100),
                 "expires_in": (1, 30 * 24 * 3600), "resources.gpus": (1, 64)}

# field → (type, required). Types: int, float, str, "size", "path", "dir_or_file".
TOP = {
    "name": (str, False), "kind": (str, True), "max_price": (float, True),
    "max_runtime": (int, False), "max_attempts": (int, False), "expires_in": (int, False),
    "objective": (str, False), "deadline": ("duration", False),
    "min_reliability": (float, False), "resources": (dict, False),
    "budget": (float, False), "min_provider_stake": (float, False),
    "verify": ("verify", False), "tier": (str, False), "preemptible": (bool, False),
}   # and one table, named after the kind, of the kind's own fields (gpumarket.kinds)
RESOURCES = {"gpus": (int, False), "memory": ("size", False), "accelerator": (str, False),
             "compute_capability": ("version", False), "gpu_models": ("strings", False)}
DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True)
class LocalInput:
    name: str          # the input's name in the spec
    path: Path         # file to upload (a tar made on the fly for directories)
    data: bytes | None = None   # or: these bytes (a job array's tasks)


@dataclass(frozen=True)
class JobFile:
    """A parsed job file: plain values, ready to become a JobSpec once inputs are uploaded."""

    path: Path
    name: str
    kind: int
    max_price: float
    max_runtime_s: int
    max_attempts: int
    expires_in_s: int
    gpus: int
    min_memory_bytes: int
    accelerator: int
    objective: int
    deadline_s: int
    min_reliability: float
    min_compute_capability: float
    gpu_models: tuple[str, ...]
    params_field: str               # the kind's name: its table in the job file
    params: dict[str, Any]          # the fields given (spec names); inputs hold input names
    inputs: tuple[LocalInput, ...]
    budget: float = 0.0             # credits to hold; 0 = the broker's estimate
    min_provider_stake: float = 0.0
    verify_rate: float = 0.0        # share of segments checked at least; 0 = the broker's rate
    array_count: int = 0            # a job array: its tasks (one per line of tasks.jsonl) ...
    array_per_lease: int = 0        # ... and the most one lease runs (0: the broker's choice)
    tier: int = 0                   # TIER_*: standard (UNSPECIFIED) or interruptible
    preemptible: bool = False       # interruptible without checkpoints: restarts accepted


def parse_tier(raw: dict, kind: kinds.Kind, file: str) -> tuple[int, bool]:
    """``tier`` ("standard", the default, or "interruptible": cheaper, and a job of a
    higher tier may preempt it) and ``preemptible`` (an interruptible job of a kind that
    cannot checkpoint accepts restarts from the start), as the spec's values."""
    name = raw.get("tier", "standard")
    if name not in ("standard", "interruptible"):
        raise JobFileError(f"{file}: field 'tier' must be \"standard\" or \"interruptible\""
                           f" (an endpoint is always served at the serving tier), got {name!r}")
    preemptible = raw.get("preemptible", False)
    if preemptible and name != "interruptible":
        raise JobFileError(f"{file}: field 'preemptible' is for tier = \"interruptible\" only")
    if kind.serves and name != "standard":
        raise JobFileError(f"{file}: field 'tier': an endpoint is always served at the"
                           " serving tier")
    if name == "interruptible" and not kind.checkpoints and not preemptible:
        raise JobFileError(f"{file}: field 'tier': a {kind.name} job cannot checkpoint, so a"
                           " preemption restarts it from the start: set preemptible = true to"
                           " accept that, or use tier = \"standard\"")
    tier = pb.TIER_INTERRUPTIBLE if name == "interruptible" else pb.TIER_UNSPECIFIED
    return tier, bool(preemptible)


def parse_verify(value: Any, where: str) -> float:
    """``verify``: "auto" (the broker's adaptive rate), "always" (every segment replayed on a
    second provider), or a share of segments between 0 and 1."""
    if value == "auto":
        return 0.0
    if value == "always":
        return 1.0
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1:
        return float(value)
    raise JobFileError(f"{where} must be \"auto\", \"always\" or a share between 0 and 1,"
                       f" got {value!r}")


def parse_size(value: Any, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        m = SIZE_RE.match(value)
        if m:
            return int(float(m.group(1)) * UNITS[(m.group(2) or "B").lower()])
    raise JobFileError(f"{where} must be a size like \"16GiB\" or a number of bytes,"
                       f" got {value!r}")


def parse_duration(value: Any, where: str) -> int:
    """Seconds from an integer or a string like "90m", "2h", "1.5d"."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        m = DURATION_RE.match(value)
        if m:
            scale = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
            seconds = int(float(m.group(1)) * scale)
            if seconds > 0:
                return seconds
    raise JobFileError(f"{where} must be a duration like \"2h\" or a number of seconds,"
                       f" got {value!r}")


def _type_name(t: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            dict: "a table",
            "size": "a size", "path": "a file path", "dir_or_file": "a path",
            "duration": "a duration", "version": "a version like \"8.0\"",
            "strings": "a list of strings",
            "verify": "\"auto\", \"always\" or a share between 0 and 1"}[t]


def _check_table(table: dict, schema: dict, where: str, file: str) -> dict:
    for key in table:
        if key not in schema:
            known = ", ".join(sorted(schema))
            raise JobFileError(f"{file}: unknown field '{where}{key}' (known: {known})")
    for key, (typ, required) in schema.items():
        if key not in table:
            if required:
                raise JobFileError(f"{file}: missing required field '{where}{key}'")
            continue
        value = table[key]
        ok = {
            int: isinstance(value, int) and not isinstance(value, bool),
            float: isinstance(value, (int, float)) and not isinstance(value, bool),
            str: isinstance(value, str), dict: isinstance(value, dict),
            "size": isinstance(value, (int, str)) and not isinstance(value, bool),
            "path": isinstance(value, str), "dir_or_file": isinstance(value, str),
            "duration": isinstance(value, (int, str)) and not isinstance(value, bool),
            "version": isinstance(value, (int, float, str)) and not isinstance(value, bool),
            "strings": isinstance(value, list) and all(isinstance(v, str) for v in value),
            bool: isinstance(value, bool),
            "verify": isinstance(value, (int, float, str)) and not isinstance(value, bool),
        }[typ]
        if not ok:
            raise JobFileError(f"{file}: field '{where}{key}' must be {_type_name(typ)},"
                               f" got {type(value).__name__} {value!r}")
    return table


def _file(base: Path, value: str, field: str, file: str) -> Path:
    path = (base / value).expanduser()
    if not path.exists():
        raise JobFileError(f"{file}: {field} = {value!r}: no such file ({path})")
    return path


def load(path: Path) -> JobFile:
    """Read and check a job file; raise JobFileError naming the problem."""
    file = str(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise JobFileError(f"{file}: no such job file") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise JobFileError(f"{file}: cannot read ({exc})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise JobFileError(f"{file}: not valid TOML ({exc})") from exc
    kind_text = raw.get("kind")
    names = [k.name for k in kinds.all_kinds()]
    if "kind" in raw and kind_text not in names:
        raise JobFileError(f"{file}: field 'kind' must be one of {sorted(names)},"
                           f" got {kind_text!r}")
    table = raw.pop(kind_text, None) if kind_text in names else None
    array_table = raw.pop("array", None)
    _check_table(raw, TOP, "", file)
    kind = kinds.get(kind_text)
    resources = _check_table(raw.get("resources", {}), RESOURCES, "resources.", file)
    accel = resources.get("accelerator", "any")
    if accel not in ACCELERATORS_BY_NAME:
        raise JobFileError(f"{file}: field 'resources.accelerator' must be one of"
                           f" {sorted(ACCELERATORS_BY_NAME)}, got {accel!r}")
    if not isinstance(table, dict):
        raise JobFileError(f"{file}: a {kind_text} job needs a [{kind_text}] table")
    params, inputs = read_params(kind, table, path.parent, file)
    array = None
    if array_table is not None:
        array = job_arrays.load(array_table, path.parent, file)
        inputs += [LocalInput(p.name, p) for p in array.inputs]
        inputs.append(LocalInput(job_arrays.TASKS_INPUT, path, array.data))
        names = [i.name for i in inputs]
        if len(set(names)) != len(names):
            raise JobFileError(f"{file}: array.inputs: two inputs named alike")
        full = {p.name: params.get(p.name, p.zero()) for p in kind.params}
        job_arrays.check(kind, full, array, set(names), file)
    numbers = {"max_runtime": raw.get("max_runtime", 0), "max_attempts": raw.get("max_attempts", 0),
               "expires_in": raw.get("expires_in", DEFAULT_EXPIRY_S),
               "resources.gpus": resources.get("gpus", 1)}
    for key, value in numbers.items():
        low, high = NUMBER_RANGES[key]
        if not low <= value <= high:
            raise JobFileError(f"{file}: field {key!r} must be between {low:,} and {high:,}")
    if not 0 < float(raw["max_price"]) <= MAX_PRICE:
        raise JobFileError(f"{file}: field 'max_price' must be greater than 0 and at most"
                           f" {MAX_PRICE:,}")
    objective = raw.get("objective", "cheapest")
    if objective not in OBJECTIVES_BY_NAME:
        raise JobFileError(f"{file}: field 'objective' must be one of"
                           f" {sorted(OBJECTIVES_BY_NAME)}, got {objective!r}")
    deadline = parse_duration(raw["deadline"], f"{file}: field 'deadline'") \
        if "deadline" in raw else 0
    if deadline > UINT32:
        raise JobFileError(f"{file}: field 'deadline' must be at most {UINT32:,} seconds")
    if objective == "deadline" and not deadline:
        raise JobFileError(f"{file}: objective \"deadline\" needs a field 'deadline'")
    money = {}
    for key in ("budget", "min_provider_stake"):
        value = float(raw.get(key, 0.0))
        if not 0 <= value <= MAX_CREDITS:
            raise JobFileError(f"{file}: field {key!r} must be between 0 and {MAX_CREDITS:,}"
                               " credits")
        money[key] = value
    verify_rate = parse_verify(raw.get("verify", "auto"), f"{file}: field 'verify'")
    tier, preemptible = parse_tier(raw, kind, file)
    min_rel = float(raw.get("min_reliability", 0.0))
    if not 0 <= min_rel <= 1:
        raise JobFileError(f"{file}: field 'min_reliability' must be between 0 and 1")
    memory = parse_size(resources.get("memory", 0), f"{file}: field 'resources.memory'")
    if memory > UINT64:
        raise JobFileError(f"{file}: field 'resources.memory' must be at most {UINT64:,} bytes")
    try:
        cc = float(resources.get("compute_capability", 0))
    except ValueError as exc:
        raise JobFileError(f"{file}: field 'resources.compute_capability' must be like"
                           f" \"8.0\"") from exc
    return JobFile(
        path=path,
        objective=OBJECTIVES_BY_NAME[objective],
        deadline_s=deadline,
        min_reliability=min_rel,
        min_compute_capability=cc,
        gpu_models=tuple(resources.get("gpu_models", [])),
        name=raw.get("name", path.stem),
        kind=kind.number,
        max_price=float(raw["max_price"]),
        budget=money["budget"],
        min_provider_stake=money["min_provider_stake"],
        verify_rate=verify_rate,
        max_runtime_s=numbers["max_runtime"],
        max_attempts=numbers["max_attempts"],
        expires_in_s=numbers["expires_in"],
        gpus=numbers["resources.gpus"],
        min_memory_bytes=memory,
        accelerator=ACCELERATORS_BY_NAME[accel],
        params_field=kind_text,
        params=params,
        inputs=tuple(inputs),
        tier=tier, preemptible=preemptible,
        array_count=array.count if array else 0,
        array_per_lease=array.per_lease if array else 0,
    )


def read_params(kind: kinds.Kind, table: dict, base: Path, file: str
                ) -> tuple[dict[str, Any], list[LocalInput]]:
    """A kind's table of a job file: its fields as the spec's values (local files become
    inputs, named as the kind says), checked against the kind's schema and rules before
    anything is uploaded; every problem names the file and the field."""
    known = {p.field_in_file: p for p in kind.params}
    for key in table:
        if key not in known:
            raise JobFileError(f"{file}: unknown field '{kind.name}.{key}' (known:"
                               f" {', '.join(sorted(known))})")
    values: dict[str, Any] = {}
    inputs: list[LocalInput] = []
    for key, p in known.items():
        where = f"{kind.name}.{key}"
        if key not in table:
            if p.required:
                raise JobFileError(f"{file}: missing required field '{where}'")
            continue
        value = table[key]
        if not p.accepts_type(value):
            raise JobFileError(f"{file}: field '{where}' must be {TYPE_WORDS[p.type]},"
                               f" got {type(value).__name__} {value!r}")
        if p.type in ("file", "file_or_dir"):
            local = _file(base, value, where, file)
            if p.type == "file" and local.is_dir():
                raise JobFileError(f"{file}: {where} = {value!r}: a directory, not a file")
            if p.suffix and local.suffix != p.suffix:
                raise JobFileError(f"{file}: {where} = {value!r}: not a {p.suffix} file")
            if local.is_dir() and p.dir_needs and not (local / p.dir_needs).exists():
                raise JobFileError(f"{file}: {where} = {value!r}: a directory needs a"
                                   f" {p.dir_needs}")
            inputs.append(LocalInput(p.input_name, local))
            value = p.input_name
        elif p.from_file is not None:
            value = p.from_file(value)
        values[p.name] = value
    full = {p.name: values.get(p.name, p.zero()) for p in kind.params}
    try:
        kind.check(full, {i.name for i in inputs})
        config = local_config(kind, full, inputs)
        if config is not None:      # the broker checks it too, where it reads the config
            kind.check_config(full, config)
    except kinds.ParamError as exc:
        field = f"field '{exc.field}'" if "." in exc.field else f"[{exc.field}]"
        raise JobFileError(f"{file}: {field} {exc.problem}") from exc
    return values, inputs


MAX_CONFIG_BYTES = 1 << 20      # as the broker reads at most
# The broker's hold times (broker/holds.py, docs/ledger.md): at least MIN_HOLD_S where it can
# estimate the job's work (the training sizing rule, from its model's config), else its
# max_runtime or DEFAULT_HOLD_S.
MIN_HOLD_S = 300
DEFAULT_HOLD_S = 3600


def least_hold(job: JobFile) -> tuple[int, str]:
    """(the least the broker can hold for ``job``, in units; what that rests on): its budget,
    else max_price x its devices (of every part, replica or task) x the shortest hold time
    its kind allows. Never more than the broker's own figure, so a job refused on it would
    be refused at submit too, after its inputs went up."""
    if job.budget:
        return units(job.budget), "its budget"
    kind = kinds.get(job.kind)
    values = {p.name: job.params.get(p.name, p.zero()) for p in kind.params}
    parts = job.array_count or (values["max_replicas"] if kind.serves
                                else kind.parts(values))
    devices = job.gpus * max(1, parts)
    if kind.sizing == "training" and kind.config_input(values) is not None:   # work estimated
        seconds = min(MIN_HOLD_S, job.max_runtime_s or MIN_HOLD_S)
    else:
        seconds = job.max_runtime_s or DEFAULT_HOLD_S
    amount = max(1, units(job.max_price) * devices * seconds // 3600)
    return amount, (f"{seconds} s at max_price {job.max_price:g}/device-hour x {devices}"
                    f" device{'s' if devices > 1 else ''}")


def local_config(kind: kinds.Kind, values: dict[str, Any], inputs: list[LocalInput]
                 ) -> dict | None:
    """The model's config.json the job sends, read from the local file or directory (not
    from an archive: the broker reads that one); None where there is none to read."""
    found = kind.config_input(values)
    path = next((i.path for i in inputs if found and i.name == found[0]), None)
    if path is None:
        return None
    if path.is_dir():
        path = path / "config.json"
    elif found[1]:
        return None
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            return None
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def pack_directory(directory: Path) -> bytes:
    """A deterministic tar of a model directory (sorted names, config.json first, zeroed
    times and owners), so the same directory always has the same sha256 and uploads once;
    the broker reads only an archive's first entries to find its config."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for root, dirs, files in os.walk(directory):
            dirs.sort()
            first = ["config.json"] if root == str(directory) and "config.json" in files else []
            for fname in first + sorted(set(files) - set(first)):
                full = Path(root) / fname
                if full.is_symlink():
                    continue
                info = tar.gettarinfo(full, arcname=str(full.relative_to(directory)))
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                info.mode = 0o644
                with open(full, "rb") as f:
                    tar.addfile(info, f)
    return buf.getvalue()
