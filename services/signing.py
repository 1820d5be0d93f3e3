"""Ed25519 signatures over the artifacts a fleet shares (compiled programs, sidecar manifests).

Each publisher holds its own private key (``warmserve keys new``); verifiers hold a trust list
of public keys (:class:`TrustedKeys`). A key is named by its *key id*: the first 16 hex digits
of the sha256 of its 32 raw public-key bytes. What is signed is a canonical payload: a domain
tag line then sorted-key compact JSON (:func:`program_payload`, :func:`canonical_payload`), so
a signature for one kind of artifact can never be replayed as another.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from services.errors import InvalidArgument, Untrusted
from services.fsmode import write_secret

#: Domain tags: the first line of every signed payload.
PROGRAM_DOMAIN = "warmserve-program-v1"
SIDECAR_DOMAIN = "warmserve-sidecar-v1"
#: Environment variables naming a process's signing key and its trust list (files, never keys).
ENV_SIGNING_KEY = "WARMSERVE_SIGNING_KEY"
ENV_TRUSTED_KEYS = "WARMSERVE_TRUSTED_KEYS"
_SIGNATURE_BYTES = 64


def key_id(public: Ed25519PublicKey) -> str:
    """First 16 hex digits of sha256(raw 32-byte public key)."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def canonical_payload(domain: str, fields: Mapping[str, object]) -> bytes:
    """``domain + "\\n" + json(fields, sorted keys, no spaces)`` as UTF-8: the bytes a signature covers."""
    return (domain + "\n" + json.dumps(dict(fields), sort_keys=True, separators=(",", ":"),
                                       ensure_ascii=True)).encode()


def program_payload(name: str, fingerprint: str, sha256: str, size_bytes: int, format: str,  # noqa: A002
                    producer: str) -> bytes:
    """The payload a compiled program's signature covers (every field a kernel-cache entry states)."""
    return canonical_payload(PROGRAM_DOMAIN, {"name": name, "fingerprint": fingerprint, "sha256": sha256,
                                              "size_bytes": int(size_bytes), "format": format,
                                              "producer": producer})


@dataclass(frozen=True)
class Signature:
    """A detached Ed25519 signature (64 bytes) and the id of the key that made it."""

    key_id: str
    signature: bytes

    def to_text(self) -> str:
        """``<key_id>:<base64 signature>``: how stores and metadata keep it."""
        return f"{self.key_id}:{base64.b64encode(self.signature).decode()}"

    @classmethod
    def from_text(cls, text: str) -> Signature:
        """Parse :meth:`to_text`'s form. Raises ``Untrusted`` when malformed."""
        kid, sep, b64 = text.strip().partition(":")
        try:
            sig = base64.b64decode(b64, validate=True)
        except ValueError:
            sig = b""
        if not sep or len(kid) != 16 or len(sig) != _SIGNATURE_BYTES:
            raise Untrusted("the signature is malformed (expected KEYID:BASE64 of 64 bytes)")
        return cls(kid, sig)


class SigningKey:
    """A publisher's Ed25519 private key. :meth:`load` reads a PKCS8 PEM file."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.key_id = key_id(private.public_key())

    @classmethod
    def generate(cls) -> SigningKey:
        """A fresh random key."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: str | Path) -> SigningKey:
        """Read an unencrypted PKCS8 PEM Ed25519 key. Raises ``InvalidArgument`` otherwise."""
        try:
            key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        except OSError as e:
            raise InvalidArgument(f"cannot read signing key {path}: {e.strerror}") from e
        except (ValueError, TypeError) as e:
            raise InvalidArgument(f"signing key {path} is not an unencrypted PEM private key") from e
        if not isinstance(key, Ed25519PrivateKey):
            raise InvalidArgument(f"signing key {path} is not an Ed25519 key")
        return cls(key)

    def sign(self, payload: bytes) -> Signature:
        """Sign ``payload`` (bytes)."""
        return Signature(self.key_id, self._private.sign(payload))

    def public_key(self) -> Ed25519PublicKey:
        """The public half (e.g. ``TrustedKeys([key.public_key()])``: a trust list of this key alone)."""
        return self._private.public_key()

    def public_pem(self) -> bytes:
        """The public key as SubjectPublicKeyInfo PEM."""
        return self._private.public_key().public_bytes(serialization.Encoding.PEM,
                                                       serialization.PublicFormat.SubjectPublicKeyInfo)

    def write(self, directory: str | Path, name: str) -> tuple[Path, Path]:
        """Write ``<dir>/<name>.key`` (PKCS8 PEM, 0600) and ``<dir>/<name>.pub``; returns both paths.
        Raises ``InvalidArgument`` when the key file exists (keys are never overwritten)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        key_path, pub_path = d / f"{name}.key", d / f"{name}.pub"
        pem = self._private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption())
        try:
            write_secret(key_path, pem, exclusive=True)
        except FileExistsError:
            raise InvalidArgument(f"{key_path} exists; a signing key is never overwritten") from None
        write_secret(pub_path, self.public_pem(), 0o644)
        return key_path, pub_path


#: Successful verifications a :class:`TrustedKeys` remembers (by digest of payload + signature).
_VERIFIED_MEMO = 4096


class TrustedKeys:
    """The public keys a verifier accepts, by key id. :meth:`load` reads a ``.pub`` PEM file or
    every ``*.pub`` in a directory. A successful :meth:`verify` is remembered by the sha256 of
    (payload, key id, signature), so checking the same entry again (lookup then fetch, every
    warm launch's HIT) skips the Ed25519 arithmetic; a failure is never remembered."""

    def __init__(self, keys: Iterable[Ed25519PublicKey]) -> None:
        self._keys = {key_id(k): k for k in keys}
        if not self._keys:
            raise InvalidArgument("the trust list holds no public key")
        self._verified: set[bytes] = set()
        self._memo_lock = threading.Lock()

    @classmethod
    def load(cls, path: str | Path) -> TrustedKeys:
        """Read one PEM public key file, or every ``*.pub`` file of a directory. Raises
        ``InvalidArgument`` for an unreadable path, a non-Ed25519 key or an empty list."""
        p = Path(path)
        files = sorted(p.glob("*.pub")) if p.is_dir() else [p]
        keys = []
        for f in files:
            try:
                key = serialization.load_pem_public_key(f.read_bytes())
            except OSError as e:
                raise InvalidArgument(f"cannot read trusted key {f}: {e.strerror}") from e
            except ValueError as e:
                raise InvalidArgument(f"trusted key {f} is not a PEM public key") from e
            if not isinstance(key, Ed25519PublicKey):
                raise InvalidArgument(f"trusted key {f} is not an Ed25519 key")
            keys.append(key)
        if not keys:
            raise InvalidArgument(f"no *.pub public key in {p}")
        return cls(keys)

    @property
    def key_ids(self) -> list[str]:
        """Ids of the trusted keys, sorted."""
        return sorted(self._keys)

    def verify(self, payload: bytes, signature: Signature | str | None, what: str) -> str:
        """Check ``signature`` over ``payload``; returns the signer's key id. Raises ``Untrusted``
        (naming ``what``) when it is missing, malformed, by a key not in the list, or wrong."""
        if not signature:
            raise Untrusted(f"{what} is not signed")
        try:
            sig = signature if isinstance(signature, Signature) else Signature.from_text(signature)
        except Untrusted as e:
            raise Untrusted(f"{what}: {e}") from None
        key = self._keys.get(sig.key_id)
        if key is None:
            raise Untrusted(f"{what} is signed by key {sig.key_id}, which is not trusted")
        memo = hashlib.sha256(payload + b"\0" + sig.key_id.encode() + b"\0" + sig.signature).digest()
        with self._memo_lock:
            if memo in self._verified:
                return sig.key_id
        try:
            key.verify(sig.signature, payload)
        except InvalidSignature:
            raise Untrusted(f"{what}: the signature by key {sig.key_id} does not match") from None
        with self._memo_lock:
            if len(self._verified) >= _VERIFIED_MEMO:
                self._verified.clear()
            self._verified.add(memo)
        return sig.key_id


def signing_key_from(path: str | Path | None, env: Mapping[str, str] | None = None) -> SigningKey | None:
    """The signing key at ``path``, else at ``$WARMSERVE_SIGNING_KEY``, else ``None``."""
    path = path or (os.environ if env is None else env).get(ENV_SIGNING_KEY)
    return SigningKey.load(path) if path else None


def trusted_keys_from(path: str | Path | None, env: Mapping[str, str] | None = None) -> TrustedKeys | None:
    """The trust list at ``path``, else at ``$WARMSERVE_TRUSTED_KEYS``, else ``None`` (not verifying)."""
    path = path or (os.environ if env is None else env).get(ENV_TRUSTED_KEYS)
    return TrustedKeys.load(path) if path else None


def add_signing_args(parser, *, sign: bool = True, verify: bool = True) -> None:
    """Add ``--signing-key`` and/or ``--trusted-keys`` to an ``argparse`` parser."""
    if sign:
        parser.add_argument("--signing-key", default=None, metavar="F",
                            help=f"Ed25519 key (PEM) this process signs what it publishes with (else ${ENV_SIGNING_KEY})")
    if verify:
        parser.add_argument("--trusted-keys", default=None, metavar="PATH",
                            help=f"public key (.pub) or directory of them whose signatures are trusted "
                                 f"(else ${ENV_TRUSTED_KEYS}; none: artifacts are not verified)")
