"""The broker's TLS certificate: a self-signed P-256 certificate (gRPC's TLS stack does not
offer Ed25519 certificates) that carries an attestation, the broker's Ed25519 public key and
its signature over the certificate's public key. Whoever reads the certificate can tell which
broker key stands behind it; trust hangs on that key alone (see gpumarket.link.channel for
the side that checks it). Plain crypto, no grpc.
"""

from __future__ import annotations

import base64
import datetime
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gpumarket.proto.errors import BadSignature
from gpumarket.proto.identity import Identity, verify, write_private

TLS_NAME = "gpumarket-broker"           # the certificate's only name; checked via override
# The identity attestation travels as a URI in the certificate's subject alternative names:
# every X.509 parser reads those (a private extension needs an OID, and Go's parser refuses
# the large arcs of a UUID-based one, which kept grpcurl and Envoy from connecting).
ATTESTATION_URI = "urn:gpumarket:attestation:v1:"
ATTESTATION_DOMAIN = b"gpumarket-tls-v1\0"


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
