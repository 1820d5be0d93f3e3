"""``warmserve up``'s credentials: one token per identity under ``HOME/auth/`` (made on the first
run by :func:`services.auth.ensure_credentials`, mode 0600, kept across runs), the auth file every
daemon of the stack checks, and the token the user's own CLI calls present (``docs/security.md``).

Identities and scopes: ``runner-I`` read, publish, prepare, register (its cache, weights and
router calls); ``router`` generate, read (its calls to runners); ``doors`` generate, read (the
OpenAI door's calls to the router); ``client`` generate, read (``warmserve generate``/``chat``/
``status`` against the stack); ``admin`` every scope (drain, evict, the stack's own checks).
"""

from __future__ import annotations

import os
from pathlib import Path

from services.auth import ENV_TOKEN, new_token, read_token
from services.channel import ClientSecurity
from services.fsmode import check_private_dir, check_secret_file, write_secret
from services.scopes import GENERATE, PREPARE, PUBLISH, READ, REGISTER, SCOPES

#: The directory under the home that holds the tokens and the auth file.
AUTH_DIR = "auth"
#: The auth file's name in :data:`AUTH_DIR`.
AUTH_FILE = "auth"
#: The OpenAI door's API key file in :data:`AUTH_DIR`.
OPENAI_KEY_FILE = "openai.key"
#: Runner credentials made beyond ``--runners``: for runners added later (``warmserve demo``'s
#: warm launch, :meth:`warmserve.stack.LocalStack.add_runner`), since the daemons read the auth
#: file once, at start-up.
SPARE_RUNNERS = 4
#: The stack's OpenAI door requires ``openai.key`` (``warmserve openai serve --api-key-file``).
DOOR_TAKES_API_KEY = True
RUNNER_SCOPES = (READ, PUBLISH, PREPARE, REGISTER)
ROUTER, DOORS, CLIENT, ADMIN_ID = "router", "doors", "client", "admin"


def stack_identities(runners: int) -> dict[str, tuple[str, ...]]:
    """Identity -> scopes of a stack started with ``runners`` runners (see the module docstring)."""
    wanted: dict[str, tuple[str, ...]] = {f"runner-{i}": RUNNER_SCOPES for i in range(runners + SPARE_RUNNERS)}
    wanted.update({ROUTER: (GENERATE, READ), DOORS: (GENERATE, READ), CLIENT: (GENERATE, READ), ADMIN_ID: SCOPES})
    return wanted


def auth_dir(home: Path) -> Path:
    """``HOME/auth``."""
    return home / AUTH_DIR


def ensure_stack_credentials(home: Path, runners: int) -> Path:
    """Make (or keep) the stack's tokens and auth file under ``HOME/auth`` (0700; files 0600)
    and the OpenAI door's API key ``openai.key`` (0600), and return that directory. Raises
    ``InvalidArgument`` for an unreadable token file, and before using anything that another
    user could have planted or changed: a home or ``auth`` directory not owned by this user or
    writable by group/others, a token or key file not a regular file of this user with mode
    0600 or narrower (``docs/security.md``, "Files that hold secrets")."""
    from services.auth import ensure_credentials

    check_private_dir(home, "the home")
    d = auth_dir(home)
    ensure_credentials(d, stack_identities(runners))
    key = d / OPENAI_KEY_FILE
    if os.path.lexists(key):
        check_secret_file(key, "the OpenAI door's API key file")
    else:
        write_secret(key, new_token() + "\n", exclusive=True)
    return d


def token_file(home: Path, identity: str) -> Path:
    """``HOME/auth/IDENTITY.token``."""
    return auth_dir(home) / f"{identity}.token"


def stack_security(home: Path, identity: str = CLIENT) -> ClientSecurity:
    """What ``identity`` of the stack in ``home`` presents (no token when the file is absent).
    Raises ``InvalidArgument`` for a token file :func:`services.fsmode.check_secret_file` refuses."""
    path = token_file(home, identity)
    if not os.path.lexists(path):
        return ClientSecurity(token=None)
    check_secret_file(path, "the token file")
    return ClientSecurity(token=read_token(path))


def cli_security(token_file_arg: str | None, address: str, home: Path) -> ClientSecurity:
    """The token a CLI command dialling ``address`` presents: ``--token-file``, else
    ``$WARMSERVE_TOKEN``, else the ``client`` token of the ``warmserve up`` in ``home`` when
    that stack's router is at ``address`` (never sent to another server)."""
    token = read_token(token_file_arg, os.environ)
    if token is None and os.environ.get(ENV_TOKEN) is None:
        from warmserve.stack_state import stack_router

        if stack_router(home) == address:
            return stack_security(home, CLIENT)
    return ClientSecurity(token=token)
