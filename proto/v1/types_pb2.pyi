from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_KIND_UNSPECIFIED: _ClassVar[JobKind]
    JOB_KIND_TRAINING: _ClassVar[JobKind]
    JOB_KIND_GENERATE: _ClassVar[JobKind]
    JOB_KIND_EMBED: _ClassVar[JobKind]
    JOB_KIND_RENDER: _ClassVar[JobKind]
    JOB_KIND_ENDPOINT: _ClassVar[JobKind]
    JOB_KIND_SCRIPT: _ClassVar[JobKind]

class Accelerator(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACCELERATOR_UNSPECIFIED: _ClassVar[Accelerator]
    ACCELERATOR_CPU: _ClassVar[Accelerator]
    ACCELERATOR_CUDA: _ClassVar[Accelerator]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_LEASED: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
    JOB_STATE_PAUSED: _ClassVar[JobState]
    JOB_STATE_VERIFYING: _ClassVar[JobState]

class OfferFigures(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OFFER_FIGURES_UNSPECIFIED: _ClassVar[OfferFigures]
    OFFER_FIGURES_CLAIMED: _ClassVar[OfferFigures]
    OFFER_FIGURES_MEASURED: _ClassVar[OfferFigures]
    OFFER_FIGURES_CONTRADICTED: _ClassVar[OfferFigures]

class Objective(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OBJECTIVE_UNSPECIFIED: _ClassVar[Objective]
    OBJECTIVE_CHEAPEST: _ClassVar[Objective]
    OBJECTIVE_FASTEST: _ClassVar[Objective]
    OBJECTIVE_RELIABLE: _ClassVar[Objective]
    OBJECTIVE_DEADLINE: _ClassVar[Objective]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_STANDARD: _ClassVar[Tier]
    TIER_INTERRUPTIBLE: _ClassVar[Tier]
    TIER_SERVING: _ClassVar[Tier]

class LimitMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LIMIT_METHOD_UNSPECIFIED: _ClassVar[LimitMethod]
    LIMIT_METHOD_NONE: _ClassVar[LimitMethod]
    LIMIT_METHOD_CGROUP_V2: _ClassVar[LimitMethod]
    LIMIT_METHOD_CGROUP_V1: _ClassVar[LimitMethod]
    LIMIT_METHOD_RLIMIT: _ClassVar[LimitMethod]
JOB_KIND_UNSPECIFIED: JobKind
JOB_KIND_TRAINING: JobKind
JOB_KIND_GENERATE: JobKind
JOB_KIND_EMBED: JobKind
JOB_KIND_RENDER: JobKind
JOB_KIND_ENDPOINT: JobKind
JOB_KIND_SCRIPT: JobKind
ACCELERATOR_UNSPECIFIED: Accelerator
ACCELERATOR_CPU: Accelerator
ACCELERATOR_CUDA: Accelerator
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_LEASED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
JOB_STATE_PAUSED: JobState
JOB_STATE_VERIFYING: JobState
OFFER_FIGURES_UNSPECIFIED: OfferFigures
OFFER_FIGURES_CLAIMED: OfferFigures
OFFER_FIGURES_MEASURED: OfferFigures
OFFER_FIGURES_CONTRADICTED: OfferFigures
OBJECTIVE_UNSPECIFIED: Objective
OBJECTIVE_CHEAPEST: Objective
OBJECTIVE_FASTEST: Objective
OBJECTIVE_RELIABLE: Objective
OBJECTIVE_DEADLINE: Objective
TIER_UNSPECIFIED: Tier
TIER_STANDARD: Tier
TIER_INTERRUPTIBLE: Tier
TIER_SERVING: Tier
LIMIT_METHOD_UNSPECIFIED: LimitMethod
LIMIT_METHOD_NONE: LimitMethod
LIMIT_METHOD_CGROUP_V2: LimitMethod
LIMIT_METHOD_CGROUP_V1: LimitMethod
LIMIT_METHOD_RLIMIT: LimitMethod

class Envelope(_message.Message):
    __slots__ = ("payload_type", "payload", "signer_public_key", "signature")
    PAYLOAD_TYPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SIGNER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    payload_type: str
    payload: bytes
    signer_public_key: bytes
    signature: bytes
    def __init__(self, payload_type: _Optional[str] = ..., payload: _Optional[bytes] = ..., signer_public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class CallToken(_message.Message):
    __slots__ = ("method", "issued_at_ms", "expires_at_ms", "nonce", "audience", "request_sha256")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    AUDIENCE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    method: str
    issued_at_ms: int
    expires_at_ms: int
    nonce: bytes
    audience: str
    request_sha256: bytes
    def __init__(self, method: _Optional[str] = ..., issued_at_ms: _Optional[int] = ..., expires_at_ms: _Optional[int] = ..., nonce: _Optional[bytes] = ..., audience: _Optional[str] = ..., request_sha256: _Optional[bytes] = ...) -> None: ...

class ArtifactRef(_message.Message):
    __slots__ = ("name", "sha256", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    sha256: str
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class Resources(_message.Message):
    __slots__ = ("gpus", "min_memory_bytes", "accelerator", "min_compute_capability", "gpu_models")
    GPUS_FIELD_NUMBER: _ClassVar[int]
    MIN_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    MIN_COMPUTE_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    GPU_MODELS_FIELD_NUMBER: _ClassVar[int]
    gpus: int
    min_memory_bytes: int
    accelerator: Accelerator
    min_compute_capability: float
    gpu_models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, gpus: _Optional[int] = ..., min_memory_bytes: _Optional[int] = ..., accelerator: _Optional[_Union[Accelerator, str]] = ..., min_compute_capability: _Optional[float] = ..., gpu_models: _Optional[_Iterable[str]] = ...) -> None: ...

class TrainingParams(_message.Message):
    __slots__ = ("model_config", "base_model", "dataset", "steps", "batch_size", "learning_rate", "seed", "seq_len", "checkpoint_every", "warmup_steps")
    MODEL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    model_config: str
    base_model: str
    dataset: str
    steps: int
    batch_size: int
    learning_rate: float
    seed: int
    seq_len: int
    checkpoint_every: int
    warmup_steps: int
    def __init__(self, model_config: _Optional[str] = ..., base_model: _Optional[str] = ..., dataset: _Optional[str] = ..., steps: _Optional[int] = ..., batch_size: _Optional[int] = ..., learning_rate: _Optional[float] = ..., seed: _Optional[int] = ..., seq_len: _Optional[int] = ..., checkpoint_every: _Optional[int] = ..., warmup_steps: _Optional[int] = ...) -> None: ...

class GenerateParams(_message.Message):
    __slots__ = ("model", "model_name", "trust_remote_code", "prompts", "max_tokens", "temperature", "top_p", "seed", "stop", "batch_size", "engine", "dtype", "quantization", "checkpoint_every")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TRUST_REMOTE_CODE_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_name: str
    trust_remote_code: bool
    prompts: str
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    batch_size: int
    engine: str
    dtype: str
    quantization: str
    checkpoint_every: int
    def __init__(self, model: _Optional[str] = ..., model_name: _Optional[str] = ..., trust_remote_code: _Optional[bool] = ..., prompts: _Optional[str] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., batch_size: _Optional[int] = ..., engine: _Optional[str] = ..., dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., checkpoint_every: _Optional[int] = ...) -> None: ...

class EmbedParams(_message.Message):
    __slots__ = ("model", "model_name", "trust_remote_code", "texts", "batch_size", "output_format", "keep_scale", "engine", "dtype", "checkpoint_every")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TRUST_REMOTE_CODE_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    KEEP_SCALE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_name: str
    trust_remote_code: bool
    texts: str
    batch_size: int
    output_format: str
    keep_scale: bool
    engine: str
    dtype: str
    checkpoint_every: int
    def __init__(self, model: _Optional[str] = ..., model_name: _Optional[str] = ..., trust_remote_code: _Optional[bool] = ..., texts: _Optional[str] = ..., batch_size: _Optional[int] = ..., output_format: _Optional[str] = ..., keep_scale: _Optional[bool] = ..., engine: _Optional[str] = ..., dtype: _Optional[str] = ..., checkpoint_every: _Optional[int] = ...) -> None: ...

class RenderParams(_message.Message):
    __slots__ = ("scene", "frame_start", "frame_end", "resolution_x", "resolution_y", "samples", "device", "output_format", "split", "engine", "checkpoint_every")
    SCENE_FIELD_NUMBER: _ClassVar[int]
    FRAME_START_FIELD_NUMBER: _ClassVar[int]
    FRAME_END_FIELD_NUMBER: _ClassVar[int]
    RESOLUTION_X_FIELD_NUMBER: _ClassVar[int]
    RESOLUTION_Y_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    scene: str
    frame_start: int
    frame_end: int
    resolution_x: int
    resolution_y: int
    samples: int
    device: str
    output_format: str
    split: int
    engine: str
    checkpoint_every: int
    def __init__(self, scene: _Optional[str] = ..., frame_start: _Optional[int] = ..., frame_end: _Optional[int] = ..., resolution_x: _Optional[int] = ..., resolution_y: _Optional[int] = ..., samples: _Optional[int] = ..., device: _Optional[str] = ..., output_format: _Optional[str] = ..., split: _Optional[int] = ..., engine: _Optional[str] = ..., checkpoint_every: _Optional[int] = ...) -> None: ...

class KindParams(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("name", "kind", "resources", "max_price_per_gpu_hour", "inputs", "max_runtime_s", "max_attempts", "objective", "deadline_s", "min_reliability", "training", "generate", "embed", "render", "custom", "budget", "min_provider_stake", "verify_rate", "nonce", "created_at_ms", "expires_at_ms", "array", "tier", "preemptible")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    MAX_PRICE_PER_GPU_HOUR_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNTIME_S_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    MIN_RELIABILITY_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    EMBED_FIELD_NUMBER: _ClassVar[int]
    RENDER_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    MIN_PROVIDER_STAKE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_RATE_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    ARRAY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIBLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: JobKind
    resources: Resources
    max_price_per_gpu_hour: float
    inputs: _containers.RepeatedCompositeFieldContainer[ArtifactRef]
    max_runtime_s: int
    max_attempts: int
    objective: Objective
    deadline_s: int
    min_reliability: float
    training: TrainingParams
    generate: GenerateParams
    embed: EmbedParams
    render: RenderParams
    custom: KindParams
    budget: float
    min_provider_stake: float
    verify_rate: float
    nonce: bytes
    created_at_ms: int
    expires_at_ms: int
    array: JobArray
    tier: Tier
    preemptible: bool
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[JobKind, str]] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ..., max_price_per_gpu_hour: _Optional[float] = ..., inputs: _Optional[_Iterable[_Union[ArtifactRef, _Mapping]]] = ..., max_runtime_s: _Optional[int] = ..., max_attempts: _Optional[int] = ..., objective: _Optional[_Union[Objective, str]] = ..., deadline_s: _Optional[int] = ..., min_reliability: _Optional[float] = ..., training: _Optional[_Union[TrainingParams, _Mapping]] = ..., generate: _Optional[_Union[GenerateParams, _Mapping]] = ..., embed: _Optional[_Union[EmbedParams, _Mapping]] = ..., render: _Optional[_Union[RenderParams, _Mapping]] = ..., custom: _Optional[_Union[KindParams, _Mapping]] = ..., budget: _Optional[float] = ..., min_provider_stake: _Optional[float] = ..., verify_rate: _Optional[float] = ..., nonce: _Optional[bytes] = ..., created_at_ms: _Optional[int] = ..., expires_at_ms: _Optional[int] = ..., array: _Optional[_Union[JobArray, _Mapping]] = ..., tier: _Optional[_Union[Tier, str]] = ..., preemptible: _Optional[bool] = ...) -> None: ...

class JobArray(_message.Message):
    __slots__ = ("count", "tasks_input", "per_lease", "only")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TASKS_INPUT_FIELD_NUMBER: _ClassVar[int]
    PER_LEASE_FIELD_NUMBER: _ClassVar[int]
    ONLY_FIELD_NUMBER: _ClassVar[int]
    count: int
    tasks_input: str
    per_lease: int
    only: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, count: _Optional[int] = ..., tasks_input: _Optional[str] = ..., per_lease: _Optional[int] = ..., only: _Optional[_Iterable[int]] = ...) -> None: ...

class Benchmark(_message.Message):
    __slots__ = ("matmul_flops", "matmul_dtype", "memory_bandwidth_bytes_per_s", "measured_at_ms", "matmul_flops_by_dtype", "host_to_device_bytes_per_s", "sm_count", "interconnect")
    class MatmulFlopsByDtypeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MATMUL_FLOPS_FIELD_NUMBER: _ClassVar[int]
    MATMUL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    MEASURED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    MATMUL_FLOPS_BY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    HOST_TO_DEVICE_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    SM_COUNT_FIELD_NUMBER: _ClassVar[int]
    INTERCONNECT_FIELD_NUMBER: _ClassVar[int]
    matmul_flops: float
    matmul_dtype: str
    memory_bandwidth_bytes_per_s: float
    measured_at_ms: int
    matmul_flops_by_dtype: _containers.ScalarMap[str, float]
    host_to_device_bytes_per_s: float
    sm_count: int
    interconnect: str
    def __init__(self, matmul_flops: _Optional[float] = ..., matmul_dtype: _Optional[str] = ..., memory_bandwidth_bytes_per_s: _Optional[float] = ..., measured_at_ms: _Optional[int] = ..., matmul_flops_by_dtype: _Optional[_Mapping[str, float]] = ..., host_to_device_bytes_per_s: _Optional[float] = ..., sm_count: _Optional[int] = ..., interconnect: _Optional[str] = ...) -> None: ...

class Device(_message.Message):
    __slots__ = ("index", "name", "uuid", "accelerator", "memory_bytes", "compute_capability", "driver_version", "cuda_version", "cpu_cores", "benchmark", "price_per_hour", "mig_mode", "slice_of", "memory_share", "compute_share", "compute_held", "mig_parent_uuid")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CUDA_VERSION_FIELD_NUMBER: _ClassVar[int]
    CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    BENCHMARK_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    MIG_MODE_FIELD_NUMBER: _ClassVar[int]
    SLICE_OF_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SHARE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SHARE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_HELD_FIELD_NUMBER: _ClassVar[int]
    MIG_PARENT_UUID_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    uuid: str
    accelerator: Accelerator
    memory_bytes: int
    compute_capability: str
    driver_version: str
    cuda_version: str
    cpu_cores: int
    benchmark: Benchmark
    price_per_hour: float
    mig_mode: str
    slice_of: int
    memory_share: float
    compute_share: float
    compute_held: bool
    mig_parent_uuid: str
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., uuid: _Optional[str] = ..., accelerator: _Optional[_Union[Accelerator, str]] = ..., memory_bytes: _Optional[int] = ..., compute_capability: _Optional[str] = ..., driver_version: _Optional[str] = ..., cuda_version: _Optional[str] = ..., cpu_cores: _Optional[int] = ..., benchmark: _Optional[_Union[Benchmark, _Mapping]] = ..., price_per_hour: _Optional[float] = ..., mig_mode: _Optional[str] = ..., slice_of: _Optional[int] = ..., memory_share: _Optional[float] = ..., compute_share: _Optional[float] = ..., compute_held: _Optional[bool] = ..., mig_parent_uuid: _Optional[str] = ...) -> None: ...

class AvailabilityWindow(_message.Message):
    __slots__ = ("days", "start_minute", "end_minute")
    DAYS_FIELD_NUMBER: _ClassVar[int]
    START_MINUTE_FIELD_NUMBER: _ClassVar[int]
    END_MINUTE_FIELD_NUMBER: _ClassVar[int]
    days: _containers.RepeatedScalarFieldContainer[int]
    start_minute: int
    end_minute: int
    def __init__(self, days: _Optional[_Iterable[int]] = ..., start_minute: _Optional[int] = ..., end_minute: _Optional[int] = ...) -> None: ...

class Policy(_message.Message):
    __slots__ = ("allowed_clients", "denied_clients", "max_job_seconds", "windows", "allow_remote_code")
    ALLOWED_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    DENIED_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    MAX_JOB_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_REMOTE_CODE_FIELD_NUMBER: _ClassVar[int]
    allowed_clients: _containers.RepeatedScalarFieldContainer[str]
    denied_clients: _containers.RepeatedScalarFieldContainer[str]
    max_job_seconds: int
    windows: _containers.RepeatedCompositeFieldContainer[AvailabilityWindow]
    allow_remote_code: bool
    def __init__(self, allowed_clients: _Optional[_Iterable[str]] = ..., denied_clients: _Optional[_Iterable[str]] = ..., max_job_seconds: _Optional[int] = ..., windows: _Optional[_Iterable[_Union[AvailabilityWindow, _Mapping]]] = ..., allow_remote_code: _Optional[bool] = ...) -> None: ...

class Offer(_message.Message):
    __slots__ = ("provider_id", "devices", "price_per_gpu_hour", "kinds", "software_version", "created_at_ms", "policy", "engines", "models", "cached", "job_limits", "interruptible_price_per_gpu_hour")
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_GPU_HOUR_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    JOB_LIMITS_FIELD_NUMBER: _ClassVar[int]
    INTERRUPTIBLE_PRICE_PER_GPU_HOUR_FIELD_NUMBER: _ClassVar[int]
    provider_id: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    price_per_gpu_hour: float
    kinds: _containers.RepeatedScalarFieldContainer[JobKind]
    software_version: str
    created_at_ms: int
    policy: Policy
    engines: _containers.RepeatedScalarFieldContainer[str]
    models: _containers.RepeatedScalarFieldContainer[str]
    cached: _containers.RepeatedScalarFieldContainer[str]
    job_limits: JobLimits
    interruptible_price_per_gpu_hour: float
    def __init__(self, provider_id: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., price_per_gpu_hour: _Optional[float] = ..., kinds: _Optional[_Iterable[_Union[JobKind, str]]] = ..., software_version: _Optional[str] = ..., created_at_ms: _Optional[int] = ..., policy: _Optional[_Union[Policy, _Mapping]] = ..., engines: _Optional[_Iterable[str]] = ..., models: _Optional[_Iterable[str]] = ..., cached: _Optional[_Iterable[str]] = ..., job_limits: _Optional[_Union[JobLimits, _Mapping]] = ..., interruptible_price_per_gpu_hour: _Optional[float] = ...) -> None: ...

class JobLimits(_message.Message):
    __slots__ = ("memory", "pids", "cpu")
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    memory: LimitMethod
    pids: LimitMethod
    cpu: LimitMethod
    def __init__(self, memory: _Optional[_Union[LimitMethod, str]] = ..., pids: _Optional[_Union[LimitMethod, str]] = ..., cpu: _Optional[_Union[LimitMethod, str]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "job_id", "attempt", "epoch", "provider_id", "client_id", "price_per_gpu_hour", "checkpoint_every", "resume_from", "device_indices", "issued_at_ms", "expires_at_ms", "job_spec", "provider_mtbf_s", "checkpoint_interval_s", "part", "parts", "check", "tasks")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_GPU_HOUR_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    JOB_SPEC_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_MTBF_S_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    CHECK_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    job_id: str
    attempt: int
    epoch: int
    provider_id: str
    client_id: str
    price_per_gpu_hour: float
    checkpoint_every: int
    resume_from: ArtifactRef
    device_indices: _containers.RepeatedScalarFieldContainer[int]
    issued_at_ms: int
    expires_at_ms: int
    job_spec: Envelope
    provider_mtbf_s: float
    checkpoint_interval_s: float
    part: int
    parts: int
    check: CheckScope
    tasks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[str] = ..., job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., epoch: _Optional[int] = ..., provider_id: _Optional[str] = ..., client_id: _Optional[str] = ..., price_per_gpu_hour: _Optional[float] = ..., checkpoint_every: _Optional[int] = ..., resume_from: _Optional[_Union[ArtifactRef, _Mapping]] = ..., device_indices: _Optional[_Iterable[int]] = ..., issued_at_ms: _Optional[int] = ..., expires_at_ms: _Optional[int] = ..., job_spec: _Optional[_Union[Envelope, _Mapping]] = ..., provider_mtbf_s: _Optional[float] = ..., checkpoint_interval_s: _Optional[float] = ..., part: _Optional[int] = ..., parts: _Optional[int] = ..., check: _Optional[_Union[CheckScope, _Mapping]] = ..., tasks: _Optional[_Iterable[int]] = ...) -> None: ...

class CheckScope(_message.Message):
    __slots__ = ("step_from", "step_to", "frames", "position", "batch_size", "claimed")
    STEP_FROM_FIELD_NUMBER: _ClassVar[int]
    STEP_TO_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_FIELD_NUMBER: _ClassVar[int]
    step_from: int
    step_to: int
    frames: _containers.RepeatedScalarFieldContainer[int]
    position: float
    batch_size: int
    claimed: ArtifactRef
    def __init__(self, step_from: _Optional[int] = ..., step_to: _Optional[int] = ..., frames: _Optional[_Iterable[int]] = ..., position: _Optional[float] = ..., batch_size: _Optional[int] = ..., claimed: _Optional[_Union[ArtifactRef, _Mapping]] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("step", "total", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    step: int
    total: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., total: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Receipt(_message.Message):
    __slots__ = ("job_id", "lease_id", "attempt", "epoch", "provider_id", "spec_sha256", "outputs", "wall_seconds", "device_seconds", "metrics", "finished_at_ms", "tasks_root")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_SHA256_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    TASKS_ROOT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    lease_id: str
    attempt: int
    epoch: int
    provider_id: str
    spec_sha256: str
    outputs: _containers.RepeatedCompositeFieldContainer[ArtifactRef]
    wall_seconds: float
    device_seconds: float
    metrics: _containers.ScalarMap[str, float]
    finished_at_ms: int
    tasks_root: bytes
    def __init__(self, job_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., attempt: _Optional[int] = ..., epoch: _Optional[int] = ..., provider_id: _Optional[str] = ..., spec_sha256: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[ArtifactRef, _Mapping]]] = ..., wall_seconds: _Optional[float] = ..., device_seconds: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., finished_at_ms: _Optional[int] = ..., tasks_root: _Optional[bytes] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("seq", "job_id", "at_ms", "type", "state", "attempt", "provider_id", "message", "progress")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    job_id: str
    at_ms: int
    type: str
    state: JobState
    attempt: int
    provider_id: str
    message: str
    progress: Progress
    def __init__(self, seq: _Optional[int] = ..., job_id: _Optional[str] = ..., at_ms: _Optional[int] = ..., type: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., attempt: _Optional[int] = ..., provider_id: _Optional[str] = ..., message: _Optional[str] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ...) -> None: ...

class Attempt(_message.Message):
    __slots__ = ("attempt", "epoch", "provider_id", "started_at_ms", "ended_at_ms", "outcome", "reason")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    epoch: int
    provider_id: str
    started_at_ms: int
    ended_at_ms: int
    outcome: str
    reason: str
    def __init__(self, attempt: _Optional[int] = ..., epoch: _Optional[int] = ..., provider_id: _Optional[str] = ..., started_at_ms: _Optional[int] = ..., ended_at_ms: _Optional[int] = ..., outcome: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "name", "kind", "state", "client_id", "attempt", "provider_id", "progress", "error", "created_at_ms", "updated_at_ms", "spec", "receipt", "attempts", "queue_reason", "checkpoint_step", "parts", "billing", "verification", "array")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_REASON_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    BILLING_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    ARRAY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    kind: JobKind
    state: JobState
    client_id: str
    attempt: int
    provider_id: str
    progress: Progress
    error: str
    created_at_ms: int
    updated_at_ms: int
    spec: Envelope
    receipt: Envelope
    attempts: _containers.RepeatedCompositeFieldContainer[Attempt]
    queue_reason: str
    checkpoint_step: int
    parts: _containers.RepeatedCompositeFieldContainer[JobPart]
    billing: JobBilling
    verification: JobVerification
    array: ArrayProgress
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., kind: _Optional[_Union[JobKind, str]] = ..., state: _Optional[_Union[JobState, str]] = ..., client_id: _Optional[str] = ..., attempt: _Optional[int] = ..., provider_id: _Optional[str] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., error: _Optional[str] = ..., created_at_ms: _Optional[int] = ..., updated_at_ms: _Optional[int] = ..., spec: _Optional[_Union[Envelope, _Mapping]] = ..., receipt: _Optional[_Union[Envelope, _Mapping]] = ..., attempts: _Optional[_Iterable[_Union[Attempt, _Mapping]]] = ..., queue_reason: _Optional[str] = ..., checkpoint_step: _Optional[int] = ..., parts: _Optional[_Iterable[_Union[JobPart, _Mapping]]] = ..., billing: _Optional[_Union[JobBilling, _Mapping]] = ..., verification: _Optional[_Union[JobVerification, _Mapping]] = ..., array: _Optional[_Union[ArrayProgress, _Mapping]] = ...) -> None: ...

class ArrayProgress(_message.Message):
    __slots__ = ("tasks", "queued", "running", "succeeded", "failed", "cancelled")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    tasks: int
    queued: int
    running: int
    succeeded: int
    failed: int
    cancelled: int
    def __init__(self, tasks: _Optional[int] = ..., queued: _Optional[int] = ..., running: _Optional[int] = ..., succeeded: _Optional[int] = ..., failed: _Optional[int] = ..., cancelled: _Optional[int] = ...) -> None: ...

class ArrayTask(_message.Message):
    __slots__ = ("task", "state", "attempts", "provider_id", "error", "outputs", "lease_job_id", "seconds", "updated_at_ms", "receipt", "receipt_path")
    TASK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_PATH_FIELD_NUMBER: _ClassVar[int]
    task: int
    state: JobState
    attempts: int
    provider_id: str
    error: str
    outputs: _containers.RepeatedCompositeFieldContainer[ArtifactRef]
    lease_job_id: str
    seconds: float
    updated_at_ms: int
    receipt: Envelope
    receipt_path: bytes
    def __init__(self, task: _Optional[int] = ..., state: _Optional[_Union[JobState, str]] = ..., attempts: _Optional[int] = ..., provider_id: _Optional[str] = ..., error: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[ArtifactRef, _Mapping]]] = ..., lease_job_id: _Optional[str] = ..., seconds: _Optional[float] = ..., updated_at_ms: _Optional[int] = ..., receipt: _Optional[_Union[Envelope, _Mapping]] = ..., receipt_path: _Optional[bytes] = ...) -> None: ...

class JobVerification(_message.Message):
    __slots__ = ("status", "rate", "checks")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RATE_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    status: str
    rate: float
    checks: _containers.RepeatedCompositeFieldContainer[Check]
    def __init__(self, status: _Optional[str] = ..., rate: _Optional[float] = ..., checks: _Optional[_Iterable[_Union[Check, _Mapping]]] = ...) -> None: ...

class Check(_message.Message):
    __slots__ = ("check_id", "job_id", "provider_id", "checker_id", "what", "state", "detail", "created_at_ms", "ended_at_ms")
    CHECK_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKER_ID_FIELD_NUMBER: _ClassVar[int]
    WHAT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    check_id: str
    job_id: str
    provider_id: str
    checker_id: str
    what: str
    state: str
    detail: str
    created_at_ms: int
    ended_at_ms: int
    def __init__(self, check_id: _Optional[str] = ..., job_id: _Optional[str] = ..., provider_id: _Optional[str] = ..., checker_id: _Optional[str] = ..., what: _Optional[str] = ..., state: _Optional[str] = ..., detail: _Optional[str] = ..., created_at_ms: _Optional[int] = ..., ended_at_ms: _Optional[int] = ...) -> None: ...

class JobBilling(_message.Message):
    __slots__ = ("hold", "charged", "remaining", "disputed", "basis")
    HOLD_FIELD_NUMBER: _ClassVar[int]
    CHARGED_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    DISPUTED_FIELD_NUMBER: _ClassVar[int]
    BASIS_FIELD_NUMBER: _ClassVar[int]
    hold: int
    charged: int
    remaining: int
    disputed: int
    basis: str
    def __init__(self, hold: _Optional[int] = ..., charged: _Optional[int] = ..., remaining: _Optional[int] = ..., disputed: _Optional[int] = ..., basis: _Optional[str] = ...) -> None: ...

class LedgerLine(_message.Message):
    __slots__ = ("seq", "at_ms", "type", "account", "amount", "job_id", "provider_id", "step_from", "step_to", "seconds", "memo")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FROM_FIELD_NUMBER: _ClassVar[int]
    STEP_TO_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMO_FIELD_NUMBER: _ClassVar[int]
    seq: int
    at_ms: int
    type: str
    account: str
    amount: int
    job_id: str
    provider_id: str
    step_from: int
    step_to: int
    seconds: float
    memo: str
    def __init__(self, seq: _Optional[int] = ..., at_ms: _Optional[int] = ..., type: _Optional[str] = ..., account: _Optional[str] = ..., amount: _Optional[int] = ..., job_id: _Optional[str] = ..., provider_id: _Optional[str] = ..., step_from: _Optional[int] = ..., step_to: _Optional[int] = ..., seconds: _Optional[float] = ..., memo: _Optional[str] = ...) -> None: ...

class JobPart(_message.Message):
    __slots__ = ("part", "job_id", "state", "attempt", "provider_id", "progress", "error", "receipt")
    PART_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    part: int
    job_id: str
    state: JobState
    attempt: int
    provider_id: str
    progress: Progress
    error: str
    receipt: Envelope
    def __init__(self, part: _Optional[int] = ..., job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., attempt: _Optional[int] = ..., provider_id: _Optional[str] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., error: _Optional[str] = ..., receipt: _Optional[_Union[Envelope, _Mapping]] = ...) -> None: ...

class ProviderStanding(_message.Message):
    __slots__ = ("provider_id", "online", "banned", "devices", "price_per_gpu_hour", "reliability", "leases_completed", "leases_lost", "running", "earned", "last_seen_ms", "first_seen_ms", "stake", "check_rate", "checks_passed", "checks_failed", "interruptible_price_per_gpu_hour")
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    ONLINE_FIELD_NUMBER: _ClassVar[int]
    BANNED_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_GPU_HOUR_FIELD_NUMBER: _ClassVar[int]
    RELIABILITY_FIELD_NUMBER: _ClassVar[int]
    LEASES_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    LEASES_LOST_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    EARNED_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEEN_MS_FIELD_NUMBER: _ClassVar[int]
    STAKE_FIELD_NUMBER: _ClassVar[int]
    CHECK_RATE_FIELD_NUMBER: _ClassVar[int]
    CHECKS_PASSED_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FAILED_FIELD_NUMBER: _ClassVar[int]
    INTERRUPTIBLE_PRICE_PER_GPU_HOUR_FIELD_NUMBER: _ClassVar[int]
    provider_id: str
    online: bool
    banned: bool
    devices: _containers.RepeatedScalarFieldContainer[str]
    price_per_gpu_hour: float
    reliability: float
    leases_completed: int
    leases_lost: int
    running: int
    earned: float
    last_seen_ms: int
    first_seen_ms: int
    stake: int
    check_rate: float
    checks_passed: int
    checks_failed: int
    interruptible_price_per_gpu_hour: float
    def __init__(self, provider_id: _Optional[str] = ..., online: _Optional[bool] = ..., banned: _Optional[bool] = ..., devices: _Optional[_Iterable[str]] = ..., price_per_gpu_hour: _Optional[float] = ..., reliability: _Optional[float] = ..., leases_completed: _Optional[int] = ..., leases_lost: _Optional[int] = ..., running: _Optional[int] = ..., earned: _Optional[float] = ..., last_seen_ms: _Optional[int] = ..., first_seen_ms: _Optional[int] = ..., stake: _Optional[int] = ..., check_rate: _Optional[float] = ..., checks_passed: _Optional[int] = ..., checks_failed: _Optional[int] = ..., interruptible_price_per_gpu_hour: _Optional[float] = ...) -> None: ...

class LogLine(_message.Message):
    __slots__ = ("seq", "at_ms", "attempt", "text")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    at_ms: int
    attempt: int
    text: str
    def __init__(self, seq: _Optional[int] = ..., at_ms: _Optional[int] = ..., attempt: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...
