"""Signed envelopes: sign bytes, send bytes, verify the bytes received, then parse.

What is signed is ``DOMAIN + payload_type + NUL + payload``: the payload type is
inside the signature, so a signature over one kind of message can never be
presented as another.
"""

from __future__ import annotations

import hashlib
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from gpumarket.proto.errors import BadSignature
from gpumarket.proto.identity import Identity, fingerprint, verify
from gpumarket.proto.v1 import types_pb2

DOMAIN = b"gpumarket-signed-v1\0"
MAX_PAYLOAD_BYTES = 1 << 20

M = TypeVar("M", bound=Message)


def payload_type(message_cls: type[Message]) -> str:
    return message_cls.DESCRIPTOR.full_name


def _signed_bytes(ptype: str, payload: bytes) -> bytes:
    return DOMAIN + ptype.encode("utf-8") + b"\0" + payload


def seal(identity: Identity, message: Message) -> types_pb2.Envelope:
    """Serialize ``message`` once and sign those bytes; return the envelope."""
    ptype = message.DESCRIPTOR.full_name
    payload = message.SerializeToString(deterministic=True)
    return types_pb2.Envelope(
        payload_type=ptype,
        payload=payload,
        signer_public_key=identity.public_key,
        signature=identity.sign(_signed_bytes(ptype, payload)),
    )


def open_envelope(envelope: types_pb2.Envelope, message_cls: type[M]) -> tuple[M, str]:
    """Verify ``envelope`` and parse its payload as ``message_cls``.

    Returns (message, signer id). Raises BadSignature when the type is not the one
    expected, the signature does not verify over the received bytes, or the payload
    does not parse.
    """
    expected = payload_type(message_cls)
    if envelope.payload_type != expected:
        raise BadSignature(
            f"expected a signed {expected}, got {envelope.payload_type or 'nothing'}"
        )
    if len(envelope.payload) > MAX_PAYLOAD_BYTES:
        raise BadSignature(f"signed {expected} is larger than {MAX_PAYLOAD_BYTES} bytes")
    signer = fingerprint(envelope.signer_public_key)
    try:
        verify(
            envelope.signer_public_key,
            envelope.signature,
            _signed_bytes(envelope.payload_type, envelope.payload),
        )
    except BadSignature as exc:
        raise BadSignature(f"signature on {expected} does not verify (tampered or forged)") from exc
    message = message_cls()
    try:
        message.ParseFromString(envelope.payload)
    except DecodeError as exc:
        raise BadSignature(f"signed {expected} does not parse") from exc
    return message, signer


def payload_sha256(envelope: types_pb2.Envelope) -> str:
    """Return the hex sha256 of the signed payload bytes (names what was signed)."""
    return hashlib.sha256(envelope.payload).hexdigest()
