"""The runner's request limits, checked before any work is done for a request: the prompt's
size in bytes before it is tokenized (``--max-prompt-bytes``, :attr:`EngineConfig.max_prompt_bytes
<runner_service.config.EngineConfig>`), and the count and length of stop strings and stop token
ids. Each refusal is ``InvalidArgument`` naming the limit, with the ``reason`` it is counted under
in ``warmserve_refused_total`` (:mod:`services.refusals`). See ``docs/architecture.md`` §8.

Why stop strings are bounded: the output processor searches the new text for every stop string
after every generated token, on the engine's stepping thread
(:meth:`runner_service.detokenizer.IncrementalDetokenizer.push`), and holds back the longest
one's length of text, so their count times their length is paid per token by the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.errors import InvalidArgument
from services.utf8 import utf8_size

#: Most stop strings a request may give.
MAX_STOP_STRINGS = 16
#: Longest stop string, in UTF-8 bytes.
MAX_STOP_STRING_BYTES = 256
#: Most stop token ids a request may give.
MAX_STOP_TOKEN_IDS = 64


def check_stops(stop: Sequence[str], stop_token_ids: Sequence[int]) -> None:
    """Raise ``InvalidArgument`` for more than :data:`MAX_STOP_STRINGS` stop strings (reason
    ``stop_strings``), one over :data:`MAX_STOP_STRING_BYTES` bytes (``stop_strings``), one that
    is not valid Unicode (``unicode``), an empty one, or more than :data:`MAX_STOP_TOKEN_IDS`
    stop token ids (``stop_token_ids``)."""
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
                              reason="stop_strings")
    for i, s in enumerate(stop):
        if not s:
            raise InvalidArgument("stop strings must not be empty")
        size = utf8_size(s, f"stop string {i}")
        if size > MAX_STOP_STRING_BYTES:
            raise InvalidArgument(f"stop string {i} is {size} bytes of UTF-8; at most {MAX_STOP_STRING_BYTES} "
                                  f"are allowed", reason="stop_strings")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(f"stop_token_ids has {len(stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are "
                              f"allowed", reason="stop_token_ids")


def _strings_size(value, where: str) -> int:
    """UTF-8 bytes of every string in ``value`` (dicts' values, lists, strings)."""
    if isinstance(value, str):
        return utf8_size(value, where)
    if isinstance(value, dict):
        return sum(_strings_size(v, f"{where}'s {k}") for k, v in value.items())
    if isinstance(value, list | tuple):
        return sum(_strings_size(v, where) for v in value)
    return 0


def check_prompt_bytes(limit: int, *, text: str | None = None, messages: Sequence[dict] | None = None,
                       tools: Sequence[dict] | None = None) -> None:
    """Raise ``InvalidArgument`` when the prompt is more than ``limit`` bytes of UTF-8 (reason
    ``prompt_bytes``; a chat prompt: every string of its messages and tools together: roles,
    contents, tool calls, tool schemas) or is not valid Unicode (``unicode``). Token-id prompts
    are bounded by the context length instead."""
    if text is not None:
        size = utf8_size(text, "the prompt")
    elif messages is not None:
        size = sum(_strings_size(m, f"message {i}") for i, m in enumerate(messages))
        size += sum(_strings_size(t, f"tool {i}") for i, t in enumerate(tools or ()))
    else:
        return
    if size > limit:
        raise InvalidArgument(f"the prompt is {size} bytes of UTF-8; this runner takes at most {limit} "
                              f"(--max-prompt-bytes)", reason="prompt_bytes")
