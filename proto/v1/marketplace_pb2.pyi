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
    __slots__ = ("offer", "online", "free_devices")
    OFFER_FIELD_NUMBER: _ClassVar[int]
    ONLINE_FIELD_NUMBER: _ClassVar[int]
    FREE_DEVICES_FIELD_NUMBER: _ClassVar[int]
    offer: _types_pb2.Envelope
    online: bool
    free_devices: int
    def __init__(self, offer: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ..., online: _Optional[bool] = ..., free_devices: _Optional[int] = ...) -> None: ...

class SearchOffersResponse(_message.Message):
    __slots__ = ("offers",)
    OFFERS_FIELD_NUMBER: _ClassVar[int]
    offers: _containers.RepeatedCompositeFieldContainer[OfferListing]
    def __init__(self, offers: _Optional[_Iterable[_Union[OfferListing, _Mapping]]] = ...) -> None: ...
