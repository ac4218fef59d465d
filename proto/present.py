"""Protocol messages as people read them: JSON-ready values with names for enums."""

from __future__ import annotations

from google.protobuf.json_format import MessageToDict

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
