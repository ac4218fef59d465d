"""Channels to the broker: TLS pinned to the broker's Ed25519 key, keepalives, call tokens.

The broker's TLS certificate is self-signed by a P-256 key (gRPC's TLS stack does not
offer Ed25519 certificates) and carries an attestation: the broker's Ed25519 public key
and its signature over the certificate's public key. A client reads the certificate,
checks the attestation, and compares the key's id with the one it pins (given, or
remembered on first use in a known-brokers file, like SSH's known_hosts); only then does
it open the gRPC channel, trusting exactly that certificate. The name in the address
does not matter: the key does.

Every call then carries a CallToken signed by the caller's key (see types.proto).
``plaintext://HOST:PORT`` skips TLS, and is refused unless HOST is loopback.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import hashlib
import ipaddress
import logging
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gpumarket.proto.envelope import seal
from gpumarket.proto.errors import BadSignature, InvalidArgument, Unavailable
from gpumarket.proto.identity import Identity, fingerprint, verify, write_private
from gpumarket.proto.jobspec import now_ms
from gpumarket.proto.v1 import types_pb2 as pb

log = logging.getLogger(__name__)

PLAINTEXT = "plaintext://"
TLS_NAME = "gpumarket-broker"           # the certificate's only name; checked via override
# The identity attestation travels as a URI in the certificate's subject alternative names:
# every X.509 parser reads those (a private extension needs an OID, and Go's parser refuses
# the large arcs of a UUID-based one, which kept grpcurl and Envoy from connecting).
ATTESTATION_URI = "urn:gpumarket:attestation:v1:"
ATTESTATION_DOMAIN = b"gpumarket-tls-v1\0"
TOKEN_METADATA = "gpumarket-token-bin"
TOKEN_LIFETIME_MS = 60_000
MAX_MESSAGE_BYTES = 4 << 20             # gRPC's default, stated: large data moves in chunks

# Keepalives that agree: the client pings an idle connection every 30 s (and gives up on a
# silent peer after 10 s more); the broker accepts pings down to every 20 s, so it never
# answers "too many pings", and pings its side every 60 s to find dead clients.
CLIENT_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)
SERVER_OPTIONS = (
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 20_000),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)


class Untrusted(BadSignature):
    """The broker at an address is not the one this side trusts."""


# -- the broker's certificate ---------------------------------------------------------------

def _attestation_message(spki_der: bytes) -> bytes:
    return ATTESTATION_DOMAIN + spki_der


def make_certificate(identity: Identity, tls_key: ec.EllipticCurvePrivateKey,
                     days: int = 825) -> bytes:
    """Return a PEM certificate for ``tls_key``, attested by ``identity``."""
    spki = tls_key.public_key().public_bytes(serialization.Encoding.DER,
                                             serialization.PublicFormat.SubjectPublicKeyInfo)
    attestation = identity.public_key + identity.sign(_attestation_message(spki))
    uri = ATTESTATION_URI + base64.urlsafe_b64encode(attestation).decode().rstrip("=")
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, TLS_NAME),
                      x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, identity.id)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(tls_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName(TLS_NAME), x509.UniformResourceIdentifier(uri)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(tls_key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM)


def broker_key_of(cert: x509.Certificate) -> bytes:
    """Return the Ed25519 key that attests ``cert``; raise Untrusted if none does."""
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        names = None
    uris = [u for u in (names.get_values_for_type(x509.UniformResourceIdentifier)
                        if names is not None else []) if u.startswith(ATTESTATION_URI)]
    if not uris:
        raise Untrusted("the broker's certificate carries no gpumarket key attestation")
    text = uris[0][len(ATTESTATION_URI):]
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except ValueError as exc:
        raise Untrusted("the broker's certificate attestation is malformed") from exc
    if len(uris) != 1 or len(raw) != 96:
        raise Untrusted("the broker's certificate attestation is malformed")
    key, signature = raw[:32], raw[32:]
    spki = cert.public_key().public_bytes(serialization.Encoding.DER,
                                          serialization.PublicFormat.SubjectPublicKeyInfo)
    try:
        verify(key, signature, _attestation_message(spki))
    except BadSignature as exc:
        raise Untrusted("the broker's certificate attestation does not verify") from exc
    return key


def tls_material(identity: Identity, directory: Path) -> tuple[bytes, bytes]:
    """The broker's (key PEM, certificate PEM), made on first start and whenever the
    certificate no longer matches the identity or ends within 30 days."""
    key_path, cert_path = directory / "tls.key", directory / "tls.crt"
    if key_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    else:
        key = ec.generate_private_key(ec.SECP256R1())
        write_private(key_path, key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()), overwrite=True)
    cert_pem = cert_path.read_bytes() if cert_path.exists() else b""
    fresh = False
    if cert_pem:
        cert = x509.load_pem_x509_certificate(cert_pem)
        try:
            fresh = (broker_key_of(cert) == identity.public_key
                     and cert.public_key() == key.public_key()
                     and cert.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc)
                     > datetime.timedelta(days=30))
        except Untrusted:
            fresh = False
    if not fresh:
        cert_pem = make_certificate(identity, key)
        tmp = cert_path.with_name(cert_path.name + ".tmp")
        tmp.write_bytes(cert_pem)
        os.replace(tmp, cert_path)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, cert_pem


# -- addresses and trust --------------------------------------------------------------------

def split_address(address: str) -> tuple[str, int, bool]:
    """``[plaintext://]HOST:PORT`` → (host, port, plaintext); plaintext only to loopback."""
    plaintext = address.startswith(PLAINTEXT)
    rest = address[len(PLAINTEXT):] if plaintext else address
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        raise InvalidArgument(f"broker address {address!r}: give HOST:PORT")
    if plaintext and not is_loopback(host):
        raise InvalidArgument(f"broker address {address!r}: plaintext is allowed only to a"
                              " loopback address (127.0.0.1, ::1, localhost)")
    return host, int(port), plaintext


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Trust:
    """Which broker key to accept: ``pin`` (a key id) if given, else the one remembered
    for the address in ``known`` (trusted and written there on first use)."""

    pin: str = ""
    known: Path | None = None


def fetch_certificate(host: str, port: int, timeout_s: float = 10.0) -> x509.Certificate:
    """Read the certificate the server at host:port presents (not yet trusted)."""
    ctx = ssl.create_default_context()
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
