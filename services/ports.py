"""Every daemon's default port and the local stack's port plan (``docs/architecture.md`` §1).

A daemon started alone listens on its :data:`DEFAULT_PORTS` entry; ``warmserve up`` puts the
router at its base port and every other service at the same distance from it as here
(:func:`stack_port`). :func:`free_port` is the one "ask the kernel for a free port" helper.
"""

from __future__ import annotations

import socket

ROUTER, KERNEL_CACHE, WEIGHTS, OPENAI, RUNNER = "router", "kernel-cache", "weights", "openai", "runner"

#: Each daemon's default port; runner ``i`` of a stack follows the runner's (``+ i``).
DEFAULT_PORTS: dict[str, int] = {ROUTER: 50050, KERNEL_CACHE: 50051, WEIGHTS: 50052, OPENAI: 50053, RUNNER: 50061}
#: A stack's base port is its router's.
DEFAULT_BASE_PORT = DEFAULT_PORTS[ROUTER]
#: The router a client dials by default (a default ``warmserve up``'s).
DEFAULT_ROUTER = f"127.0.0.1:{DEFAULT_BASE_PORT}"
#: Ports a stack of ``n`` runners spans above its base: ``RUNNER_PORT_OFFSET + n``.
RUNNER_PORT_OFFSET = DEFAULT_PORTS[RUNNER] - DEFAULT_BASE_PORT


def stack_port(base_port: int, name: str) -> int:
    """The port of service ``name`` (``router``, ``kernel-cache``, ``weights``, ``openai`` or
    ``runner-I``) in a stack whose router is at ``base_port``; ``KeyError`` for another name."""
    if name.startswith(RUNNER + "-"):
        return base_port + RUNNER_PORT_OFFSET + int(name.removeprefix(RUNNER + "-"))
    return base_port + DEFAULT_PORTS[name] - DEFAULT_BASE_PORT


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now (the kernel may hand it out again once closed)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
