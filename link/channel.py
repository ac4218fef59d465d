"""Channels to the broker: TLS pinned to the broker's Ed25519 key, keepalives, call tokens.

A client reads the broker's certificate, checks its attestation (gpumarket.proto.tls), and
compares the key's id with the one it pins (given, or remembered on first use in a
known-brokers file, like SSH's known_hosts); only then does it open the gRPC channel,
trusting exactly that certificate. The name in the address does not matter: the key does.

Every call then carries a CallToken signed by the caller's key (see types.proto).
``plaintext://HOST:PORT`` skips TLS, and is refused unless HOST is loopback.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from gpumarket.proto import wire
from gpumarket.proto.envelope import seal
from gpumarket.proto.errors import InvalidArgument, Unavailable
from gpumarket.proto.identity import Identity, fingerprint
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.tls import TLS_NAME, Untrusted, broker_key_of
from gpumarket.proto.v1 import types_pb2 as pb
from gpumarket.proto.wire import TOKEN_LIFETIME_MS, TOKEN_METADATA, split_address

log = logging.getLogger(__name__)

__all__ = ["BrokerChannel", "Trust", "Untrusted", "call_token", "open_channel",
           "split_brokers"]

MAX_BROKERS = 16      # addresses one --broker may list


def split_brokers(addresses: str) -> list[str]:
    """``A[,B...]``: the addresses of the brokers of one market (they share one key), each
    ``[plaintext://]HOST:PORT``, tried in turn where one is unreachable. Raises
    InvalidArgument for an empty list, more than MAX_BROKERS, or a bad address."""
    found = [a.strip() for a in addresses.split(",") if a.strip()]
    if not found:
        raise InvalidArgument("no broker address given (HOST:PORT[,HOST:PORT...])")
    if len(found) > MAX_BROKERS:
        raise InvalidArgument(f"at most {MAX_BROKERS} broker addresses, not {len(found)}")
    for address in found:
        split_address(address)
    return found

# While the broker is unreachable a channel retries its connection on gRPC's own backoff
# (1 s, x1.6 up to 120 s, +-20 %), and a call made between two tries fails at once with the
# last try's error: here, after a 40 s outage, a health check still failed with "Connection
# refused" 4 s and 29.6 s after the broker listened again (two runs). Tries at least every
# 2 s (+-20 %) make a channel usable within about 2.4 s of the broker's return.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)
# The client's gRPC options (keepalives and message sizes that agree with the broker's, and
# the reconnect cap); a module attribute, so a test can make a client that breaks the
# agreement.
CLIENT_OPTIONS = wire.CLIENT_OPTIONS + RECONNECT_OPTIONS


@dataclass(frozen=True)
class Trust:
    """Which broker key to accept: ``pin`` (a key id) if given, else the one remembered
    for the address in ``known`` (trusted and written there on first use)."""

    pin: str = ""
    known: Path | None = None


def fetch_certificate(host: str, port: int, timeout_s: float = 10.0) -> x509.Certificate:
    """Read the certificate the server at host:port presents (not yet trusted)."""
    # The defaults of create_default_context() (protocols, options) without its loading of
    # the system's CA store, which nothing here consults (verification is off: the key is
    # checked after, against its attestation and the pin): 19-27 ms of every command's start.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE     # trust comes from the attestation and the pin
    ctx.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            with ctx.wrap_socket(sock, server_hostname=TLS_NAME) as tls:
                der = tls.getpeercert(binary_form=True)
    except ssl.SSLError as exc:
        raise Unavailable(f"broker at {host}:{port} did not complete a TLS handshake ({exc.reason};"
                          " is it a plaintext broker? then use plaintext://)") from exc
    except OSError as exc:
        raise Unavailable(f"cannot reach the broker at {host}:{port}"
                          f" ({exc.strerror or exc})") from exc
    return x509.load_der_x509_certificate(der)


def check_trust(address: str, key_id: str, trust: Trust) -> None:
    """Raise Untrusted unless ``key_id`` is the broker key ``trust`` accepts for ``address``;
    remember it on first use."""
    if trust.pin:
        if key_id != trust.pin:
            raise Untrusted(f"broker at {address} presents key {key_id}, not the pinned"
                            f" {trust.pin}; refusing to connect")
        return
    if trust.known is None:
        raise Untrusted(f"broker at {address}: no key pinned and no known-brokers file")
    known = read_known(trust.known)
    if address in known:
        if known[address] != key_id:
            raise Untrusted(
                f"broker at {address} presents key {key_id}, but {known[address]} was trusted"
                f" before ({trust.known}); refusing to connect. If its key was changed on purpose,"
                f" remove that line or pin the new key")
        return
    trust.known.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(trust.known, "a") as f:
        f.write(f"{address} {key_id}\n")
    log.warning("trusting broker %s at %s on first use (remembered in %s)", key_id, address,
                trust.known)


def read_known(path: Path) -> dict[str, str]:
    """Known-brokers lines: ``ADDRESS KEY_ID``; ``#`` starts a comment."""
    out: dict[str, str] = {}
    try:
        text = path.read_text()
    except FileNotFoundError:
        return out
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise InvalidArgument(f"{path}:{n}: expected `ADDRESS KEY_ID`")
        out[parts[0]] = parts[1]
    return out


# -- call tokens ----------------------------------------------------------------------------

def call_token(identity: Identity, method: str, audience: str,
               request: bytes | None) -> bytes:
    """A signed CallToken for one call of ``method``, serialized for the metadata."""
    now = now_ms()
    token = pb.CallToken(method=method, issued_at_ms=now, expires_at_ms=now + TOKEN_LIFETIME_MS,
                         nonce=os.urandom(16), audience=audience,
                         request_sha256=hashlib.sha256(request).digest() if request is not None
                         else b"")
    return seal(identity, token).SerializeToString()


class _Tokens:
    def __init__(self, identity: Identity, audience: str) -> None:
        self.identity = identity
        self.audience = audience

    def details(self, d: grpc.aio.ClientCallDetails, request) -> grpc.aio.ClientCallDetails:
        method = d.method.decode() if isinstance(d.method, bytes) else d.method
        body = request.SerializeToString() if request is not None else None
        metadata = grpc.aio.Metadata(*(d.metadata or ()))
        metadata.add(TOKEN_METADATA, call_token(self.identity, method, self.audience, body))
        return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials,
                                          d.wait_for_ready)


class _UnaryUnary(_Tokens, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, d, request):
        return await continuation(self.details(d, request), request)


class _UnaryStream(_Tokens, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, d, request):
        return await continuation(self.details(d, request), request)


class _StreamUnary(_Tokens, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, d, request_iterator):
        return await continuation(self.details(d, None), request_iterator)


class _StreamStream(_Tokens, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, d, request_iterator):
        return await continuation(self.details(d, None), request_iterator)


# -- the channel ----------------------------------------------------------------------------

@dataclass
class BrokerChannel:
    channel: grpc.aio.Channel
    broker_id: str          # the broker's key id ("" on plaintext)
    tls: bool


async def open_channel(address: str, identity: Identity | None, trust: Trust,
                       timeout_s: float = 10.0) -> BrokerChannel:
    """Open a channel to the broker at ``address`` whose calls are signed by ``identity``
    (None: anonymous, for the few calls that allow it)."""
    host, port, plaintext = split_address(address)
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    broker_id, options = "", list(CLIENT_OPTIONS)
    if not plaintext:
        cert = await asyncio.to_thread(fetch_certificate, host, port, timeout_s)
        broker_id = fingerprint(broker_key_of(cert))
        check_trust(address, broker_id, trust)
        options.append(("grpc.ssl_target_name_override", TLS_NAME))
    interceptors = []
    if identity is not None:
        interceptors = [cls(identity, broker_id)
                        for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
    if plaintext:
        channel = grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    else:
        pem = cert.public_bytes(serialization.Encoding.PEM)
        creds = grpc.ssl_channel_credentials(root_certificates=pem)
        channel = grpc.aio.secure_channel(target, creds, options=options,
                                          interceptors=interceptors)
    return BrokerChannel(channel, broker_id, not plaintext)
