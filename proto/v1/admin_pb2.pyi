from gpumarket.proto.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdminOrder(_message.Message):
    __slots__ = ("method", "target", "reason", "at_ms", "limit", "states", "amount", "nonce", "account")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    method: str
    target: str
    reason: str
    at_ms: int
    limit: int
    states: _containers.RepeatedScalarFieldContainer[_types_pb2.JobState]
    amount: int
    nonce: bytes
    account: str
    def __init__(self, method: _Optional[str] = ..., target: _Optional[str] = ..., reason: _Optional[str] = ..., at_ms: _Optional[int] = ..., limit: _Optional[int] = ..., states: _Optional[_Iterable[_Union[_types_pb2.JobState, str]]] = ..., amount: _Optional[int] = ..., nonce: _Optional[bytes] = ..., account: _Optional[str] = ...) -> None: ...

class AdminRequest(_message.Message):
    __slots__ = ("order",)
    ORDER_FIELD_NUMBER: _ClassVar[int]
    order: _types_pb2.Envelope
    def __init__(self, order: _Optional[_Union[_types_pb2.Envelope, _Mapping]] = ...) -> None: ...

class ListProvidersResponse(_message.Message):
    __slots__ = ("providers",)
    PROVIDERS_FIELD_NUMBER: _ClassVar[int]
    providers: _containers.RepeatedCompositeFieldContainer[_types_pb2.ProviderStanding]
    def __init__(self, providers: _Optional[_Iterable[_Union[_types_pb2.ProviderStanding, _Mapping]]] = ...) -> None: ...

class ListAllJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[_types_pb2.Job, _Mapping]]] = ...) -> None: ...

class BanResponse(_message.Message):
    __slots__ = ("provider_id", "banned", "leases_lost")
    PROVIDER_ID_FIELD_NUMBER: _ClassVar[int]
    BANNED_FIELD_NUMBER: _ClassVar[int]
    LEASES_LOST_FIELD_NUMBER: _ClassVar[int]
    provider_id: str
    banned: bool
    leases_lost: int
    def __init__(self, provider_id: _Optional[str] = ..., banned: _Optional[bool] = ..., leases_lost: _Optional[int] = ...) -> None: ...

class BackupChunk(_message.Message):
    __slots__ = ("data", "total_bytes", "sha256")
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    total_bytes: int
    sha256: str
    def __init__(self, data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class VacuumResponse(_message.Message):
    __slots__ = ("bytes_before", "bytes_after")
    BYTES_BEFORE_FIELD_NUMBER: _ClassVar[int]
    BYTES_AFTER_FIELD_NUMBER: _ClassVar[int]
    bytes_before: int
    bytes_after: int
    def __init__(self, bytes_before: _Optional[int] = ..., bytes_after: _Optional[int] = ...) -> None: ...

class RevokeResponse(_message.Message):
    __slots__ = ("key_id", "revoked", "leases_lost")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    LEASES_LOST_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    revoked: bool
    leases_lost: int
    def __init__(self, key_id: _Optional[str] = ..., revoked: _Optional[bool] = ..., leases_lost: _Optional[int] = ...) -> None: ...

class CreditResponse(_message.Message):
    __slots__ = ("account", "balance", "seq", "duplicate")
    ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    BALANCE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    account: str
    balance: int
    seq: int
    duplicate: bool
    def __init__(self, account: _Optional[str] = ..., balance: _Optional[int] = ..., seq: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class AuditResponse(_message.Message):
    __slots__ = ("ok", "problems", "postings", "totals")
    class TotalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    OK_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    POSTINGS_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    problems: _containers.RepeatedScalarFieldContainer[str]
    postings: int
    totals: _containers.ScalarMap[str, int]
    def __init__(self, ok: _Optional[bool] = ..., problems: _Optional[_Iterable[str]] = ..., postings: _Optional[int] = ..., totals: _Optional[_Mapping[str, int]] = ...) -> None: ...
