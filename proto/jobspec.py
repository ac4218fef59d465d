"""JobSpec rules every kind shares, checked by the broker (on submit) and the provider
(before running); a kind's own parameters are checked by its module (gpumarket.kinds)."""

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

# The names of the kinds this program knows (plugins add theirs: gpumarket.kinds.register).
KIND_NAMES = {
    types_pb2.JOB_KIND_TRAINING: "training",
    types_pb2.JOB_KIND_GENERATE: "generate",
    types_pb2.JOB_KIND_EMBED: "embed",
    types_pb2.JOB_KIND_RENDER: "render",
    types_pb2.JOB_KIND_ENDPOINT: "endpoint",
    types_pb2.JOB_KIND_SCRIPT: "script",
}
KINDS_BY_NAME = {v: k for k, v in KIND_NAMES.items()}
ACCELERATOR_NAMES = {
    types_pb2.ACCELERATOR_UNSPECIFIED: "any",
    types_pb2.ACCELERATOR_CPU: "cpu",
    types_pb2.ACCELERATOR_CUDA: "cuda",
}
ACCELERATORS_BY_NAME = {v: k for k, v in ACCELERATOR_NAMES.items()}
MAX_PRICE = 10_000          # credits per device-hour: the ledger's integer units never overflow
MAX_CREDITS = 10**9         # a budget or stake
STATE_NAMES = {
    types_pb2.JOB_STATE_QUEUED: "QUEUED",
    types_pb2.JOB_STATE_LEASED: "LEASED",
    types_pb2.JOB_STATE_RUNNING: "RUNNING",
    types_pb2.JOB_STATE_SUCCEEDED: "SUCCEEDED",
    types_pb2.JOB_STATE_FAILED: "FAILED",
    types_pb2.JOB_STATE_CANCELLED: "CANCELLED",
    types_pb2.JOB_STATE_VERIFYING: "VERIFYING",
    types_pb2.JOB_STATE_PAUSED: "PAUSED",
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
TIER_NAMES = {
    types_pb2.TIER_UNSPECIFIED: "standard",
    types_pb2.TIER_STANDARD: "standard",
    types_pb2.TIER_INTERRUPTIBLE: "interruptible",
    types_pb2.TIER_SERVING: "serving",
}
TIERS_BY_NAME = {v: k for k, v in TIER_NAMES.items() if k}
TERMINAL_STATES = frozenset(
    {types_pb2.JOB_STATE_SUCCEEDED, types_pb2.JOB_STATE_FAILED, types_pb2.JOB_STATE_CANCELLED}
)


def now_ms() -> int:
    return int(time.time() * 1000)


def kind_name(kind: int) -> str:
    return KIND_NAMES.get(kind, "unspecified")


def tier_name(spec: types_pb2.JobSpec) -> str:
    """The spec's tier by name: "standard", "interruptible" or "serving" (an endpoint's
    replicas are always serving, whatever the spec says: kinds.check_spec refuses another)."""
    return TIER_NAMES.get(spec.tier, "standard")


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


def check_common(spec: types_pb2.JobSpec) -> None:
    """Raise InvalidArgument naming the first field every kind shares that makes ``spec``
    unrunnable (its kind's own parameters: gpumarket.kinds.check_spec)."""
    if spec.kind not in KIND_NAMES:
        raise InvalidArgument("kind: not set to a known job kind")
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
    if spec.tier not in TIER_NAMES:
        raise InvalidArgument("tier: unknown tier (standard, interruptible)")
    if spec.preemptible and spec.tier != types_pb2.TIER_INTERRUPTIBLE:
        raise InvalidArgument("preemptible: only an interruptible job may be preempted")
    if spec.objective == types_pb2.OBJECTIVE_DEADLINE and not spec.deadline_s:
        raise InvalidArgument("deadline: the deadline objective needs a deadline")
    if not 0 <= spec.min_reliability <= 1:
        raise InvalidArgument("min_reliability: must be between 0 and 1")
    if not 0 <= spec.resources.min_compute_capability < 100:
        raise InvalidArgument("resources.compute_capability: must be like 8.0")
    if len(spec.resources.gpu_models) > 64 or any(
            not 0 < len(m) <= 64 for m in spec.resources.gpu_models):
        raise InvalidArgument("resources.gpu_models: at most 64 names of 1 to 64 characters")
    if not 0 < spec.max_price_per_gpu_hour <= MAX_PRICE:
        raise InvalidArgument(f"max_price_per_gpu_hour: must be greater than 0 and at most"
                              f" {MAX_PRICE:,} credits")
    for field in ("budget", "min_provider_stake"):
        if not 0 <= getattr(spec, field) <= MAX_CREDITS:
            raise InvalidArgument(f"{field}: must be between 0 and {MAX_CREDITS:,} credits")
    if not 0 <= spec.verify_rate <= 1:
        raise InvalidArgument("verify_rate: must be between 0 and 1")
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
