"""The door's async client of the router's ``warmserve.v1.Generation`` (``grpc.aio``).

One channel per door, opened on the server's event loop (:meth:`RouterClient.open`, from the
app's lifespan) and closed with it. ``generate`` returns the call itself, so the caller reads it
as it streams and cancels it when the HTTP client leaves: the router then cancels its runner
call, and the runner frees the sequence's KV blocks. With a
:class:`~services.channel.ClientSecurity` the channel is TLS (its ``tls`` files: the router
verified against their CA, their certificate presented) and every call carries its bearer
token (the door's ``generate``-scope credential).
"""

from __future__ import annotations

import grpc

from openai_service.errors import OpenAIError, from_rpc_error
from services.channel import CHANNEL_OPTIONS, PLAINTEXT, ClientSecurity
from services.proto import generation_pb2, generation_pb2_grpc


class RouterClient:
    """Async ``Generation`` client of ``address`` (``host:port``) presenting ``security``
    (``None``: plaintext, no token); :meth:`open` before use."""

    def __init__(self, address: str, security: ClientSecurity | None = None) -> None:
        self.address = address
        self.security = security or PLAINTEXT
        self._metadata = self.security.metadata()
        self._channel: grpc.aio.Channel | None = None
        self._stub: generation_pb2_grpc.GenerationStub | None = None

    async def open(self) -> None:
        """Create the channel on the running event loop (it connects on first use). Raises
        ``InvalidArgument`` for unreadable TLS files."""
        tls = self.security.tls
        if tls is not None:
            self._channel = grpc.aio.secure_channel(self.address, tls.channel_credentials(),
                                                    options=(*CHANNEL_OPTIONS, *tls.channel_options()))
        else:
            self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    async def close(self) -> None:
        """Close the channel; calls still running on it end CANCELLED."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    def _ready_stub(self) -> generation_pb2_grpc.GenerationStub:
        if self._stub is None:
            raise OpenAIError(503, "the door's channel to the router is not open (the server is starting or stopping)")
        return self._stub

    def generate(self, request: generation_pb2.GenerateRequest) -> grpc.aio.UnaryStreamCall:
        """Start ``Generate``; iterate the call (``async for``) for its messages, and
        ``cancel()`` it to stop the request. Reading it raises ``grpc.aio.AioRpcError`` (see
        :func:`openai_service.errors.from_rpc_error`)."""
        return self._ready_stub().Generate(request, metadata=self._metadata)

    async def model_info(self, *, timeout_s: float = 5.0) -> generation_pb2.ModelInfoResponse:
        """A READY runner's ``ModelInfo`` through the router, within ``timeout_s`` seconds.
        Raises :class:`OpenAIError` (503 when no runner is ready or the router is unreachable)."""
        try:
            return await self._ready_stub().ModelInfo(generation_pb2.ModelInfoRequest(), timeout=timeout_s,
                                                      metadata=self._metadata)
        except grpc.RpcError as e:
            err = from_rpc_error(e)
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                err = OpenAIError(503, f"the router at {self.address} did not answer within {timeout_s:g} s")
            raise err from e
