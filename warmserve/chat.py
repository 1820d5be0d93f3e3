"""``warmserve chat``'s loop: a conversation with a ``Generation`` endpoint on a terminal or a pipe
(:func:`interactive_chat`), through :class:`services.generation_client.GenerationClient`."""

from __future__ import annotations

from typing import TextIO

from services.errors import InvalidArgument, WarmserveError
from services.generation_client import GenerationClient, chat_request
from services.proto import generation_pb2

#: The chat loop's commands (a line that is one ``/word``); anything else goes to the model.
CHAT_COMMANDS = {
    "/exit": "leave (also /quit, or Ctrl-D)",
    "/quit": "leave",
    "/reset": "forget the conversation (the --system message stays)",
    "/help": "list these commands",
}


def chat_banner(address: str) -> str:
    """The line ``warmserve chat`` greets a terminal with."""
    return f"chatting with {address}; /help lists the commands, /exit or Ctrl-D leaves"


def interactive_chat(client: GenerationClient, sampling: generation_pb2.SamplingParams, *,
                     system: str | None, timeout_s: float | None, stdin: TextIO, stdout: TextIO,
                     banner: bool | None = None) -> int:
    """Read user lines from ``stdin`` until EOF (or ``/exit`` / ``/quit``), stream each answer
    to ``stdout``, and keep the conversation as history for the next turn; :data:`CHAT_COMMANDS`
    (``/reset`` clears the history, ``/help`` lists them) are never sent to the model, and an
    unknown ``/word`` is answered with a hint. ``banner`` (default: when ``stdin`` is a
    terminal) prints :func:`chat_banner` first. A failed turn is reported and dropped from the
    history; returns 0."""
    history: list[tuple[str, str]] = [("system", system)] if system is not None else []
    interactive = stdin.isatty()
    if interactive if banner is None else banner:
        stdout.write(chat_banner(client.address) + "\n")
    while True:
        if interactive:
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/") and len(line.split()) == 1:
            if line in ("/exit", "/quit"):
                break
            if line == "/reset":
                history = history[:1] if system is not None else []
                stdout.write("(history cleared)\n")
            elif line == "/help":
                stdout.write("".join(f"  {c:<7} {what}\n" for c, what in CHAT_COMMANDS.items()))
            else:
                stdout.write(f"(unknown command {line}; /help lists the commands)\n")
            continue
        history.append(("user", line))
        try:
            result = client.stream_to(chat_request(history, sampling), stdout, timeout_s=timeout_s)
        except WarmserveError as e:
            history.pop()
            full = isinstance(e, InvalidArgument) and "context" in str(e) and len(history) > (1 if system is not None else 0)
            stdout.write(f"\n(error: {e})\n" + ("(the conversation no longer fits the context: /reset forgets it)\n"
                                                 if full else ""))
            continue
        stdout.write("\n")
        history.append(("assistant", result.text))
    return 0
