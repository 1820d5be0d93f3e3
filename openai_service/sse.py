"""Server-sent events, and stopping work when the HTTP client goes away.

:func:`event` frames one JSON payload as ``data: {json}\\n\\n``; a stream ends with
:data:`DONE` (``data: [DONE]\\n\\n``), as OpenAI's and vLLM's do.

:class:`EventStream` streams the events while it watches for the client's disconnect: when the
connection drops (a disconnect message, or a failed send), the stream stops at once and
``on_close`` runs (it cancels the ``Generate`` call, so the router cancels the runner's, which
frees the sequence's KV blocks); ``on_close`` runs when the stream ends normally too.

:func:`unless_disconnected` runs a non-streaming request's work the same way (vLLM's
``with_cancellation``): the work is cancelled when the client disconnects first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

#: The last event of every stream.
DONE = "data: [DONE]\n\n"


def event(payload: dict | str) -> str:
    """One server-sent event carrying ``payload`` (a dict, dumped compactly, or JSON text)."""
    text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {text}\n\n"


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response of ``events`` (see the module docstring).
    ``on_close()`` runs exactly once when the response ends, however it ends."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], object]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-send (ASGI 2.4)
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            self._on_close()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _disconnected(request: Request) -> None:
    """Return when the client has disconnected (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``await work``, unless the client disconnects first: then the work is cancelled and
    ``None`` returned (nobody is left to answer)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled (server shutdown): stop the work too
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return None
