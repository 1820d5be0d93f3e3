"""Credentials for tests: an auth table and the tokens it accepts, made by the product's own
``services.auth.ensure_credentials`` in a temporary directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.auth import AuthTable, ensure_credentials, read_token
from services.channel import ClientSecurity


@dataclass
class Creds:
    """An auth table, its directory, and each identity's token and token file."""

    table: AuthTable
    directory: Path

    def token(self, name: str) -> str:
        return read_token(self.token_file(name))

    def token_file(self, name: str) -> Path:
        return self.directory / f"{name}.token"

    def security(self, name: str) -> ClientSecurity:
        return ClientSecurity(token=self.token(name))

    def metadata(self, name: str) -> tuple[tuple[str, str], ...]:
        return self.security(name).metadata()

    @property
    def auth_file(self) -> Path:
        return self.directory / "auth"


def make_creds(directory: Path, **wanted: str) -> Creds:
    """``make_creds(d, publisher="read,publish,admin", reader="read")``."""
    table = ensure_credentials(directory, {name: scopes.split(",") for name, scopes in wanted.items()})
    return Creds(table, directory)
