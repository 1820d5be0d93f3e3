"""Scoped bearer tokens: minting them, the server's credential table, and the server-side check.

A *token* is an opaque random string a client sends as ``authorization: Bearer <token>``. A
server holds an :class:`AuthTable` (``--auth-file``): one :class:`Credential` per line,
``NAME SCOPE[,SCOPE...] sha256:HEX``, where HEX is the sha256 of the token's UTF-8 bytes, so the
table never holds a secret. ``NAME`` is the caller's identity (:func:`caller`); the scopes are
those of :mod:`services.scopes`. :class:`AuthInterceptor` answers ``UNAUTHENTICATED`` for a
missing or unknown token and ``PERMISSION_DENIED`` for a known one without the method's scope.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.errors import InvalidArgument
from services.fsmode import check_secret_file, private_dir, write_secret
from services.handlers import deny_handler, wrap_behaviour
from services.scopes import SCOPES, scope_of

#: The environment variables a process reads its own token and a server its table from.
ENV_TOKEN = "WARMSERVE_TOKEN"
ENV_AUTH_FILE = "WARMSERVE_AUTH_FILE"
TOKEN_PREFIX = "wst_"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def new_token() -> str:
    """A fresh token: ``wst_`` + 43 URL-safe characters (256 random bits from ``secrets``)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_digest(token: str) -> str:
    """``sha256:<hex>`` of ``token``'s UTF-8 bytes: what an auth file stores instead of the token."""
    return "sha256:" + hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class Credential:
    """One caller a server accepts: its identity ``name``, the scopes it holds, and the digest of
    its token. Raises ``InvalidArgument`` for a bad name, unknown scope or malformed digest."""

    name: str
    scopes: frozenset[str]
    digest: str

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise InvalidArgument(f"credential name {self.name!r} must be 1-128 of [A-Za-z0-9._@-]")
        unknown = sorted(set(self.scopes) - set(SCOPES))
        if unknown or not self.scopes:
            raise InvalidArgument(f"credential {self.name}: scopes must be some of {', '.join(SCOPES)}, "
                                  f"got {', '.join(sorted(self.scopes)) or 'none'}")
        if not _DIGEST.match(self.digest):
            raise InvalidArgument(f"credential {self.name}: the digest must be sha256:<64 hex>")

    def line(self) -> str:
        """This credential as one auth-file line."""
        return f"{self.name} {','.join(s for s in SCOPES if s in self.scopes)} {self.digest}"


class AuthTable:
    """The credentials a server accepts, looked up by token digest. Immutable once built.
    Raises ``InvalidArgument`` for duplicate names or digests."""

    def __init__(self, credentials: Iterable[Credential]) -> None:
        self._by_digest: dict[str, Credential] = {}
        names: set[str] = set()
        for c in credentials:
            if c.name in names or c.digest in self._by_digest:
                raise InvalidArgument(f"credential {c.name} appears twice (by name or by token)")
            names.add(c.name)
            self._by_digest[c.digest] = c
        if not self._by_digest:
            raise InvalidArgument("the auth table holds no credential")

    @classmethod
    def parse(cls, text: str, source: str = "the auth file") -> AuthTable:
        """Parse auth-file text (``NAME SCOPES sha256:HEX`` lines, ``#`` comments, blank lines)."""
        creds = []
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 3:
                raise InvalidArgument(f"{source} line {n}: expected 'NAME SCOPE[,SCOPE...] sha256:HEX'")
            try:
                creds.append(Credential(parts[0], frozenset(parts[1].split(",")), parts[2]))
            except InvalidArgument as e:
                raise InvalidArgument(f"{source} line {n}: {e}") from None
        return cls(creds)

    @classmethod
    def load(cls, path: str | Path) -> AuthTable:
        """Read an auth file. Raises ``InvalidArgument`` if unreadable or malformed."""
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidArgument(f"cannot read auth file {path}: {getattr(e, 'strerror', None) or e}") from e
        return cls.parse(text, str(path))

    def identify(self, token: str) -> Credential | None:
        """The credential ``token`` belongs to, or ``None``."""
        return self._by_digest.get(token_digest(token))

    def names(self) -> list[str]:
        """Identities in the table, sorted."""
        return sorted(c.name for c in self._by_digest.values())

    def text(self) -> str:
        """The table as auth-file text."""
        return "".join(c.line() + "\n" for c in sorted(self._by_digest.values(), key=lambda c: c.name))


def read_token(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """A process's own token: the first line of ``path`` when given, else ``$WARMSERVE_TOKEN``,
    else ``None``. Raises ``InvalidArgument`` for an unreadable or empty file."""
    if path:
        try:
            lines = Path(path).read_text().strip().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidArgument(f"cannot read token file {path}: {getattr(e, 'strerror', None) or e}") from e
        if not lines or not lines[0].strip():
            raise InvalidArgument(f"token file {path} is empty")
        return lines[0].strip()
    return (os.environ if env is None else env).get(ENV_TOKEN) or None


def load_auth_table(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> AuthTable | None:
    """The server's table from ``path``, else ``$WARMSERVE_AUTH_FILE``, else ``None`` (auth off)."""
    path = path or (os.environ if env is None else env).get(ENV_AUTH_FILE)
    return AuthTable.load(path) if path else None


def ensure_credentials(directory: str | Path, wanted: Mapping[str, Iterable[str]]) -> AuthTable:
    """Make (or reuse) one token per identity in ``directory`` and the auth file that accepts them.

    ``wanted`` maps identity -> scopes. Writes ``<dir>/<name>.token`` (0600; an existing one is
    kept, so restarts keep their tokens) and ``<dir>/auth`` (the :class:`AuthTable`); the
    directory is made 0700. Returns the table. Raises ``InvalidArgument`` when the existing
    directory or a token file could have been planted or changed by another user
    (:func:`services.fsmode.private_dir`, :func:`services.fsmode.check_secret_file`)."""
    d = private_dir(directory, "the credentials directory")
    creds = []
    for name, scopes in wanted.items():
        token_path = d / f"{name}.token"
        token = None
        if os.path.lexists(token_path):
            check_secret_file(token_path, "the token file")
            token = read_token(token_path)
        if token is None:
            token = new_token()
            write_secret(token_path, token + "\n")
        creds.append(Credential(name, frozenset(scopes), token_digest(token)))
    table = AuthTable(creds)
    write_secret(d / "auth", table.text())
    return table


_current = threading.local()


def caller() -> Credential | None:
    """The credential of the RPC this thread is serving (``None`` when auth is off or outside an RPC)."""
    return getattr(_current, "credential", None)


def _bearer(metadata) -> str:
    value = dict(metadata or ()).get("authorization", "")
    return value[7:].strip() if value.startswith("Bearer ") else ""


class AuthInterceptor(grpc.ServerInterceptor):
    """Checks every RPC's bearer token against ``table`` and the method's scope
    (:func:`services.scopes.scope_of`); a method in no table is refused. ``on_refused(reason)``
    (if given) is called for each refusal, ``reason`` one of ``unauthenticated``/``forbidden``."""

    def __init__(self, table: AuthTable, on_refused: Callable[[str], None] | None = None) -> None:
        self._table = table
        self._on_refused = on_refused

    def _refuse(self, handler, reason: str, code: grpc.StatusCode, msg: str):
        if self._on_refused is not None:
            self._on_refused(reason)
        return deny_handler(handler, code, msg)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        try:
            scope = scope_of(method)
        except KeyError:
            scope = ""
        handler = continuation(handler_call_details)
        if scope is None or handler is None:
            return handler
        cred = self._table.identify(_bearer(handler_call_details.invocation_metadata))
        if cred is None:
            return self._refuse(handler, "unauthenticated", grpc.StatusCode.UNAUTHENTICATED,
                                f"{method} needs a valid bearer token")
        if scope not in cred.scopes:
            needed = f"the {scope!r} scope" if scope else "a scope no credential holds"
            return self._refuse(handler, "forbidden", grpc.StatusCode.PERMISSION_DENIED,
                                f"credential {cred.name} lacks {needed} for {method}")

        def bind(fn, streaming: bool):
            if streaming:
                def inner_stream(request, context):
                    _current.credential = cred
                    try:
                        yield from fn(request, context)
                    finally:
                        _current.credential = None
                return inner_stream

            def inner(request, context):
                _current.credential = cred
                try:
                    return fn(request, context)
                finally:
                    _current.credential = None
            return inner

        return wrap_behaviour(handler, bind)
