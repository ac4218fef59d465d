"""Protocol messages as people read them: JSON-ready values with names for enums."""

from __future__ import annotations

from google.protobuf.json_format import MessageToDict

from gpumarket.proto.errors import InvalidArgument
from gpumarket.proto.jobspec import kind_name, state_name
from gpumarket.proto.v1 import types_pb2 as pb


def job_dict(job: pb.Job) -> dict:
    """A job as JSON-ready values: names for enums, without the signed spec and receipt."""
    d = MessageToDict(job, preserving_proto_field_name=True)
    d.pop("spec", None)
    d.pop("receipt", None)
    d["state"] = state_name(job.state)
    d["kind"] = kind_name(job.kind)
    for part, message in zip(d.get("parts", []), job.parts):
        part.pop("receipt", None)
        part["state"] = state_name(message.state)
    return d


SHORT_ID = 8     # characters of an id shown in tables (--json carries the whole id)


def short(key: str) -> str:
    """The start of an id, as tables show it; any unique prefix is accepted back."""
    return key[:SHORT_ID]


def unique_prefix(prefix: str, ids: list[str], what: str) -> str:
    """The one id of ``ids`` that starts with ``prefix`` (as git and docker take ids);
    ``prefix`` itself if none does (the broker then says it is unknown). Raises
    InvalidArgument if several do."""
    found = sorted({i for i in ids if i.startswith(prefix)})
    if len(found) > 1:
        raise InvalidArgument(f"{what} {prefix!r} is ambiguous: it starts"
                              f" {', '.join(found[:5])}{'…' if len(found) > 5 else ''}")
    return found[0] if found else prefix
