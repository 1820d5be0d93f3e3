"""TLS and mTLS for every gRPC server and client, and a throw-away PKI for local stacks.

One :class:`TLSFiles` describes a process's certificate (``--tls-cert``/``--tls-key``, used both
to serve and as its client certificate when it dials a peer), the CA it trusts (``--tls-ca``: a
server given a CA requires client certificates) and the name it expects peers to present when it
dials them by IP (``--tls-server-name``, gRPC's ``ssl_target_name_override``). Files are PEM.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.errors import InvalidArgument
from services.fsmode import write_secret


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise InvalidArgument(f"cannot read {what} {path}: {e.strerror}") from e


@dataclass(frozen=True)
class TLSFiles:
    """PEM paths of a TLS identity and trust root. ``cert`` and ``key`` come together; a client
    needs at least ``ca``, a server at least ``cert``+``key``. Raises ``InvalidArgument``."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise InvalidArgument("--tls-cert and --tls-key go together")
        if not (self.cert or self.ca):
            raise InvalidArgument("TLS needs --tls-cert/--tls-key, --tls-ca, or both")

    @property
    def mutual(self) -> bool:
        """A server with a CA requires client certificates signed by it (mTLS)."""
        return bool(self.ca)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials for ``grpc.Server.add_secure_port``; requires client certificates when
        ``ca`` is set. Raises ``InvalidArgument`` without a certificate or for an unreadable file."""
        if not self.cert:
            raise InvalidArgument("a TLS server needs --tls-cert and --tls-key")
        pair = (_read(self.key, "TLS key"), _read(self.cert, "TLS certificate"))
        root = _read(self.ca, "TLS CA") if self.ca else None
        return grpc.ssl_server_credentials([pair], root_certificates=root, require_client_auth=root is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client credentials: verify the server against ``ca`` (the system roots without one) and
        present ``cert``/``key`` when given."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "TLS CA") if self.ca else None,
            private_key=_read(self.key, "TLS key") if self.key else None,
            certificate_chain=_read(self.cert, "TLS certificate") if self.cert else None,
        )

    def channel_options(self) -> tuple[tuple[str, str], ...]:
        """Channel options for dialling a peer whose certificate names ``server_name``."""
        return (("grpc.ssl_target_name_override", self.server_name),) if self.server_name else ()


def tls_from_args(args) -> TLSFiles | None:
    """:class:`TLSFiles` from ``--tls-cert/--tls-key/--tls-ca/--tls-server-name`` (``None`` when
    none of the first three is given)."""
    cert, key, ca = (getattr(args, n, None) for n in ("tls_cert", "tls_key", "tls_ca"))
    if not (cert or key or ca):
        return None
    return TLSFiles(cert=cert, key=key, ca=ca, server_name=getattr(args, "tls_server_name", None))


def add_tls_args(parser, *, server: bool) -> None:
    """Add the TLS flags to an ``argparse`` parser (``server``: a daemon, else a CLI client)."""
    who = "the server's certificate (also its client certificate)" if server else "a client certificate (mTLS)"
    parser.add_argument("--tls-cert", default=None, metavar="PEM", help=f"{who}")
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    parser.add_argument("--tls-ca", default=None, metavar="PEM",
                        help="the CA to trust" + ("; a server given one requires client certificates" if server else ""))
    parser.add_argument("--tls-server-name", default=None, metavar="NAME",
                        help="the name peers' certificates must carry when dialled by IP")


@dataclass(frozen=True)
class DevPKI:
    """Paths of a throw-away PKI made by :func:`make_dev_pki`: the CA, and one certificate usable
    as server and client (``cert``/``key``)."""

    ca: Path
    ca_key: Path
    cert: Path
    key: Path

    def files(self, server_name: str | None = None) -> TLSFiles:
        """These paths as :class:`TLSFiles` (mTLS: the CA is set)."""
        return TLSFiles(cert=str(self.cert), key=str(self.key), ca=str(self.ca), server_name=server_name)

    @classmethod
    def at(cls, directory: str | Path) -> DevPKI:
        """The paths :func:`make_dev_pki` writes under ``directory`` (whether made yet or not)."""
        d = Path(directory)
        return cls(ca=d / "ca.pem", ca_key=d / "ca.key", cert=d / "cert.pem", key=d / "key.pem")

    def server_flags(self) -> list[str]:
        """``--tls-cert/--tls-key/--tls-ca`` for a daemon serving (and dialling) with these files."""
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


def make_dev_pki(directory: str | Path, names: Sequence[str] = ("localhost", "127.0.0.1"), *,
                 days: int = 30, common_name: str = "warmserve dev CA") -> DevPKI:
    """Make an ECDSA P-256 CA and one leaf certificate for ``names`` (DNS names or IP addresses, as
    subjectAltNames; key usage serverAuth + clientAuth) under ``directory``: ``ca.pem``,
    ``ca.key``, ``cert.pem``, ``key.pem``; keys are 0600. Existing files are replaced."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    # ECDSA P-256: what gRPC's BoringSSL accepts everywhere (Ed25519 leaf certificates are not).
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
    leaf = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(ca_name).public_key(leaf_key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    private = dict(encoding=pem, format=serialization.PrivateFormat.PKCS8,
                   encryption_algorithm=serialization.NoEncryption())
    pki = DevPKI.at(d)
    write_secret(pki.ca_key, ca_key.private_bytes(**private))
    write_secret(pki.key, leaf_key.private_bytes(**private))
    write_secret(pki.ca, ca.public_bytes(pem), 0o644)
    write_secret(pki.cert, leaf.public_bytes(pem), 0o644)
    return pki
