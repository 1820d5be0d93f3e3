"""The request tokenizer: the sidecar's ``tokenizer.json`` through HF ``tokenizers``, plus the
chat template from ``tokenizer_config.json`` rendered like transformers' ``apply_chat_template``
(a sandboxed Jinja2 environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception`` and a
non-escaping ``tojson``; the rendered text is tokenized without adding special tokens).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from services.errors import InvalidArgument

#: Chat roles a request may use; anything else is ``InvalidArgument``.
CHAT_ROLES = ("system", "user", "assistant")


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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; the tokenizer's post-processor adds BOS when it is configured to."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages`` (``[{"role", "content"}]``). Raises
        ``InvalidArgument`` for an unknown role, no messages, only empty messages (an empty
        prompt), a model without a template, or a template that rejects the conversation."""
        if not messages:
            raise InvalidArgument("the chat prompt has no messages")
        if all(not str(m.get("content") or "").strip() for m in messages):
            raise InvalidArgument("the chat prompt is empty: every message has empty content")
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise InvalidArgument(f"message {i} has unknown role {m.get('role')!r} (expected one of {CHAT_ROLES})")
        if self._template is None:
            raise InvalidArgument("this model has no chat template; send text or token ids")
        special = {k: v for k, v in self.config.items() if k.endswith("_token") and isinstance(v, str)}
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         **special)
        except jinja2.exceptions.TemplateError as e:
            raise InvalidArgument(f"the chat template rejected the messages: {e}") from e

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of the rendered chat (no extra special tokens, as ``apply_chat_template``)."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)
