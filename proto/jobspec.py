"""JobSpec rules shared by the broker (on submit) and the provider (before running)."""

from __future__ import annotations

import re
import time

from gpumarket.proto.errors import Expired, InvalidArgument
from gpumarket.proto.v1 import types_pb2

NONCE_BYTES = 16
# A spec may be signed a little "in the future" of a receiver whose clock is behind.
CLOCK_SKEW_MS = 5 * 60 * 1000
MAX_LIFETIME_MS = 30 * 24 * 3600 * 1000
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

KIND_NAMES = {
    types_pb2.JOB_KIND_TRAINING: "training",
    types_pb2.JOB_KIND_GENERATE: "generate",
    types_pb2.JOB_KIND_EMBED: "embed",
    types_pb2.JOB_KIND_RENDER: "render",
}
KINDS_BY_NAME = {v: k for k, v in KIND_NAMES.items()}
ACCELERATOR_NAMES = {
    types_pb2.ACCELERATOR_UNSPECIFIED: "any",
    types_pb2.ACCELERATOR_CPU: "cpu",
    types_pb2.ACCELERATOR_CUDA: "cuda",
}
ACCELERATORS_BY_NAME = {v: k for k, v in ACCELERATOR_NAMES.items()}
STATE_NAMES = {
    types_pb2.JOB_STATE_QUEUED: "QUEUED",
    types_pb2.JOB_STATE_LEASED: "LEASED",
    types_pb2.JOB_STATE_RUNNING: "RUNNING",
    types_pb2.JOB_STATE_SUCCEEDED: "SUCCEEDED",
    types_pb2.JOB_STATE_FAILED: "FAILED",
    types_pb2.JOB_STATE_CANCELLED: "CANCELLED",
}
STATES_BY_NAME = {v: k for k, v in STATE_NAMES.items()}
OBJECTIVE_NAMES = {
    types_pb2.OBJECTIVE_UNSPECIFIED: "cheapest",
    types_pb2.OBJECTIVE_CHEAPEST: "cheapest",
    types_pb2.OBJECTIVE_FASTEST: "fastest",
    types_pb2.OBJECTIVE_RELIABLE: "reliable",
    types_pb2.OBJECTIVE_DEADLINE: "deadline",
}
OBJECTIVES_BY_NAME = {v: k for k, v in OBJECTIVE_NAMES.items() if k}
TERMINAL_STATES = frozenset(
    {types_pb2.JOB_STATE_SUCCEEDED, types_pb2.JOB_STATE_FAILED, types_pb2.JOB_STATE_CANCELLED}
)


def now_ms() -> int:
    return int(time.time() * 1000)


def kind_name(kind: int) -> str:
    return KIND_NAMES.get(kind, "unspecified")


def state_name(state: int) -> str:
    return STATE_NAMES.get(state, "UNSPECIFIED")


def check_artifact_name(name: str, where: str) -> None:
    """Raise InvalidArgument unless ``name`` is a plain file name that stays in a work dir."""
    if not NAME_RE.match(name) or name in {".", ".."}:
        raise InvalidArgument(
            f"{where}: {name!r} is not a plain file name (letters, digits, '.', '_', '-'; "
            "no '/', no leading '.')"
        )


def check_sha256(value: str, where: str) -> None:
    if not SHA256_RE.match(value):
        raise InvalidArgument(f"{where}: {value!r} is not a lowercase hex sha256")


def check_spec(spec: types_pb2.JobSpec) -> None:
    """Raise InvalidArgument naming the first field that makes ``spec`` unrunnable."""
    if spec.kind not in KIND_NAMES:
        raise InvalidArgument("kind: not set to a known job kind")
    if spec.kind not in PARAMS_OF_KIND:
        raise InvalidArgument(f"kind: {kind_name(spec.kind)} jobs are not supported yet")
    if len(spec.nonce) != NONCE_BYTES:
        raise InvalidArgument(f"nonce: must be {NONCE_BYTES} bytes")
    if spec.resources.gpus < 1:
        raise InvalidArgument("resources.gpus: must be at least 1")
    if spec.resources.gpus > 64:
        raise InvalidArgument("resources.gpus: at most 64 devices on one provider")
    if spec.resources.accelerator not in ACCELERATOR_NAMES:
        raise InvalidArgument("resources.accelerator: unknown accelerator")
    if spec.objective not in OBJECTIVE_NAMES:
        raise InvalidArgument("objective: unknown objective")
    if spec.objective == types_pb2.OBJECTIVE_DEADLINE and not spec.deadline_s:
        raise InvalidArgument("deadline: the deadline objective needs a deadline")
    if not 0 <= spec.min_reliability <= 1:
        raise InvalidArgument("min_reliability: must be between 0 and 1")
    if not 0 <= spec.resources.min_compute_capability < 100:
        raise InvalidArgument("resources.compute_capability: must be like 8.0")
    if len(spec.resources.gpu_models) > 64 or any(
            not 0 < len(m) <= 64 for m in spec.resources.gpu_models):
        raise InvalidArgument("resources.gpu_models: at most 64 names of 1 to 64 characters")
    if not spec.max_price_per_gpu_hour > 0:
        raise InvalidArgument("max_price_per_gpu_hour: must be greater than 0")
    if spec.expires_at_ms <= spec.created_at_ms:
        raise InvalidArgument("expires_at_ms: must be after created_at_ms")
    if spec.expires_at_ms - spec.created_at_ms > MAX_LIFETIME_MS:
        raise InvalidArgument("expires_at_ms: a spec may live at most 30 days")
    names = set()
    for i, ref in enumerate(spec.inputs):
        check_artifact_name(ref.name, f"inputs[{i}].name")
        check_sha256(ref.sha256, f"inputs[{i}].sha256")
        if ref.name in names:
            raise InvalidArgument(f"inputs[{i}].name: {ref.name!r} given twice")
        names.add(ref.name)
    field = PARAMS_OF_KIND[spec.kind]
    if spec.WhichOneof("params") != field:
        raise InvalidArgument(f"{field}: a {kind_name(spec.kind)} job needs a [{field}] table")
    CHECKS[field](getattr(spec, field), names)


def _check_inputs(params, fields: tuple[str, ...], where: str, inputs: set[str]) -> None:
    for name in fields:
        value = getattr(params, name)
        if not value:
            raise InvalidArgument(f"{where}.{name}: required")
        if value not in inputs:
            raise InvalidArgument(f"{where}.{name}: names no input ({value!r})")


def _check_engine(params, where: str) -> None:
    if params.engine not in ENGINES:
        raise InvalidArgument(f"{where}.engine: must be one of {sorted(ENGINES - {''})}")
    if params.dtype not in DTYPES:
        raise InvalidArgument(f"{where}.dtype: must be one of {sorted(DTYPES - {''})}")


def _check_model(params, where: str, inputs: set[str]) -> None:
    """Exactly one of model (an input: a tar of a model directory) and model_name (a model
    the provider holds)."""
    if bool(params.model) == bool(params.model_name):
        raise InvalidArgument(f"{where}: give exactly one of model or model_name")
    if params.model:
        _check_inputs(params, ("model",), where, inputs)
    elif not NAME_RE.match(params.model_name):
        raise InvalidArgument(f"{where}.model_name: {params.model_name!r} is not a plain name")


def _check_generate(g: types_pb2.GenerateParams, inputs: set[str]) -> None:
    _check_model(g, "generate", inputs)
    _check_inputs(g, ("prompts",), "generate", inputs)
    _check_engine(g, "generate")
    if g.max_tokens > 1_000_000:
        raise InvalidArgument("generate.max_tokens: at most 1,000,000")
    if not 0 <= g.temperature <= 100:
        raise InvalidArgument("generate.temperature: must be between 0 and 100")
    if not 0 <= g.top_p <= 1:
        raise InvalidArgument("generate.top_p: must be between 0 and 1")
    if len(g.stop) > 16 or any(not 0 < len(s) <= 256 for s in g.stop):
        raise InvalidArgument("generate.stop: at most 16 strings of 1 to 256 characters")
    if g.batch_size > 4096:
        raise InvalidArgument("generate.batch_size: at most 4,096")
    if g.quantization and g.engine != "vllm":
        raise InvalidArgument("generate.quantization: needs engine = \"vllm\"")


def _check_embed(e: types_pb2.EmbedParams, inputs: set[str]) -> None:
    _check_model(e, "embed", inputs)
    _check_inputs(e, ("texts",), "embed", inputs)
    _check_engine(e, "embed")
    if e.engine == "vllm":
        raise InvalidArgument("embed.engine: embed jobs run on transformers")
    if e.output_format not in ("", "jsonl", "npy"):
        raise InvalidArgument("embed.output_format: must be jsonl or npy")
    if e.batch_size > 65_536:
        raise InvalidArgument("embed.batch_size: at most 65,536")


def _check_training(t: types_pb2.TrainingParams, inputs: set[str]) -> None:
    if bool(t.model_config) == bool(t.base_model):
        raise InvalidArgument("training: give exactly one of model_config or base_model")
    for field in ("model_config", "base_model", "dataset"):
        value = getattr(t, field)
        if value and value not in inputs:
            raise InvalidArgument(f"training.{field}: names no input ({value!r})")
    if not t.dataset:
        raise InvalidArgument("training.dataset: required")
    if not 1 <= t.steps <= 10_000_000:
        raise InvalidArgument("training.steps: must be between 1 and 10,000,000")
    if not 1 <= t.batch_size <= 65_536:
        raise InvalidArgument("training.batch_size: must be between 1 and 65,536")
    if not 2 <= t.seq_len <= 1_048_576:
        raise InvalidArgument("training.seq_len: must be between 2 and 1,048,576")
    if not 0 < t.learning_rate < 10:
        raise InvalidArgument("training.learning_rate: must be in (0, 10)")
    if t.warmup_steps > t.steps:
        raise InvalidArgument("training.warmup_steps: more than training.steps")


RENDER_DEVICES = {"", "auto", "cpu", "cuda", "optix"}
MAX_FRAMES = 1_000_000
MAX_PARTS = 64


def _check_render(r: types_pb2.RenderParams, inputs: set[str]) -> None:
    _check_inputs(r, ("scene",), "render", inputs)
    if not r.scene.endswith(".blend"):
        raise InvalidArgument(f"render.scene: {r.scene!r} is not a .blend file")
    if r.frame_end < r.frame_start:
        raise InvalidArgument("render.frame_end: before render.frame_start")
    frames = r.frame_end - r.frame_start + 1
    if frames > MAX_FRAMES:
        raise InvalidArgument(f"render: at most {MAX_FRAMES:,} frames in one job")
    for name in ("resolution_x", "resolution_y"):
        if getattr(r, name) > 16384:
            raise InvalidArgument(f"render.{name}: at most 16,384 pixels")
    if r.samples > 1_000_000:
        raise InvalidArgument("render.samples: at most 1,000,000")
    if r.device not in RENDER_DEVICES:
        raise InvalidArgument(f"render.device: must be one of {sorted(RENDER_DEVICES - {''})}")
    if r.output_format not in ("", "PNG"):
        raise InvalidArgument("render.output_format: only \"PNG\" is supported")
    if r.engine not in ("", "cycles"):
        raise InvalidArgument("render.engine: only \"cycles\" renders headless")
    if r.split > min(MAX_PARTS, frames):
        raise InvalidArgument(f"render.split: at most {min(MAX_PARTS, frames)} parts"
                              f" (one frame each at least, {MAX_PARTS} at most)")


def part_frames(first: int, last: int, part: int, parts: int) -> range:
    """The frames of part ``part`` (1-based) of ``parts``: contiguous ranges that cover
    first..last once, the earlier parts one frame longer when they do not divide evenly.
    Part 0 (or one part) is the whole range."""
    if parts <= 1 or part == 0:
        return range(first, last + 1)
    if not 1 <= part <= parts:
        raise InvalidArgument(f"part {part} of {parts} does not exist")
    count = last - first + 1
    size, extra = divmod(count, parts)
    start = first + (part - 1) * size + min(part - 1, extra)
    return range(start, start + size + (1 if part <= extra else 0))


def split_parts(spec: types_pb2.JobSpec) -> int:
    """How many parts the job runs as (1 unless it is a render job with split > 1)."""
    if spec.WhichOneof("params") == "render":
        return max(1, spec.render.split)
    return 1


PARAMS_OF_KIND = {types_pb2.JOB_KIND_TRAINING: "training",
                  types_pb2.JOB_KIND_GENERATE: "generate", types_pb2.JOB_KIND_EMBED: "embed",
                  types_pb2.JOB_KIND_RENDER: "render"}
CHECKS = {"training": _check_training, "generate": _check_generate, "embed": _check_embed,
          "render": _check_render}
ENGINES = {"", "transformers", "vllm"}
DTYPES = {"", "auto", "float32", "bfloat16", "float16"}


def job_params(spec: types_pb2.JobSpec):
    """The spec's kind-specific parameters (its TrainingParams, GenerateParams, ...)."""
    return getattr(spec, spec.WhichOneof("params") or "training")


def required_engine(spec: types_pb2.JobSpec) -> str:
    """The inference engine the job asks for; "" for any (and for kinds without engines)."""
    return getattr(job_params(spec), "engine", "")


def required_model(spec: types_pb2.JobSpec) -> str:
    """The name of a model the job wants from the provider's model directory; "" if none."""
    return getattr(job_params(spec), "model_name", "")


def wants_remote_code(spec: types_pb2.JobSpec) -> bool:
    """Whether the job asks to run its model's own code (only on providers that allow it)."""
    return bool(getattr(job_params(spec), "trust_remote_code", False))


def model_input_sha256(spec: types_pb2.JobSpec) -> str:
    """The sha256 of the model archive the job sends as an input; "" if none (a provider
    that has it cached already is preferred: a warm cache)."""
    name = getattr(job_params(spec), "model", "")
    return next((ref.sha256 for ref in spec.inputs if name and ref.name == name), "")


# Job logs travel in updates of at most this many lines, each cut to this many characters.
LOG_LINES_PER_UPDATE = 256
LOG_LINE_CHARS = 4096


def check_fresh(spec: types_pb2.JobSpec, at_ms: int | None = None) -> None:
    """Raise Expired if the spec is past its expiry or signed too far in the future."""
    at = now_ms() if at_ms is None else at_ms
    if spec.expires_at_ms <= at:
        raise Expired(f"job spec expired {(at - spec.expires_at_ms) / 1000:.0f}s ago")
    if spec.created_at_ms > at + CLOCK_SKEW_MS:
        raise Expired("job spec is dated in the future (check the client's clock)")
