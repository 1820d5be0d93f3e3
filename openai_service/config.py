"""What ``warmserve openai serve`` needs: the router to call, where to listen, the model's name."""

from __future__ import annotations

from dataclasses import dataclass

from services.address import format_address, parse_address
from services.channel import ClientSecurity
from services.errors import InvalidArgument
from services.ports import DEFAULT_PORTS, DEFAULT_ROUTER, OPENAI


@dataclass(frozen=True)
class OpenAIConfig:
    """Settings of one OpenAI door, validated at construction (``InvalidArgument``).

    ``router``: ``host:port`` of the ``Generation`` endpoint (the router; a runner works too).
    ``host``/``port``: the HTTP bind address (port 0: a free one). ``served_model_name``: the
    model id published by ``GET /v1/models``; ``None`` = the default of the router's model source
    (:func:`services.model_name.served_model_name`). ``model_info_ttl_s``: seconds the router's
    ``ModelInfo`` (the model's source and limits) is reused before it is asked again. A client
    that disconnects cancels its ``Generate`` call, which frees the sequence on the runner.
    ``router_security``: the door's own credential for its calls to the router (``--token-file``).
    """

    router: str = DEFAULT_ROUTER
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORTS[OPENAI]
    served_model_name: str | None = None
    model_info_ttl_s: float = 30.0
    router_security: ClientSecurity | None = None

    def __post_init__(self) -> None:
        parse_address(self.router, what="--router")
        if not self.host:
            raise InvalidArgument("--host must not be empty")
        if not 0 <= self.port <= 65535:
            raise InvalidArgument(f"--port must be in [0, 65535] (0: a free port), got {self.port}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise InvalidArgument("--served-model-name must not be empty")
        if self.model_info_ttl_s < 0:
            raise InvalidArgument(f"the ModelInfo TTL must be >= 0 seconds, got {self.model_info_ttl_s}")

    @property
    def address(self) -> str:
        """``host:port`` to bind (as configured: port 0 before the server picked one)."""
        return format_address(self.host, self.port)
