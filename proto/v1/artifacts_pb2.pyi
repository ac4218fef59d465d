from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatArtifactRequest(_message.Message):
    __slots__ = ("sha256", "size_bytes")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    size_bytes: int
    def __init__(self, sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class StatArtifactResponse(_message.Message):
    __slots__ = ("complete", "size_bytes", "received_bytes")
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    complete: bool
    size_bytes: int
    received_bytes: int
    def __init__(self, complete: _Optional[bool] = ..., size_bytes: _Optional[int] = ..., received_bytes: _Optional[int] = ...) -> None: ...

class UploadHeader(_message.Message):
    __slots__ = ("sha256", "size_bytes", "offset")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    size_bytes: int
    offset: int
    def __init__(self, sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class UploadRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: UploadHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[UploadHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class UploadResponse(_message.Message):
    __slots__ = ("sha256", "size_bytes", "already_present")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    size_bytes: int
    already_present: bool
    def __init__(self, sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., already_present: _Optional[bool] = ...) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("sha256", "offset")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    offset: int
    def __init__(self, sha256: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class DownloadResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class Blob(_message.Message):
    __slots__ = ("sha256", "data")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    data: bytes
    def __init__(self, sha256: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class Blobs(_message.Message):
    __slots__ = ("blobs",)
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    blobs: _containers.RepeatedCompositeFieldContainer[Blob]
    def __init__(self, blobs: _Optional[_Iterable[_Union[Blob, _Mapping]]] = ...) -> None: ...

class UploadBlobsResponse(_message.Message):
    __slots__ = ("blobs",)
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    blobs: _containers.RepeatedCompositeFieldContainer[UploadResponse]
    def __init__(self, blobs: _Optional[_Iterable[_Union[UploadResponse, _Mapping]]] = ...) -> None: ...

class DownloadBlobsRequest(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sha256: _Optional[_Iterable[str]] = ...) -> None: ...
