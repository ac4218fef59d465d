from gpumarket.proto.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProviderHello(_message.Message):
    __slots__ = ("public_key", "software_version", "reconnect_within_ms")
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    RECONNECT_WITHIN_MS_FIELD_NUMBER: _ClassVar[int]
    public_key: bytes
    software_version: str
    reconnect_within_ms: int
    def __init__(self, public_key: _Optional[bytes] = ..., software_version: _Optional[str] = ..., reconnect_within_ms: _Optional[int] = ...) -> None: ...

class SessionChallenge(_message.Message):
    __slots__ = ("nonce", "broker_public_key")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    BROKER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    broker_public_key: bytes
    def __init__(self, nonce: _Optional[bytes] = ..., broker_public_key: _Optional[bytes] = ...) -> None: ...

class SessionProof(_message.Message):
    __slots__ = ("nonce", "broker_public_key", "at_ms")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    BROKER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    broker_public_key: bytes
    at_ms: int
    def __init__(self, nonce: _Optional[bytes] = ..., broker_public_key: _Optional[bytes] = ..., at_ms: _Optional[int] = ...) -> None: ...

class SessionWelcome(_message.Message):
    __slots__ = ("provider_id", "heartbeat_interval_ms", "lease_timeout_ms", "update_receipts")
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    provider_id: str
    heartbeat_interval_ms: int
    lease_timeout_ms: int
    update_receipts: bool
    def __init__(self, provider_id: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ..., lease_timeout_ms: _Optional[int] = ..., update_receipts: _Optional[bool] = ...) -> None: ...

class RunningLease(_message.Message):
    __slots__ = ("job_id", "epoch")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epoch: int
    def __init__(self, job_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("at_ms", "running", "draining")
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    at_ms: int
    running: _containers.RepeatedCompositeFieldContainer[RunningLease]
    draining: bool
    def __init__(self, at_ms: _Optional[int] = ..., running: _Optional[_Iterable[_Union[RunningLease, _Mapping]]] = ..., draining: _Optional[bool] = ...) -> None: ...

class JobStarted(_message.Message):
    __slots__ = ("resumed_from_step",)
    RESUMED_FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    resumed_from_step: int
    def __init__(self, resumed_from_step: _Optional[int] = ...) -> None: ...

class JobFailed(_message.Message):
    __slots__ = ("error", "report")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    error: str
    report: _types_pb2.Envelope
    def __init__(self, error: _Optional[str] = ..., report: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ...) -> None: ...

class FailureReport(_message.Message):
    __slots__ = ("job_id", "epoch", "provider_id", "spec_sha256", "job_ran", "exit_code", "error", "log_tail", "at_ms")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_SHA256_FIELD_NUMBER: _ClassVar[int]
    JOB_RAN_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOG_TAIL_FIELD_NUMBER: _ClassVar[int]
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epoch: int
    provider_id: str
    spec_sha256: str
    job_ran: bool
    exit_code: int
    error: str
    log_tail: _containers.RepeatedScalarFieldContainer[str]
    at_ms: int
    def __init__(self, job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., provider_id: _Optional[str] = ..., spec_sha256: _Optional[str] = ..., job_ran: _Optional[bool] = ..., exit_code: _Optional[int] = ..., error: _Optional[str] = ..., log_tail: _Optional[_Iterable[str]] = ..., at_ms: _Optional[int] = ...) -> None: ...

class JobRejected(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class CheckpointReport(_message.Message):
    __slots__ = ("step", "artifact", "write_seconds")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    WRITE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    artifact: _types_pb2.ArtifactRef
    write_seconds: float
    def __init__(self, step: _Optional[int] = ..., artifact: _Optional[_Union[_types_pb2.ArtifactRef, _Mapping]] = ..., write_seconds: _Optional[float] = ...) -> None: ...

class JobReleased(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class JobLog(_message.Message):
    __slots__ = ("lines",)
    LINES_FIELD_NUMBER: _ClassVar[int]
    lines: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lines: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplicaReady(_message.Message):
    __slots__ = ("engine", "task", "max_concurrency", "max_seq_len")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    engine: str
    task: str
    max_concurrency: int
    max_seq_len: int
    def __init__(self, engine: _Optional[str] = ..., task: _Optional[str] = ..., max_concurrency: _Optional[int] = ..., max_seq_len: _Optional[int] = ...) -> None: ...

class JobUpdate(_message.Message):
    __slots__ = ("job_id", "epoch", "started", "progress", "failed", "receipt", "rejected", "checkpoint", "released", "log", "ready", "tasks")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epoch: int
    started: JobStarted
    progress: _types_pb2.Progress
    failed: JobFailed
    receipt: _types_pb2.Envelope
    rejected: JobRejected
    checkpoint: CheckpointReport
    released: JobReleased
    log: JobLog
    ready: ReplicaReady
    tasks: TaskResults
    def __init__(self, job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., started: _Optional[_Union[JobStarted, _Mapping]] = ..., progress: _Optional[_Union[_types_pb2.Progress, _Mapping]] = ..., failed: _Optional[_Union[JobFailed, _Mapping]] = ..., receipt: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ..., rejected: _Optional[_Union[JobRejected, _Mapping]] = ..., checkpoint: _Optional[_Union[CheckpointReport, _Mapping]] = ..., released: _Optional[_Union[JobReleased, _Mapping]] = ..., log: _Optional[_Union[JobLog, _Mapping]] = ..., ready: _Optional[_Union[ReplicaReady, _Mapping]] = ..., tasks: _Optional[_Union[TaskResults, _Mapping]] = ...) -> None: ...

class TaskResults(_message.Message):
    __slots__ = ("results", "seq", "blobs", "receipt", "yielded")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    YIELDED_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TaskResult]
    seq: int
    blobs: _containers.RepeatedCompositeFieldContainer[TaskOutputBlob]
    receipt: _types_pb2.Envelope
    yielded: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, results: _Optional[_Iterable[_Union[TaskResult, _Mapping]]] = ..., seq: _Optional[int] = ..., blobs: _Optional[_Iterable[_Union[TaskOutputBlob, _Mapping]]] = ..., receipt: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ..., yielded: _Optional[_Iterable[int]] = ...) -> None: ...

class TaskOutputBlob(_message.Message):
    __slots__ = ("sha256", "data")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    data: bytes
    def __init__(self, sha256: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class TaskResult(_message.Message):
    __slots__ = ("task", "ok", "error", "seconds", "receipt", "outputs", "receipt_path")
    TASK_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_PATH_FIELD_NUMBER: _ClassVar[int]
    task: int
    ok: bool
    error: str
    seconds: float
    receipt: _types_pb2.Envelope
    outputs: _containers.RepeatedCompositeFieldContainer[_types_pb2.ArtifactRef]
    receipt_path: bytes
    def __init__(self, task: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., seconds: _Optional[float] = ..., receipt: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ..., outputs: _Optional[_Iterable[_Union[_types_pb2.ArtifactRef, _Mapping]]] = ..., receipt_path: _Optional[bytes] = ...) -> None: ...

class InferenceChunk(_message.Message):
    __slots__ = ("request_id", "data", "last")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    data: bytes
    last: bool
    def __init__(self, request_id: _Optional[str] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class ProviderMessage(_message.Message):
    __slots__ = ("hello", "proof", "offer", "heartbeat", "job_update", "chunk")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    OFFER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    JOB_UPDATE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    hello: ProviderHello
    proof: _types_pb2.Envelope
    offer: _types_pb2.Envelope
    heartbeat: Heartbeat
    job_update: JobUpdate
    chunk: InferenceChunk
    def __init__(self, hello: _Optional[_Union[ProviderHello, _Mapping]] = ..., proof: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ..., offer: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., job_update: _Optional[_Union[JobUpdate, _Mapping]] = ..., chunk: _Optional[_Union[InferenceChunk, _Mapping]] = ...) -> None: ...

class CancelLease(_message.Message):
    __slots__ = ("job_id", "epoch", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epoch: int
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class YieldLease(_message.Message):
    __slots__ = ("job_id", "epoch", "reason", "min_left_s", "split")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MIN_LEFT_S_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epoch: int
    reason: str
    min_left_s: float
    split: bool
    def __init__(self, job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., reason: _Optional[str] = ..., min_left_s: _Optional[float] = ..., split: _Optional[bool] = ...) -> None: ...

class PreemptLease(_message.Message):
    __slots__ = ("job_id", "epoch", "reason", "grace_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epoch: int
    reason: str
    grace_s: int
    def __init__(self, job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., reason: _Optional[str] = ..., grace_s: _Optional[int] = ...) -> None: ...

class UpdateSettled(_message.Message):
    __slots__ = ("job_id", "epoch", "accepted", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epoch: int
    accepted: bool
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class InferenceRequest(_message.Message):
    __slots__ = ("request_id", "job_id", "epoch", "body")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    job_id: str
    epoch: int
    body: bytes
    def __init__(self, request_id: _Optional[str] = ..., job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., body: _Optional[bytes] = ...) -> None: ...

class InferenceCancel(_message.Message):
    __slots__ = ("request_id", "job_id", "epoch")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    job_id: str
    epoch: int
    def __init__(self, request_id: _Optional[str] = ..., job_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class TaskResultsSettled(_message.Message):
    __slots__ = ("job_id", "epoch", "seq", "accepted", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epoch: int
    seq: int
    accepted: bool
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class BrokerMessage(_message.Message):
    __slots__ = ("challenge", "welcome", "lease", "cancel", "settled", "infer", "infer_cancel", "yield_lease", "preempt_lease", "tasks_settled")
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    INFER_FIELD_NUMBER: _ClassVar[int]
    INFER_CANCEL_FIELD_NUMBER: _ClassVar[int]
    YIELD_LEASE_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_LEASE_FIELD_NUMBER: _ClassVar[int]
    TASKS_SETTLED_FIELD_NUMBER: _ClassVar[int]
    challenge: SessionChallenge
    welcome: SessionWelcome
    lease: _types_pb2.Envelope
    cancel: CancelLease
    settled: UpdateSettled
    infer: InferenceRequest
    infer_cancel: InferenceCancel
    yield_lease: YieldLease
    preempt_lease: PreemptLease
    tasks_settled: TaskResultsSettled
    def __init__(self, challenge: _Optional[_Union[SessionChallenge, _Mapping]] = ..., welcome: _Optional[_Union[SessionWelcome, _Mapping]] = ..., lease: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ..., cancel: _Optional[_Union[CancelLease, _Mapping]] = ..., settled: _Optional[_Union[UpdateSettled, _Mapping]] = ..., infer: _Optional[_Union[InferenceRequest, _Mapping]] = ..., infer_cancel: _Optional[_Union[InferenceCancel, _Mapping]] = ..., yield_lease: _Optional[_Union[YieldLease, _Mapping]] = ..., preempt_lease: _Optional[_Union[PreemptLease, _Mapping]] = ..., tasks_settled: _Optional[_Union[TaskResultsSettled, _Mapping]] = ...) -> None: ...
