"""Ed25519 identities: every party's key, its id, and where keys live on disk."""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from gpumarket.proto.errors import BadSignature, InvalidArgument

PUBLIC_KEY_BYTES = 32


def fingerprint(public_key: bytes) -> str:
    """Return the id of a raw Ed25519 public key: 26 base32 characters of its sha256."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise BadSignature(f"public key must be {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    digest = hashlib.sha256(b"gpumarket-id-v1\0" + public_key).digest()
    return base64.b32encode(digest).decode("ascii").lower()[:26]


def verify(public_key: bytes, signature: bytes, message: bytes) -> None:
    """Check an Ed25519 signature; raise BadSignature if it does not verify."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError) as exc:
        raise BadSignature("signature does not verify") from exc


@dataclass(frozen=True)
class Identity:
    """A private key and what follows from it."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> "Identity":
        return cls(Ed25519PrivateKey.generate())

    @property
    def public_key(self) -> bytes:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def id(self) -> str:
        return fingerprint(self.public_key)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)

    def save(self, path: Path) -> None:
        """Write the key as PEM with mode 0600, atomically; refuse to overwrite."""
        pem = self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_private(path, pem)

    @classmethod
    def load(cls, path: Path) -> "Identity":
        """Read a key written by save(); raise InvalidArgument naming the file if unusable."""
        try:
            data = path.read_bytes()
        except FileNotFoundError as exc:
            raise InvalidArgument(f"{path}: no key here (create one first)") from exc
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise InvalidArgument(
                f"{path}: key file is readable by others (mode {mode:o}); run chmod 600 {path}"
            )
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except ValueError as exc:
            raise InvalidArgument(f"{path}: not a PEM private key") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise InvalidArgument(f"{path}: not an Ed25519 key")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: Path) -> "Identity":
        """Return the key at ``path``, creating it on first use."""
        if not path.exists():
            try:
                cls.generate().save(path)
            except FileExistsError:
                pass
        return cls.load(path)


def write_private(path: Path, data: bytes, overwrite: bool = False) -> None:
    """Write a secret file with mode 0600, atomically. Without ``overwrite`` an existing file
    is kept (FileExistsError): link() fails if the target exists, so two processes never
    race to two keys."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    finally:
        os.unlink(tmp)


def home_dir(environ: dict[str, str] | None = None) -> Path:
    """Return the client's config dir: $GPUMARKET_HOME or ~/.config/gpumarket."""
    env = os.environ if environ is None else environ
    if env.get("GPUMARKET_HOME"):
        return Path(env["GPUMARKET_HOME"]).expanduser()
    return Path("~/.config/gpumarket").expanduser()
