"""Job files (TOML) → a JobSpec plus the local files to upload as its inputs.

Every problem is one JobFileError naming the file and the field.
"""

from __future__ import annotations

import io
import os
import re
import tarfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumarket.proto.errors import JobFileError
from gpumarket.proto.jobspec import ACCELERATORS_BY_NAME, KINDS_BY_NAME, OBJECTIVES_BY_NAME

DEFAULT_EXPIRY_S = 24 * 3600

# field → (type, required). Types: int, float, str, "size", "path", "dir_or_file".
TOP = {
    "name": (str, False), "kind": (str, True), "max_price": (float, True),
    "max_runtime": (int, False), "max_attempts": (int, False), "expires_in": (int, False),
    "objective": (str, False), "deadline": ("duration", False),
    "min_reliability": (float, False),
    "resources": (dict, False), "training": (dict, False), "generate": (dict, False),
    "embed": (dict, False), "render": (dict, False),
}
RESOURCES = {"gpus": (int, False), "memory": ("size", False), "accelerator": (str, False),
             "compute_capability": ("version", False), "gpu_models": ("strings", False)}
DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
TRAINING = {
    "model_config": ("path", False), "base_model": ("dir_or_file", False),
    "dataset": ("path", True), "steps": (int, True), "batch_size": (int, True),
    "seq_len": (int, True), "learning_rate": (float, True), "seed": (int, False),
    "warmup_steps": (int, False), "checkpoint_every": (int, False),
}
GENERATE = {
    "model": ("dir_or_file", False), "model_name": (str, False), "prompts": ("path", True),
    "trust_remote_code": (bool, False), "max_tokens": (int, False),
    "temperature": (float, False), "top_p": (float, False), "seed": (int, False),
    "stop": ("strings", False), "batch_size": (int, False), "engine": (str, False),
    "dtype": (str, False), "quantization": (str, False), "checkpoint_every": (int, False),
}
EMBED = {
    "model": ("dir_or_file", False), "model_name": (str, False), "texts": ("path", True),
    "trust_remote_code": (bool, False), "batch_size": (int, False),
    "output_format": (str, False), "normalize": (bool, False), "engine": (str, False),
    "dtype": (str, False), "checkpoint_every": (int, False),
}
RENDER = {
    "scene": ("path", True), "frame_start": (int, True), "frame_end": (int, True),
    "resolution_x": (int, False), "resolution_y": (int, False), "samples": (int, False),
    "device": (str, False), "output_format": (str, False), "split": (int, False),
    "engine": (str, False), "checkpoint_every": (int, False),
}
SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True)
class LocalInput:
    name: str          # the input's name in the spec
    path: Path         # file to upload (a tar made on the fly for directories)


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
    params_field: str               # "training", "generate", "embed" or "render"
    params: dict[str, Any]          # that message's fields; input fields hold input names
    inputs: tuple[LocalInput, ...]


def parse_size(value: Any, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        m = SIZE_RE.match(value)
        if m:
            return int(float(m.group(1)) * UNITS[(m.group(2) or "B").lower()])
    raise JobFileError(f"{where} must be a size like \"16GiB\" or a number of bytes, got {value!r}")


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
            "strings": "a list of strings"}[t]


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
    _check_table(raw, TOP, "", file)
    kind_text = raw["kind"]
    if kind_text not in KINDS_BY_NAME:
        raise JobFileError(f"{file}: field 'kind' must be one of {sorted(KINDS_BY_NAME)},"
                           f" got {kind_text!r}")
    if kind_text not in PARSERS:
        raise JobFileError(f"{file}: kind {kind_text!r} is not supported yet (supported:"
                           f" {', '.join(PARSERS)})")
    resources = _check_table(raw.get("resources", {}), RESOURCES, "resources.", file)
    accel = resources.get("accelerator", "any")
    if accel not in ACCELERATORS_BY_NAME:
        raise JobFileError(f"{file}: field 'resources.accelerator' must be one of"
                           f" {sorted(ACCELERATORS_BY_NAME)}, got {accel!r}")
    for other in PARSERS:
        if other != kind_text and other in raw:
            raise JobFileError(f"{file}: a {kind_text} job takes no [{other}] table")
    if kind_text not in raw:
        raise JobFileError(f"{file}: a {kind_text} job needs a [{kind_text}] table")
    params, inputs = PARSERS[kind_text](raw[kind_text], path.parent, file)
    numbers = {"max_runtime": raw.get("max_runtime", 0), "max_attempts": raw.get("max_attempts", 0),
               "expires_in": raw.get("expires_in", DEFAULT_EXPIRY_S),
               "resources.gpus": resources.get("gpus", 1)}
    for key, value in numbers.items():
        if value < 0:
            raise JobFileError(f"{file}: field {key!r} must not be negative")
    objective = raw.get("objective", "cheapest")
    if objective not in OBJECTIVES_BY_NAME:
        raise JobFileError(f"{file}: field 'objective' must be one of"
                           f" {sorted(OBJECTIVES_BY_NAME)}, got {objective!r}")
    deadline = parse_duration(raw["deadline"], f"{file}: field 'deadline'") \
        if "deadline" in raw else 0
    if objective == "deadline" and not deadline:
        raise JobFileError(f"{file}: objective \"deadline\" needs a field 'deadline'")
    min_rel = float(raw.get("min_reliability", 0.0))
    if not 0 <= min_rel <= 1:
        raise JobFileError(f"{file}: field 'min_reliability' must be between 0 and 1")
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
        kind=KINDS_BY_NAME[kind_text],
        max_price=float(raw["max_price"]),
        max_runtime_s=numbers["max_runtime"],
        max_attempts=numbers["max_attempts"],
        expires_in_s=numbers["expires_in"],
        gpus=numbers["resources.gpus"],
        min_memory_bytes=parse_size(resources.get("memory", 0), "resources.memory"),
        accelerator=ACCELERATORS_BY_NAME[accel],
        params_field=kind_text,
        params=params,
        inputs=tuple(inputs),
    )


def _training(table: dict, base: Path, file: str) -> tuple[dict, list[LocalInput]]:
    training = dict(_check_table(table, TRAINING, "training.", file))
    inputs = []
    has_config, has_base = "model_config" in training, "base_model" in training
    if has_config == has_base:
        raise JobFileError(f"{file}: [training] needs exactly one of model_config or base_model")
    if has_config:
        src = _file(base, training["model_config"], "training.model_config", file)
        inputs.append(LocalInput("model_config.json", src))
        training["model_config"] = "model_config.json"
    else:
        src = _file(base, training["base_model"], "training.base_model", file)
        inputs.append(LocalInput("base_model.tar", src))
        training["base_model"] = "base_model.tar"
    src = _file(base, training["dataset"], "training.dataset", file)
    inputs.append(LocalInput("dataset.jsonl", src))
    training["dataset"] = "dataset.jsonl"
    for key in ("steps", "batch_size", "seq_len", "warmup_steps", "checkpoint_every", "seed"):
        if key in training and training[key] < 0:
            raise JobFileError(f"{file}: field 'training.{key}' must not be negative")
    training.setdefault("seed", 0)
    return training, inputs


def _inference(kind: str, schema: dict, data_field: str, table: dict, base: Path,
               file: str) -> tuple[dict, list[LocalInput]]:
    params = dict(_check_table(table, schema, f"{kind}.", file))
    if ("model" in params) == ("model_name" in params):
        raise JobFileError(f"{file}: [{kind}] needs exactly one of model (a model directory to"
                           " send) or model_name (a model the provider holds)")
    data = _file(base, params[data_field], f"{kind}.{data_field}", file)
    inputs = [LocalInput(f"{data_field}.jsonl", data)]
    params[data_field] = f"{data_field}.jsonl"
    if "model" in params:
        model = _file(base, params["model"], f"{kind}.model", file)
        if model.is_dir() and not (model / "config.json").exists():
            raise JobFileError(f"{file}: {kind}.model = {params['model']!r}: a model directory"
                               " needs a config.json")
        inputs.insert(0, LocalInput("model.tar", model))
        params["model"] = "model.tar"
    for key in ("max_tokens", "seed", "batch_size", "checkpoint_every"):
        if key in params and params[key] < 0:
            raise JobFileError(f"{file}: field '{kind}.{key}' must not be negative")
    if "normalize" in params:
        params["keep_scale"] = not params.pop("normalize")
    return params, inputs


def _render(table: dict, base: Path, file: str) -> tuple[dict, list[LocalInput]]:
    params = dict(_check_table(table, RENDER, "render.", file))
    scene = _file(base, params["scene"], "render.scene", file)
    if scene.is_dir() or scene.suffix != ".blend":
        raise JobFileError(f"{file}: render.scene = {params['scene']!r}: not a .blend file")
    for key in RENDER:
        if RENDER[key][0] is int and key in params and params[key] < 0:
            raise JobFileError(f"{file}: field 'render.{key}' must not be negative")
    if params["frame_end"] < params["frame_start"]:
        raise JobFileError(f"{file}: field 'render.frame_end' is before 'render.frame_start'")
    params["scene"] = "scene.blend"
    return params, [LocalInput("scene.blend", scene)]


PARSERS = {
    "training": _training,
    "generate": lambda t, b, f: _inference("generate", GENERATE, "prompts", t, b, f),
    "embed": lambda t, b, f: _inference("embed", EMBED, "texts", t, b, f),
    "render": _render,
}


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
