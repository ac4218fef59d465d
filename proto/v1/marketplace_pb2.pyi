from gpumarket.proto.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: _types_pb2.Envelope
    def __init__(self, spec: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ...) -> None: ...

class SubmitJobResponse(_message.Message):
    __slots__ = ("job_id", "state")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: _types_pb2.JobState
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[_types_pb2.JobState, str]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: _types_pb2.Job
    def __init__(self, job: _Optional[_Union[_types_pb2.Job, _Mapping]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("client_id", "states", "limit")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    states: _containers.RepeatedScalarFieldContainer[_types_pb2.JobState]
    limit: int
    def __init__(self, client_id: _Optional[str] = ..., states: _Optional[_Iterable[_Union[_types_pb2.JobState, str]]] = ..., limit: _Optional[int] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[_types_pb2.Job, _Mapping]]] = ...) -> None: ...

class ListTasksRequest(_message.Message):
    __slots__ = ("job_id", "from_task", "limit", "states")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_TASK_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    from_task: int
    limit: int
    states: _containers.RepeatedScalarFieldContainer[_types_pb2.JobState]
    def __init__(self, job_id: _Optional[str] = ..., from_task: _Optional[int] = ..., limit: _Optional[int] = ..., states: _Optional[_Iterable[_Union[_types_pb2.JobState, str]]] = ...) -> None: ...

class ListTasksResponse(_message.Message):
    __slots__ = ("tasks", "progress", "next_task")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TASK_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[_types_pb2.ArrayTask]
    progress: _types_pb2.ArrayProgress
    next_task: int
    def __init__(self, tasks: _Optional[_Iterable[_Union[_types_pb2.ArrayTask, _Mapping]]] = ..., progress: _Optional[_Union[_types_pb2.ArrayProgress, _Mapping]] = ..., next_task: _Optional[int] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id", "after_seq")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after_seq: int
    def __init__(self, job_id: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class WatchJobResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: _types_pb2.JobEvent
    def __init__(self, event: _Optional[_Union[_types_pb2.JobEvent, _Mapping]] = ...) -> None: ...

class CancelOrder(_message.Message):
    __slots__ = ("job_id", "at_ms")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    at_ms: int
    def __init__(self, job_id: _Optional[str] = ..., at_ms: _Optional[int] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("order",)
    ORDER_FIELD_NUMBER: _ClassVar[int]
    order: _types_pb2.Envelope
    def __init__(self, order: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: _types_pb2.JobState
    def __init__(self, state: _Optional[_Union[_types_pb2.JobState, str]] = ...) -> None: ...

class SearchOffersRequest(_message.Message):
    __slots__ = ("kind", "min_gpus", "min_memory_bytes", "accelerator", "max_price_per_gpu_hour", "limit")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MIN_GPUS_FIELD_NUMBER: _ClassVar[int]
    MIN_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    MAX_PRICE_PER_GPU_HOUR_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    kind: _types_pb2.JobKind
    min_gpus: int
    min_memory_bytes: int
    accelerator: _types_pb2.Accelerator
    max_price_per_gpu_hour: float
    limit: int
    def __init__(self, kind: _Optional[_Union[_types_pb2.JobKind, str]] = ..., min_gpus: _Optional[int] = ..., min_memory_bytes: _Optional[int] = ..., accelerator: _Optional[_Union[_types_pb2.Accelerator, str]] = ..., max_price_per_gpu_hour: _Optional[float] = ..., limit: _Optional[int] = ...) -> None: ...

class OfferListing(_message.Message):
    __slots__ = ("offer", "online", "free_devices", "reliability", "mtbf_s", "leases_completed", "leases_lost", "achieved_flops", "uptime_7d", "figures", "figures_detail", "check_rate", "checks_passed", "standard_price_per_gpu_hour", "interruptible_price_per_gpu_hour")
    OFFER_FIELD_NUMBER: _ClassVar[int]
    ONLINE_FIELD_NUMBER: _ClassVar[int]
    FREE_DEVICES_FIELD_NUMBER: _ClassVar[int]
    RELIABILITY_FIELD_NUMBER: _ClassVar[int]
    MTBF_S_FIELD_NUMBER: _ClassVar[int]
    LEASES_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    LEASES_LOST_FIELD_NUMBER: _ClassVar[int]
    ACHIEVED_FLOPS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_7D_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    FIGURES_DETAIL_FIELD_NUMBER: _ClassVar[int]
    CHECK_RATE_FIELD_NUMBER: _ClassVar[int]
    CHECKS_PASSED_FIELD_NUMBER: _ClassVar[int]
    STANDARD_PRICE_PER_GPU_HOUR_FIELD_NUMBER: _ClassVar[int]
    INTERRUPTIBLE_PRICE_PER_GPU_HOUR_FIELD_NUMBER: _ClassVar[int]
    offer: _types_pb2.Envelope
    online: bool
    free_devices: int
    reliability: float
    mtbf_s: float
    leases_completed: int
    leases_lost: int
    achieved_flops: float
    uptime_7d: float
    figures: _types_pb2.OfferFigures
    figures_detail: str
    check_rate: float
    checks_passed: int
    standard_price_per_gpu_hour: float
    interruptible_price_per_gpu_hour: float
    def __init__(self, offer: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ..., online: _Optional[bool] = ..., free_devices: _Optional[int] = ..., reliability: _Optional[float] = ..., mtbf_s: _Optional[float] = ..., leases_completed: _Optional[int] = ..., leases_lost: _Optional[int] = ..., achieved_flops: _Optional[float] = ..., uptime_7d: _Optional[float] = ..., figures: _Optional[_Union[_types_pb2.OfferFigures, str]] = ..., figures_detail: _Optional[str] = ..., check_rate: _Optional[float] = ..., checks_passed: _Optional[int] = ..., standard_price_per_gpu_hour: _Optional[float] = ..., interruptible_price_per_gpu_hour: _Optional[float] = ...) -> None: ...

class SearchOffersResponse(_message.Message):
    __slots__ = ("offers",)
    OFFERS_FIELD_NUMBER: _ClassVar[int]
    offers: _containers.RepeatedCompositeFieldContainer[OfferListing]
    def __init__(self, offers: _Optional[_Iterable[_Union[OfferListing, _Mapping]]] = ...) -> None: ...

class QuoteRequest(_message.Message):
    __slots__ = ("spec", "limit", "client_id")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    spec: _types_pb2.JobSpec
    limit: int
    client_id: str
    def __init__(self, spec: _Optional[_Union[_types_pb2.JobSpec, _Mapping]] = ..., limit: _Optional[int] = ..., client_id: _Optional[str] = ...) -> None: ...

class QuoteCandidate(_message.Message):
    __slots__ = ("provider_id", "gpu_name", "price_per_gpu_hour", "runtime_s", "expected_s", "expected_cost", "p_uninterrupted", "reliability", "free_devices", "estimated_s", "estimate_basis", "standard_price_per_gpu_hour", "interruptible_price_per_gpu_hour")
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_NAME_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_GPU_HOUR_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_S_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_S_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_COST_FIELD_NUMBER: _ClassVar[int]
    P_UNINTERRUPTED_FIELD_NUMBER: _ClassVar[int]
    RELIABILITY_FIELD_NUMBER: _ClassVar[int]
    FREE_DEVICES_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_S_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_BASIS_FIELD_NUMBER: _ClassVar[int]
    STANDARD_PRICE_PER_GPU_HOUR_FIELD_NUMBER: _ClassVar[int]
    INTERRUPTIBLE_PRICE_PER_GPU_HOUR_FIELD_NUMBER: _ClassVar[int]
    provider_id: str
    gpu_name: str
    price_per_gpu_hour: float
    runtime_s: float
    expected_s: float
    expected_cost: float
    p_uninterrupted: float
    reliability: float
    free_devices: int
    estimated_s: float
    estimate_basis: str
    standard_price_per_gpu_hour: float
    interruptible_price_per_gpu_hour: float
    def __init__(self, provider_id: _Optional[str] = ..., gpu_name: _Optional[str] = ..., price_per_gpu_hour: _Optional[float] = ..., runtime_s: _Optional[float] = ..., expected_s: _Optional[float] = ..., expected_cost: _Optional[float] = ..., p_uninterrupted: _Optional[float] = ..., reliability: _Optional[float] = ..., free_devices: _Optional[int] = ..., estimated_s: _Optional[float] = ..., estimate_basis: _Optional[str] = ..., standard_price_per_gpu_hour: _Optional[float] = ..., interruptible_price_per_gpu_hour: _Optional[float] = ...) -> None: ...

class QuoteResponse(_message.Message):
    __slots__ = ("candidates", "excluded", "estimated_memory_bytes", "work_flops", "offers", "explanation", "hold", "hold_basis")
    class ExcludedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORK_FLOPS_FIELD_NUMBER: _ClassVar[int]
    OFFERS_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    HOLD_BASIS_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[QuoteCandidate]
    excluded: _containers.ScalarMap[str, int]
    estimated_memory_bytes: int
    work_flops: float
    offers: int
    explanation: str
    hold: int
    hold_basis: str
    def __init__(self, candidates: _Optional[_Iterable[_Union[QuoteCandidate, _Mapping]]] = ..., excluded: _Optional[_Mapping[str, int]] = ..., estimated_memory_bytes: _Optional[int] = ..., work_flops: _Optional[float] = ..., offers: _Optional[int] = ..., explanation: _Optional[str] = ..., hold: _Optional[int] = ..., hold_basis: _Optional[str] = ...) -> None: ...

class StreamLogsRequest(_message.Message):
    __slots__ = ("job_id", "after_seq", "follow")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after_seq: int
    follow: bool
    def __init__(self, job_id: _Optional[str] = ..., after_seq: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class StreamLogsResponse(_message.Message):
    __slots__ = ("lines",)
    LINES_FIELD_NUMBER: _ClassVar[int]
    lines: _containers.RepeatedCompositeFieldContainer[_types_pb2.LogLine]
    def __init__(self, lines: _Optional[_Iterable[_Union[_types_pb2.LogLine, _Mapping]]] = ...) -> None: ...

class GetProviderRequest(_message.Message):
    __slots__ = ("provider_id",)
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    provider_id: str
    def __init__(self, provider_id: _Optional[str] = ...) -> None: ...

class GetProviderResponse(_message.Message):
    __slots__ = ("provider", "broker_time_ms")
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    BROKER_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    provider: _types_pb2.ProviderStanding
    broker_time_ms: int
    def __init__(self, provider: _Optional[_Union[_types_pb2.ProviderStanding, _Mapping]] = ..., broker_time_ms: _Optional[int] = ...) -> None: ...

class GetAccountRequest(_message.Message):
    __slots__ = ("job_id", "limit", "before_seq")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    BEFORE_SEQ_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    limit: int
    before_seq: int
    def __init__(self, job_id: _Optional[str] = ..., limit: _Optional[int] = ..., before_seq: _Optional[int] = ...) -> None: ...

class GetAccountResponse(_message.Message):
    __slots__ = ("key_id", "available", "held", "credited", "spent", "earned", "stake", "lines", "billing")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    CREDITED_FIELD_NUMBER: _ClassVar[int]
    SPENT_FIELD_NUMBER: _ClassVar[int]
    EARNED_FIELD_NUMBER: _ClassVar[int]
    STAKE_FIELD_NUMBER: _ClassVar[int]
    LINES_FIELD_NUMBER: _ClassVar[int]
    BILLING_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    available: int
    held: int
    credited: int
    spent: int
    earned: int
    stake: int
    lines: _containers.RepeatedCompositeFieldContainer[_types_pb2.LedgerLine]
    billing: bool
    def __init__(self, key_id: _Optional[str] = ..., available: _Optional[int] = ..., held: _Optional[int] = ..., credited: _Optional[int] = ..., spent: _Optional[int] = ..., earned: _Optional[int] = ..., stake: _Optional[int] = ..., lines: _Optional[_Iterable[_Union[_types_pb2.LedgerLine, _Mapping]]] = ..., billing: _Optional[bool] = ...) -> None: ...

class TopUpRequest(_message.Message):
    __slots__ = ("job_id", "amount", "nonce")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    amount: int
    nonce: bytes
    def __init__(self, job_id: _Optional[str] = ..., amount: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class TopUpResponse(_message.Message):
    __slots__ = ("state", "billing")
    STATE_FIELD_NUMBER: _ClassVar[int]
    BILLING_FIELD_NUMBER: _ClassVar[int]
    state: _types_pb2.JobState
    billing: _types_pb2.JobBilling
    def __init__(self, state: _Optional[_Union[_types_pb2.JobState, str]] = ..., billing: _Optional[_Union[_types_pb2.JobBilling, _Mapping]] = ...) -> None: ...

class EndpointReplica(_message.Message):
    __slots__ = ("job_id", "state", "provider_id", "ready", "draining", "in_flight", "max_concurrency", "tpot_ms", "requests", "engine")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: _types_pb2.JobState
    provider_id: str
    ready: bool
    draining: bool
    in_flight: int
    max_concurrency: int
    tpot_ms: float
    requests: int
    engine: str
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[_types_pb2.JobState, str]] = ..., provider_id: _Optional[str] = ..., ready: _Optional[bool] = ..., draining: _Optional[bool] = ..., in_flight: _Optional[int] = ..., max_concurrency: _Optional[int] = ..., tpot_ms: _Optional[float] = ..., requests: _Optional[int] = ..., engine: _Optional[str] = ...) -> None: ...

class EndpointLoad(_message.Message):
    __slots__ = ("in_flight", "queued", "requests", "errors", "prompt_tokens", "output_tokens", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_P99_MS_FIELD_NUMBER: _ClassVar[int]
    in_flight: int
    queued: int
    requests: int
    errors: int
    prompt_tokens: int
    output_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    def __init__(self, in_flight: _Optional[int] = ..., queued: _Optional[int] = ..., requests: _Optional[int] = ..., errors: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., ttft_p50_ms: _Optional[float] = ..., ttft_p99_ms: _Optional[float] = ..., tpot_p50_ms: _Optional[float] = ..., tpot_p99_ms: _Optional[float] = ...) -> None: ...

class EndpointKey(_message.Message):
    __slots__ = ("key_id", "created_at_ms", "revoked_at_ms")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    created_at_ms: int
    revoked_at_ms: int
    def __init__(self, key_id: _Optional[str] = ..., created_at_ms: _Optional[int] = ..., revoked_at_ms: _Optional[int] = ...) -> None: ...

class Endpoint(_message.Message):
    __slots__ = ("job_id", "name", "state", "task", "min_replicas", "max_replicas", "target", "replicas", "load", "events", "keys", "api_base", "error", "created_at_ms")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    API_BASE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    state: _types_pb2.JobState
    task: str
    min_replicas: int
    max_replicas: int
    target: int
    replicas: _containers.RepeatedCompositeFieldContainer[EndpointReplica]
    load: EndpointLoad
    events: _containers.RepeatedCompositeFieldContainer[_types_pb2.JobEvent]
    keys: _containers.RepeatedCompositeFieldContainer[EndpointKey]
    api_base: str
    error: str
    created_at_ms: int
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[_types_pb2.JobState, str]] = ..., task: _Optional[str] = ..., min_replicas: _Optional[int] = ..., max_replicas: _Optional[int] = ..., target: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[EndpointReplica, _Mapping]]] = ..., load: _Optional[_Union[EndpointLoad, _Mapping]] = ..., events: _Optional[_Iterable[_Union[_types_pb2.JobEvent, _Mapping]]] = ..., keys: _Optional[_Iterable[_Union[EndpointKey, _Mapping]]] = ..., api_base: _Optional[str] = ..., error: _Optional[str] = ..., created_at_ms: _Optional[int] = ...) -> None: ...

class ListEndpointsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEndpointsResponse(_message.Message):
    __slots__ = ("endpoints",)
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedCompositeFieldContainer[Endpoint]
    def __init__(self, endpoints: _Optional[_Iterable[_Union[Endpoint, _Mapping]]] = ...) -> None: ...

class GetEndpointRequest(_message.Message):
    __slots__ = ("endpoint", "events")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    events: int
    def __init__(self, endpoint: _Optional[str] = ..., events: _Optional[int] = ...) -> None: ...

class GetEndpointResponse(_message.Message):
    __slots__ = ("endpoint",)
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    endpoint: Endpoint
    def __init__(self, endpoint: _Optional[_Union[Endpoint, _Mapping]] = ...) -> None: ...

class EndpointKeyRequest(_message.Message):
    __slots__ = ("endpoint", "key_id")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    key_id: str
    def __init__(self, endpoint: _Optional[str] = ..., key_id: _Optional[str] = ...) -> None: ...

class EndpointKeyResponse(_message.Message):
    __slots__ = ("key", "secret")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    key: EndpointKey
    secret: str
    def __init__(self, key: _Optional[_Union[EndpointKey, _Mapping]] = ..., secret: _Optional[str] = ...) -> None: ...
