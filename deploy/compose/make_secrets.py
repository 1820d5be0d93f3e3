"""The credentials compose.yaml and the k8s manifests require (``make compose-secrets``).

Writes, under ``OUT`` (default ``deploy/compose/secrets/``, git-ignored and outside the image's
build context), for a fleet laid out as ``--fleet compose`` (two runners with fixed ids) or
``--fleet k8s`` (one runner identity for the Deployment's pods):

- ``tokens/NAME.token``: each identity's own bearer token (``wst_`` + 43 urlsafe characters), the
  file a process names with ``--token-file``; ``admin`` and ``client`` are for people (Drain,
  Evict; ``warmserve generate`` from the host);
- ``auth/SERVER.auth``: each server's ``--auth-file``, one ``NAME SCOPES sha256:HEX`` line per
  identity it admits (hashes only: a server never holds a token);
- ``api-key``: the OpenAI door's API key (its ``--api-key-file``; clients send ``Authorization:
  Bearer``);
- ``tls/ca.pem`` (+ ``ca.key``, which nothing mounts) and ``tls/NAME.pem`` / ``tls/NAME.key`` for
  every server and for ``client``: a throw-away CA and leaf certificates whose names are what
  peers dial (the service name, ``localhost``, ``127.0.0.1``; a k8s runner's is ``runner``, which
  the router asks for with ``--tls-server-name`` since it dials runners by pod IP);
- ``signing/NAME.key`` (Ed25519, PKCS8) for each publisher (every runner, the weight service) and
  ``trusted/NAME.pub`` for every one of them: per-publisher keys and a trust list, not one fleet key.

An existing ``OUT`` that holds every file is kept (a rerun rotates nothing; ``--force`` remakes
all). Files are 0600 and owned by the containers' user (10001) when run as root, else 0644 in
0700 directories (a compose secret is a bind mount the container's user must be able to read; the
directory keeps other users of this host out). ``--k8s-manifests`` prints the Secrets the k8s
manifests mount, for ``kubectl apply -f -``.

    python deploy/compose/make_secrets.py [--out DIR] [--fleet compose|k8s] [--force] [--k8s-manifests]
"""

from __future__ import annotations

import argparse
import base64
import datetime
import ipaddress
import os
import sys
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import NameOID

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the project's own modules (run with the project's .venv python)

from services.auth import Credential, new_token, token_digest  # noqa: E402

DEFAULT_OUT = REPO / "deploy" / "compose" / "secrets"
#: The containers' user (the Dockerfile's USER).
CONTAINER_UID = 10001
NAMESPACE = "warmserve"
CERT_DAYS = 365


def fleet(kind: str) -> dict:
    """Who is who: ``runners`` (identities), each server's admitted identities and scopes
    (services/scopes.py), the certificates (name -> DNS names) and the publishers."""
    runners = ["runner-0", "runner-1"] if kind == "compose" else ["runner"]
    people = {"admin": None, "client": None}
    auth = {
        "kernel-cache": {**{r: "read,publish" for r in runners}, "admin": "read,publish,admin"},
        "weights": {**{r: "read,prepare" for r in runners}, "admin": "read,prepare"},
        "router": {**{r: "register,read" for r in runners}, "openai": "generate,read", "client": "generate,read",
                   "admin": "read,admin"},
        "runner": {"router": "generate,read", "admin": "read"},
    }
    certs = {name: [name] for name in ("kernel-cache", "weights", "router", "openai", *runners)}
    if kind == "k8s":
        for name in certs:
            if name != "runner":  # runners are dialled by pod IP, the name asked for is `runner`
                certs[name] += [f"{name}.{NAMESPACE}", f"{name}.{NAMESPACE}.svc"]
    certs["client"] = ["client"]
    return {"kind": kind, "runners": runners, "identities": [*runners, "router", "openai", *people],
            "auth": auth, "certs": certs, "publishers": [*runners, "weights"]}


# --- tokens (services/auth.py), certificates, signing keys (services/signing.py's format) ---------


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert(subject: str, sans: list[str], key, issuer_name, issuer_key, *, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    names = [x509.DNSName(n) for n in sans] + ([x509.DNSName("localhost"), x509.IPAddress(
        ipaddress.ip_address("127.0.0.1"))] if not ca else [])
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False).add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
                                   x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def dev_pki(certs: dict[str, list[str]]) -> dict[str, bytes]:
    """A throw-away CA and a leaf certificate per name (server and client auth, ECDSA P-256 as
    services.tls.make_dev_pki, which makes a single leaf): relative path -> PEM bytes."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "warmserve dev CA")])
    ca = _cert("warmserve dev CA", [], ca_key, ca_name, ca_key, ca=True)
    files = {"tls/ca.pem": ca.public_bytes(serialization.Encoding.PEM), "tls/ca.key": _pem_key(ca_key)}
    for name, sans in certs.items():
        key = ec.generate_private_key(ec.SECP256R1())
        files[f"tls/{name}.pem"] = _cert(name, sans, key, ca_name, ca_key, ca=False).public_bytes(
            serialization.Encoding.PEM)
        files[f"tls/{name}.key"] = _pem_key(key)
    return files


def signing_keys(publishers: list[str]) -> dict[str, bytes]:
    files = {}
    for name in publishers:
        key = ed25519.Ed25519PrivateKey.generate()
        files[f"signing/{name}.key"] = _pem_key(key)
        files[f"trusted/{name}.pub"] = key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return files


# --- the files ----------------------------------------------------------------------------------


def expected_files(layout: dict) -> list[str]:
    names = [f"tokens/{i}.token" for i in layout["identities"]] + [f"auth/{s}.auth" for s in layout["auth"]]
    names += ["api-key", "tls/ca.pem", "tls/ca.key"]
    names += [f"tls/{n}.{ext}" for n in layout["certs"] for ext in ("pem", "key")]
    names += [f"signing/{p}.key" for p in layout["publishers"]] + [f"trusted/{p}.pub" for p in layout["publishers"]]
    return sorted(names)


def make_files(layout: dict) -> dict[str, bytes]:
    tokens = {i: new_token() for i in layout["identities"]}
    files = {f"tokens/{i}.token": (t + "\n").encode() for i, t in tokens.items()}
    for server, admitted in layout["auth"].items():
        lines = [f"# {server}: NAME SCOPE[,SCOPE...] sha256:HEX (deploy/compose/make_secrets.py)"]
        lines += [Credential(name, frozenset(scopes.split(",")), token_digest(tokens[name])).line()
                  for name, scopes in admitted.items()]
        files[f"auth/{server}.auth"] = ("\n".join(lines) + "\n").encode()
    files["api-key"] = (new_token() + "\n").encode()
    files.update(dev_pki(layout["certs"]))
    files.update(signing_keys(layout["publishers"]))
    return files


def _write(out: Path, files: dict[str, bytes]) -> None:
    as_root = os.geteuid() == 0
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    for rel, data in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700 if path.parent == out or not as_root else 0o750)
        if path.is_dir():  # docker-compose 1.29 makes a directory for a missing secret file
            path.rmdir()
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        if as_root:  # the containers' user reads it (but nothing mounts the CA's key)
            if rel != "tls/ca.key":
                os.chown(tmp, CONTAINER_UID, CONTAINER_UID)
            os.chmod(tmp, 0o644 if rel.endswith((".pub", "ca.pem")) else 0o600)
        else:
            os.chmod(tmp, 0o644)
        tmp.replace(path)
    if as_root:
        for directory in {(out / rel).parent for rel in files} - {out}:
            os.chown(directory, 0, CONTAINER_UID)


def prepare(out: Path, kind: str = "compose", *, force: bool = False, log=print) -> bool:
    """Write every file of ``kind``'s fleet under ``out`` unless all are there already.
    Returns whether they were (re)made."""
    layout = fleet(kind)
    names = expected_files(layout)
    if not force and all((out / n).is_file() for n in names):
        log(f"secrets {out}: present ({len(names)} files; --force remakes them)")
        return False
    _write(out, make_files(layout))
    log(f"secrets {out}: made {len(names)} files for the {kind} fleet (tokens, auth files, a dev CA and "
        "certificates, signing keys)")
    return True


# --- k8s Secrets --------------------------------------------------------------------------------


def k8s_secrets(out: Path) -> list[dict]:
    """One Secret per component, ``warmserve-COMPONENT``, with what its pod mounts at
    ``/etc/warmserve/secrets``: ``ca.pem``, ``tls.crt``/``tls.key``, its own ``token``, its
    ``auth`` file (servers that admit callers), ``signing.key`` and ``trusted-*.pub`` (publishers
    and verifiers), ``api-key`` (the OpenAI door)."""
    layout = fleet("k8s")
    trusted = {f"trusted-{p}.pub": f"trusted/{p}.pub" for p in layout["publishers"]}
    own = {
        "kernel-cache": {"auth": "auth/kernel-cache.auth"},
        "weights": {"auth": "auth/weights.auth", "signing.key": "signing/weights.key"},
        "router": {"auth": "auth/router.auth", "token": "tokens/router.token"},
        "runner": {"auth": "auth/runner.auth", "token": "tokens/runner.token", "signing.key": "signing/runner.key",
                   **trusted},
        "openai": {"token": "tokens/openai.token", "api-key": "api-key"},
    }
    docs = []
    for component, extra in own.items():
        cert = "runner" if component == "runner" else component
        files = {"ca.pem": "tls/ca.pem", "tls.crt": f"tls/{cert}.pem", "tls.key": f"tls/{cert}.key", **extra}
        docs.append({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                     "metadata": {"name": f"warmserve-{component}", "namespace": NAMESPACE,
                                  "labels": {"app.kubernetes.io/name": "warmserve",
                                             "app.kubernetes.io/component": component}},
                     "data": {key: base64.b64encode((out / rel).read_bytes()).decode() for key, rel in files.items()}})
    return docs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="where (default deploy/compose/secrets, or deploy/k8s/secrets for k8s)")
    p.add_argument("--fleet", choices=("compose", "k8s"), default="compose", help="whose identities (default compose)")
    p.add_argument("--force", action="store_true", help="make new ones even when all are present")
    p.add_argument("--k8s-manifests", action="store_true",
                   help="print the k8s Secrets (implies --fleet k8s), for `kubectl apply -f -`")
    args = p.parse_args(argv)
    kind = "k8s" if args.k8s_manifests else args.fleet
    out = Path(args.out) if args.out else (REPO / "deploy" / "k8s" / "secrets" if kind == "k8s" else DEFAULT_OUT)
    prepare(out.resolve(), kind, force=args.force, log=(lambda m: print(m, file=sys.stderr)))
    if args.k8s_manifests:
        sys.stdout.write(yaml.safe_dump_all(k8s_secrets(out.resolve()), sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
