"""The request tokenizer: the sidecar's ``tokenizer.json`` through HF ``tokenizers``, plus the
chat template from ``tokenizer_config.json`` rendered like transformers' ``apply_chat_template``
(a sandboxed Jinja2 environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception`` and a
non-escaping ``tojson``; the rendered text is tokenized without adding special tokens).

Content is text, never markup. HF ``tokenizers`` matches the text of every special token anywhere
in its input, so a user message holding the characters ``<|im_end|><|im_start|>system`` would be
encoded as the real control ids and close the user's turn. Here message content, and raw text
prompts unless the caller opts in, are tokenized with special-token matching off
(``encode_special_tokens``); only special-token text the chat template itself wrote becomes a
control id. For a conversation without such text the ids are exactly those of tokenizing the
rendered chat whole, because ``tokenizers`` too splits its input at special tokens first and
tokenizes the pieces between them independently.

Every encode goes through ``encode_batch_fast`` (one text per batch): it gives the same ids as
``encode``, computes no offsets, and releases the GIL while it works, where ``encode`` holds it,
so a long prompt tokenized on one gRPC thread does not stall the others (the stepping thread's
streams, health checks).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from services.errors import InvalidArgument
from services.json_text import parse_json

#: Chat roles a request may use; anything else is ``InvalidArgument``. ``tool`` messages carry a
#: tool call's result (OpenAI's role ``tool``).
CHAT_ROLES = ("system", "user", "assistant", "tool")

#: First code point of the guards that stand for special-token text found in message content
#: while the template renders (Supplementary Private Use Area-A, one code point per special token).
_GUARD_BASE = 0xF0000


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox configured as transformers does."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """Encode prompts, render chat messages, decode ids.

    ``tokenizer`` is a ``tokenizers.Tokenizer``; ``config`` the ``tokenizer_config.json`` dict
    (``chat_template``, ``bos_token``, ``eos_token``).
    """

    def __init__(self, tokenizer: HFTokenizer, config: dict) -> None:
        self._tok = tokenizer
        # A second instance with special-token matching off (a flag of the instance, so one
        # shared by request threads is never flipped back and forth).
        self._plain = HFTokenizer.from_str(tokenizer.to_str())
        self._plain.encode_special_tokens = True
        self._specials = {t.content: (i, t) for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        # Longest first, so a special token that is a prefix of another never wins over it.
        self._special_re = (re.compile("|".join(re.escape(s) for s in sorted(self._specials, key=len, reverse=True)))
                            if self._specials else None)
        # special-token text -> the private-use guard that stands for it in content, and back
        self._guard_of = {name: chr(_GUARD_BASE + k) for k, name in enumerate(self._specials)}
        self._text_of = {g: name for name, g in self._guard_of.items()}
        self.config = config
        source = config.get("chat_template")
        self._template = compile_chat_template(source) if source else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` (optional) from a sidecar dir."""
        path = Path(path)
        try:
            tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:
            raise InvalidArgument(f"cannot load {path / 'tokenizer.json'}: {e}") from e
        cfg_path = path / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        return cls(tok, config)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what structured output's grammar engine
        builds its vocabulary from, :mod:`runner_service.structured`)."""
        return self._tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True, allow_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; the tokenizer's post-processor adds BOS when it is configured to
        (``add_special_tokens``). Special-token text in ``text`` (``"<|im_end|>"``) is encoded as
        plain characters unless ``allow_special_tokens``, which maps it to the control ids."""
        tok = self._tok if allow_special_tokens else self._plain
        return _ids(tok, text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None) -> str:
        """The chat template applied to ``messages`` and ``tools``, in the shapes
        :func:`template_messages` and :func:`template_tools` give (transformers'
        ``apply_chat_template`` inputs). Raises ``InvalidArgument`` for an unknown role, no
        messages, only empty messages (an empty prompt), tool-call arguments or tool parameters
        that are not a JSON object, a model without a template, or a template that rejects the
        conversation. A template that does not read ``tools`` renders without them."""
        if not messages:
            raise InvalidArgument("the chat prompt has no messages")
        if all(not str(m.get("content") or "").strip() and not m.get("tool_calls") for m in messages):
            raise InvalidArgument("the chat prompt is empty: every message has empty content")
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise InvalidArgument(f"message {i} has unknown role {m.get('role')!r} (expected one of {CHAT_ROLES})")
        if self._template is None:
            raise InvalidArgument("this model has no chat template; send text or token ids")
        special = {k: v for k, v in self.config.items() if k.endswith("_token") and isinstance(v, str)}
        try:
            return self._template.render(messages=template_messages(messages), tools=template_tools(tools),
                                         add_generation_prompt=add_generation_prompt, **special)
        except jinja2.exceptions.TemplateError as e:
            raise InvalidArgument(f"the chat template rejected the messages: {e}") from e

    def encode_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of the rendered chat (no extra special tokens, as ``apply_chat_template``),
        with every string of the messages and tools (content, tool-call names and arguments,
        tool descriptions and schemas) tokenized as plain text: the only control ids are those of
        the template's own markup. Raises ``InvalidArgument`` as :meth:`render_chat`, and for a
        string holding the private-use code points this method reserves as guards (U+F0000
        onwards, one per special token: 17 for SmolLM2)."""
        if self._special_re is None:
            return self.encode(self.render_chat(messages, tools=tools), add_special_tokens=False)
        guarded = [self._guard(m, f"message {i}") for i, m in enumerate(messages)]
        guarded_tools = [self._guard(t, f"tool {i}") for i, t in enumerate(tools)] if tools else None
        rendered = self.render_chat(guarded, tools=guarded_tools)
        ids: list[int] = []
        pos, strip_next = 0, False
        for hit in self._special_re.finditer(rendered):
            token_id, added = self._specials[hit.group()]
            piece = rendered[pos:hit.start()]
            if strip_next:
                piece = piece.lstrip()
            if added.lstrip:
                piece = piece.rstrip()
            ids += self._encode_piece(piece)
            ids.append(token_id)
            pos, strip_next = hit.end(), added.rstrip
        tail = rendered[pos:]
        ids += self._encode_piece(tail.lstrip() if strip_next else tail)
        return ids

    def _guard(self, value, where: str):
        """``value`` (a message or tool: dicts, lists and strings) with the special-token text in
        every string replaced by its guard. Raises ``InvalidArgument`` for a string already
        holding a guard code point."""
        if isinstance(value, str):
            if any(ch in self._text_of for ch in value):
                raise InvalidArgument(f"{where} holds a reserved private-use character "
                                      f"(U+{_GUARD_BASE:X}..U+{_GUARD_BASE + len(self._text_of) - 1:X})")
            return self._special_re.sub(lambda hit: self._guard_of[hit.group()], value)
        if isinstance(value, dict):
            return {k: self._guard(v, where) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._guard(v, where) for v in value]
        return value

    def _encode_piece(self, piece: str) -> list[int]:
        """Plain-text ids of a stretch of rendered chat between two control tokens, its guards
        turned back into the special-token text the content held."""
        if not piece:
            return []
        text_of = self._text_of
        piece = "".join(text_of.get(ch, ch) for ch in piece) if any(ch in text_of for ch in piece) else piece
        return _ids(self._plain, piece, False)


def _json_object(text: str, what: str) -> dict:
    """``text`` parsed as a JSON object (empty: ``{}``); ``InvalidArgument`` naming ``what`` otherwise."""
    if not text.strip():
        return {}
    value = parse_json(text, what)
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """Messages as chat templates read them (transformers' convention): an assistant message's
    ``tool_calls`` (``[{"id", "name", "arguments"}]``, arguments JSON text) become
    ``[{"id", "type": "function", "function": {"name", "arguments": <object>}}]``; ``tool_call_id``
    and ``name`` are kept on tool messages. Raises ``InvalidArgument`` for arguments that are not
    a JSON object."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": c.get("id", ""), "type": "function",
                                "function": {"name": c.get("name", ""),
                                             "arguments": _json_object(c.get("arguments", ""),
                                                                       f"message {i}'s tool call {j} arguments")}}
                               for j, c in enumerate(m["tool_calls"])]
        out.append(m)
    return out


def template_tools(tools: Sequence[dict] | None) -> list[dict] | None:
    """Tools (``[{"name", "description", "parameters"}]``, parameters JSON Schema text) as chat
    templates read them: ``[{"type": "function", "function": {"name", "description",
    "parameters": <object>}}]``; ``None`` when there are none. Raises ``InvalidArgument`` for
    parameters that are not a JSON object."""
    if not tools:
        return None
    return [{"type": "function", "function": {"name": t.get("name", ""), "description": t.get("description", ""),
                                              "parameters": _json_object(t.get("parameters", ""),
                                                                         f"tool {i} ({t.get('name', '')!r}) parameters")}}
            for i, t in enumerate(tools)]


def _ids(tok: HFTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """``tok.encode(text).ids``, without holding the GIL (see the module docstring)."""
    return tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
