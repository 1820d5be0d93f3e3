"""``warmserve up --tls``: the stack's throw-away PKI and what its own clients present
(``docs/security.md``, TLS).

One CA and one certificate (``localhost``, ``127.0.0.1`` and the stack's host) under
``HOME/tls/``, made afresh by every start (:func:`make_stack_pki`): every daemon serves with the
certificate, requires client certificates of the CA (mTLS) and presents the same certificate
when it dials a peer; the launcher's probes and clients present it too.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from services.channel import ClientSecurity
from services.fsmode import check_private_dir, private_dir
from services.tls import DevPKI, make_dev_pki

#: The directory of the stack's PKI, under its home.
TLS_DIR = "tls"


def stack_pki(home: Path) -> DevPKI:
    """The paths of the stack's PKI under ``home`` (made or not)."""
    return DevPKI.at(home / TLS_DIR)


def make_stack_pki(home: Path, host: str) -> DevPKI:
    """A new CA and certificate for ``localhost``, ``127.0.0.1`` and ``host`` under
    ``HOME/tls/`` (keys 0600, the directory 0700), replacing any earlier ones. Raises
    ``InvalidArgument`` when the home or an existing ``HOME/tls`` is not this user's or is
    writable by group/others (:func:`services.fsmode.private_dir`): another user could swap
    the keys."""
    names = list(dict.fromkeys(["localhost", "127.0.0.1", host]))
    check_private_dir(home, "the home")
    d = private_dir(home / TLS_DIR, "the TLS directory")
    return make_dev_pki(d, names, common_name="warmserve up CA")


def client_security(pki: DevPKI | None) -> ClientSecurity | None:
    """What the launcher's gRPC clients present: the stack's certificate (``None``: plaintext)."""
    return ClientSecurity(tls=pki.files()) if pki is not None else None


def http_context(pki: DevPKI | None) -> ssl.SSLContext | None:
    """An HTTPS client context for the stack's OpenAI door: trusts the stack's CA and presents
    its certificate (``None``: plain HTTP)."""
    if pki is None:
        return None
    from openai_service.healthcheck import client_tls

    return client_tls(str(pki.ca), str(pki.cert), str(pki.key))
