"""Admission: a verified, checked spec becomes a job the broker can store and match. What
the job needs of a provider is worked out here, once, and stored with it (as JSON); the
matcher and the lease manager read it from there. No grpc here.

Its size comes from its inputs (``estimate``): memory per device and work in FLOPs. The
broker reads the model's config.json from the artifact store (the ``model_config`` input, or
the config.json inside a ``base_model`` archive), bounded in size, and sizes the job by its
kind's sizing rule (``SIZING``) from the model's shape (``model_shape``, ``training_bytes``,
``inference_bytes``: the arithmetic at the end of this module)."""

from __future__ import annotations

import json
import tarfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from gpumarket import kinds
from gpumarket.kinds import Kind, ParamError
from gpumarket.kinds import arrays as task_arrays
from gpumarket.broker.config import BrokerConfig
from gpumarket.broker.jobs.job import Job
from gpumarket.broker.market import matcher
from gpumarket.proto.envelope import payload_sha256
from gpumarket.proto.errors import FailedPrecondition, InvalidArgument
from gpumarket.proto.jobspec import OBJECTIVE_NAMES, now_ms, tier_name
from gpumarket.proto.v1 import types_pb2 as pb

MAX_ATTEMPTS = 100

# What a submitted job is stored as (jobs/submit.store): one job; a split job and its parts;
# a job array, its tasks and their batches; an endpoint and its replicas.
Shape = Literal["job", "split", "array", "endpoint"]


@dataclass(frozen=True)
class Needs:
    """What a job needs of a provider, and what it pays."""

    kind: int
    gpus: int
    min_memory_bytes: int               # per device
    accelerator: int                    # ACCELERATOR_UNSPECIFIED = any
    max_price_per_gpu_hour: float
    min_compute_capability: float = 0.0
    gpu_models: tuple[str, ...] = ()    # substrings of GPU names; empty = any
    min_reliability: float = 0.0
    work_flops: float = 0.0             # 0 = unknown
    objective: str = "cheapest"
    deadline_s: int = 0                 # from submission; 0 = none
    max_runtime_s: int = 0
    engine: str = ""                    # inference engine required; "" = any
    model_name: str = ""                # a model the provider must hold
    model_sha256: str = ""              # the model archive it sends: holders are preferred
    remote_code: bool = False           # runs its model's own code
    checkpoint_every: int = 0           # the job's own checkpoint cadence; 0 = the broker's
    min_stake: int = 0                  # units its provider must have staked
    verify_rate: float = 0.0            # share of segments to check at least (verify)
    tier: str = "standard"              # "standard", "interruptible" or "serving" (endpoints)
    preemptible: bool = False           # interruptible without checkpoints: restarts accepted
    promoted: bool = False              # moved from interruptible to standard by its deadline

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Needs":
        raw = json.loads(text)
        raw["gpu_models"] = tuple(raw.get("gpu_models", ()))
        return cls(**raw)

    def view(self, job_id: str, client_id: str, age_ms: int = 0, checkpoint_cost_s: float = 0.0,
             avoid: frozenset[str] = frozenset(),
             exclude: frozenset[str] = frozenset()) -> matcher.JobNeeds:
        """What the matcher weighs: these needs, for a job ``age_ms`` old (its deadline as
        time left), with its measured checkpoint cost and the providers to avoid (tried
        before: last resort) or exclude (never)."""
        return matcher.JobNeeds(
            job_id=job_id, kind=self.kind, gpus=self.gpus,
            min_memory_bytes=self.min_memory_bytes, accelerator=self.accelerator,
            max_price_per_gpu_hour=self.max_price_per_gpu_hour, client_id=client_id,
            min_compute_capability=self.min_compute_capability,
            gpu_models=frozenset(self.gpu_models), min_reliability=self.min_reliability,
            work_flops=self.work_flops, objective=self.objective,
            deadline_s=max(0.0, self.deadline_s - age_ms / 1000) if self.deadline_s else 0.0,
            max_runtime_s=self.max_runtime_s, checkpoint_cost_s=checkpoint_cost_s,
            avoid=avoid, engine=self.engine, model_name=self.model_name,
            warm_sha256=self.model_sha256, remote_code=self.remote_code,
            min_stake=self.min_stake, exclude=exclude, tier=self.tier,
        )


@dataclass(frozen=True)
class NewJob:
    """A verified, validated submission, ready to be stored."""

    id: str
    client_id: str
    name: str
    spec: bytes                         # the serialized signed Envelope, as received
    spec_sha256: str
    needs: Needs
    expires_at_ms: int
    max_attempts: int
    nonce: str                          # hex
    inputs: tuple[str, ...] = ()        # sha256 of each input
    part_sizes: tuple[int, ...] = ()    # a split job: the steps (frames) of each part
    hold: int = 0                       # units held from the client at submission
    hold_basis: str = ""                # what the hold rests on
    fee_ppm: int = 0                    # the market's fee on its settlements
    enforce_funds: bool = False         # True: a hold is a limit (the broker's default: billing)
    shape: Shape = "job"                # what it is stored as (``shape``)
    runs_at_once: int = 0               # the runs its hold pays for at once: the parts of a
                                        # split job, an array's tasks, an endpoint's
                                        # max_replicas (0: one)
    lanes: int = 0                      # an array: the leases its tasks are spread over where
                                        # its spec does not say (0: the default)

    @property
    def kind(self) -> int:
        return self.needs.kind


def needs(spec: pb.JobSpec, values: dict, estimate: JobEstimate) -> Needs:
    """What a job of this spec (its kind's parameters ``values``, sized by ``estimate``)
    needs of a provider."""
    kind = kinds.get(spec.kind)
    r = spec.resources
    model = kind.model_input(values)
    return Needs(
        kind=spec.kind, gpus=r.gpus,
        min_memory_bytes=r.min_memory_bytes or estimate.memory_bytes,
        accelerator=r.accelerator, max_price_per_gpu_hour=spec.max_price_per_gpu_hour,
        min_compute_capability=r.min_compute_capability, gpu_models=tuple(r.gpu_models),
        min_reliability=spec.min_reliability, work_flops=estimate.work_flops,
        min_stake=round(spec.min_provider_stake * 1_000_000), verify_rate=spec.verify_rate,
        objective=OBJECTIVE_NAMES[spec.objective], deadline_s=spec.deadline_s,
        max_runtime_s=spec.max_runtime_s, engine=kind.engine(values),
        model_name=kind.model_name(values),
        model_sha256=next((i.sha256 for i in spec.inputs if model and i.name == model), ""),
        remote_code=kind.remote_code(values), checkpoint_every=kind.checkpoint_every(values),
        tier="serving" if kind.serves else tier_name(spec), preemptible=spec.preemptible)


def admit(envelope: pb.Envelope, spec: pb.JobSpec, client_id: str, values: dict,
          estimate: JobEstimate, config: BrokerConfig) -> NewJob:
    """The job a checked, signed spec becomes (its id: the first 16 hex of the sha256 of
    the signed payload)."""
    kind = kinds.get(spec.kind)
    digest = payload_sha256(envelope)
    parts = kind.parts(values)
    form = shape(spec, values)
    return NewJob(
        id=digest[:16], client_id=client_id, name=spec.name or kind.name,
        spec=envelope.SerializeToString(), spec_sha256=digest,
        needs=needs(spec, values, estimate), expires_at_ms=spec.expires_at_ms,
        max_attempts=min(spec.max_attempts or config.max_attempts, MAX_ATTEMPTS),
        nonce=spec.nonce.hex(), inputs=tuple(ref.sha256 for ref in spec.inputs),
        part_sizes=tuple(len(kind.part_steps(values, i, parts))
                         for i in range(1, parts + 1)) if parts > 1 else (),
        shape=form,
        runs_at_once=runs_at_once(spec, values),
    )


def runs_at_once(spec: pb.JobSpec, values: dict) -> int:
    """The runs a job of this checked spec holds money for at once: an array's tasks, an
    endpoint's max_replicas, a split job's parts (0: one). What a quote shows is sized the
    same way."""
    form, parts = shape(spec, values), kinds.get(spec.kind).parts(values)
    return (task_arrays.task_count(spec) if form == "array"
            else values["max_replicas"] if form == "endpoint"
            else parts if parts > 1 else 0)


def shape(spec: pb.JobSpec, values: dict) -> Shape:
    """What a job of this checked spec is stored as: a job array (its tasks run in batches,
    a lease each), an endpoint (a kind that serves: its replicas are scaled between its
    min_replicas and max_replicas), a split job (its kind splits it into parts that run at
    once), or one job."""
    kind = kinds.get(spec.kind)
    if task_arrays.is_array(spec):
        return "array"
    if kind.serves:
        return "endpoint"
    return "split" if kind.parts(values) > 1 else "job"


def check_deadline(needs: Needs, timed: list) -> None:
    """Refuse (FailedPrecondition) a job (interruptible or standard) whose deadline no offer
    could meet even if it started now: ``timed`` holds the live offers that fit it (credit_holds.Timed,
    busy or not; the submission times the fastest 50), and on the fastest its calibrated
    wall time is already past the deadline.
    FailedPrecondition, not InvalidArgument: the spec is well formed, today's market cannot
    run it in time (a faster provider online later could). No offer fitting at all is not a
    deadline's fault: such a job is queued and waits, as any job. A deadline some offer
    could meet only without the margin deadlines.py keeps is admitted and runs as standard
    from its first pass (promoted), or a standard one where it is expected in time."""
    if needs.tier not in ("interruptible", "standard") or needs.deadline_s <= 0 or not timed:
        return
    fastest = min(timed, key=lambda t: t.seconds)
    if fastest.seconds > needs.deadline_s:
        raise FailedPrecondition(
            f"deadline: {needs.deadline_s:,} s is too short: this job would take about"
            f" {fastest.seconds:,.0f} s on the fastest offer that fits it ({fastest.basis});"
            " give it at least that long, or no deadline")


def needs_of(job: Job, avoid: frozenset[str] = frozenset(),
             n: Needs | None = None, exclude: frozenset[str] = frozenset()) -> matcher.JobNeeds:
    """The matcher's view of a queued job: its stored needs (``n``, if read already) in its
    placement context — its age, its measured checkpoint cost — and the providers to avoid
    or exclude."""
    n = n or Needs.from_json(job.needs)
    return n.view(job.id, job.client_id, now_ms() - job.created_at_ms,
                  job.checkpoint_seconds, avoid, exclude)


# Sizing: what a job will need, from its inputs.

MAX_CONFIG_BYTES = 1 << 20
MAX_MEMBERS = 10_000        # archive entries read to find config.json
MAX_SCAN_S = 2.0            # ... and seconds spent on it


@dataclass(frozen=True)
class JobEstimate:
    memory_bytes: int          # per device; 0 = unknown
    work_flops: float          # 0 = unknown
    params: int


def _config_from_blob(path: Path, archive: bool) -> dict:
    if not archive:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise InvalidArgument("model config: larger than 1 MiB")
        return json.loads(path.read_text())
    with tarfile.open(path, "r:") as tar:
        member = _find_config(tar)
        if member is None or member.size > MAX_CONFIG_BYTES:
            raise InvalidArgument("base_model: no config.json of at most 1 MiB in the archive")
        return json.loads(tar.extractfile(member).read())


def _find_config(tar: tarfile.TarFile) -> tarfile.TarInfo | None:
    """The archive's config.json, looked for among its first MAX_MEMBERS entries and for at
    most MAX_SCAN_S (a stranger's archive may hold millions of entries: the broker reads
    headers, never all of them)."""
    deadline = time.monotonic() + MAX_SCAN_S
    for i, member in enumerate(iter(tar.next, None)):
        if member.name in ("config.json", "./config.json") and member.isfile():
            return member
        if i + 1 >= MAX_MEMBERS or time.monotonic() > deadline:
            raise InvalidArgument(f"model archive: no config.json among its first"
                                  f" {i + 1:,} entries (the broker reads at most"
                                  f" {MAX_MEMBERS:,}; put config.json near the start)")
    return None


def estimate(kind: Kind, values: dict, spec: pb.JobSpec,
             blob_path: Callable[[str], Path]) -> JobEstimate:
    """Size a job by its kind's sizing rule; raise InvalidArgument naming the input if its
    config is unusable. A kind without one (or without a config input) is of unknown size."""
    found = kind.config_input(values)
    rule = SIZING.get(kind.sizing)
    ref = {r.name: r for r in spec.inputs}.get(found[0]) if found else None
    if rule is None or ref is None:
        return JobEstimate(0, 0.0, 0)
    name, archive = found
    field = next(p.name for p in kind.params if values.get(p.name) == name)
    try:
        config = _config_from_blob(blob_path(ref.sha256), archive)
        model = model_shape(config)
    except (OSError, ValueError, tarfile.TarError) as exc:
        raise InvalidArgument(f"{kind.name}.{field}: cannot read a model config ({exc})") from exc
    except InvalidArgument as exc:
        raise InvalidArgument(f"{kind.name}.{field}: {exc.message}") from exc
    try:
        kind.check_config(values, config)
    except ParamError as exc:
        raise InvalidArgument(str(exc)) from exc
    return rule(model, values)


def _training(model: ModelShape, values: dict) -> JobEstimate:
    tokens = values["steps"] * values["batch_size"] * values["seq_len"]
    # The runner keeps fp32 weights (with bf16 autocast on CUDA).
    memory = training_bytes(model, "fp32", values["batch_size"], values["seq_len"])
    return JobEstimate(memory, training_flops(model, tokens), model.params)


def _inference(model: ModelShape, values: dict) -> JobEstimate:
    """Weights in 16-bit plus a quarter for activations and the KV cache; the work is not
    known without reading the prompts, so it stays 0 (unknown)."""
    return JobEstimate(int(model.params * 2 * 1.25), 0.0, model.params)


SIZING = {"training": _training, "inference": _inference}


# A model's size: how much memory and work a model needs, from its transformers config —
# the arithmetic the sizing rules above apply (``_training``, ``_inference``).
#
# weights   = parameters x bytes per parameter (dtype or quantization)
# KV cache  = 2 x layers x KV heads x head dim x bytes x context length x sequences (inference)
# training  = weights + gradients + AdamW moments (fp32) [+ fp32 master weights in mixed
#             precision] + activations (Korthikanti et al. 2022: ~34 x s x b x h bytes per layer
#             with 16-bit activations) — plus runtime overhead in both cases.

BYTES_PER_PARAM = {"fp32": 4.0, "tf32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0,
                   "int8": 1.0, "int4": 0.5}
GATED_MLP = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3",
             "olmo", "olmo2", "granite", "cohere", "deepseek_v3", "starcoder2"}
OVERHEAD_BYTES = 512 * 2**20      # CUDA context, allocator slack, workspace
OVERHEAD_FRACTION = 0.05


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's size, from its config (``model_shape``)."""

    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


def _get(cfg: dict, *names: str, default=None):
    for n in names:
        if isinstance(cfg.get(n), int) and not isinstance(cfg.get(n), bool):
            return cfg[n]
    if default is not None:
        return default
    raise InvalidArgument(f"model config: no {names[0]}")


def model_shape(cfg: dict) -> ModelShape:
    """The parameter count and attention shape of a decoder-only transformers config."""
    if not isinstance(cfg, dict):
        raise InvalidArgument("model config: not a JSON object")
    cfg = {**cfg.get("text_config", {}), **cfg} if isinstance(cfg.get("text_config"), dict) else cfg
    h = _get(cfg, "hidden_size", "n_embd", "d_model")
    layers = _get(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _get(cfg, "num_attention_heads", "n_head")
    kv = _get(cfg, "num_key_value_heads", "num_kv_heads", default=heads)
    head_dim = _get(cfg, "head_dim", default=h // heads)
    inter = _get(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * h)
    vocab = _get(cfg, "vocab_size")
    if min(h, layers, heads, kv, head_dim, inter, vocab) <= 0:
        raise InvalidArgument("model config: sizes must be positive")
    gated = cfg.get("model_type") in GATED_MLP
    attn = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h
    mlp = (3 if gated else 2) * h * inter
    experts = cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 1
    per_layer = attn + mlp * int(experts) + 2 * h
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    params = layers * per_layer + embed + h
    return ModelShape(params, layers, h, heads, kv, head_dim, vocab)


def bytes_per_param(dtype: str) -> float:
    try:
        return BYTES_PER_PARAM[dtype]
    except KeyError as exc:
        raise InvalidArgument(f"dtype: {dtype!r} is not one of {sorted(BYTES_PER_PARAM)}") from exc


def weights_bytes(s: ModelShape, dtype: str) -> int:
    return int(s.params * bytes_per_param(dtype))


def kv_cache_bytes(s: ModelShape, context: int, sequences: int, kv_dtype: str = "bf16") -> int:
    return int(2 * s.layers * s.kv_heads * s.head_dim * bytes_per_param(kv_dtype)
               * context * sequences)


def _with_overhead(n: float) -> int:
    return int(n * (1 + OVERHEAD_FRACTION) + OVERHEAD_BYTES)


def inference_bytes(s: ModelShape, dtype: str, context: int, sequences: int) -> int:
    """Weights (dtype or quantization) + a 16-bit KV cache + overhead."""
    kv_dtype = "fp8" if dtype == "fp8" else "bf16"
    return _with_overhead(weights_bytes(s, dtype) + kv_cache_bytes(s, context, sequences, kv_dtype))


def training_bytes(s: ModelShape, dtype: str, batch: int, seq_len: int) -> int:
    """Weights + gradients + AdamW state (+ fp32 master weights when training in 16 bits)
    + activations + overhead, for one device holding the whole model."""
    b = bytes_per_param(dtype)
    per_param = b + b + 8 + (4 if b < 4 else 0)
    act_bytes = 34 * seq_len * batch * s.hidden * s.layers * (b / 2)
    logits = 4 * batch * seq_len * s.vocab
    return _with_overhead(s.params * per_param + act_bytes + logits)


def training_flops(s: ModelShape, tokens: int) -> float:
    """Forward + backward: about 6 FLOPs per parameter per token."""
    return 6.0 * s.params * tokens
