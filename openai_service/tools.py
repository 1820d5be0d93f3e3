"""OpenAI tool calling on the ``Generation`` contract: ``tools`` and tool messages to the proto,
``tool_choice`` to a constraint, the generated text back to ``tool_calls``.

- ``tools``: functions only (``{"type": "function", "function": {"name", "description",
  "parameters"}}``), at most :data:`MAX_TOOLS`; they reach the chat template as its ``tools``.
- ``tool_choice`` ``"none"``: tools are shown to the template, the answer is text.
- A named function (``{"type": "function", "function": {"name": ...}}``): the output is
  constrained to the function's parameter schema (``StructuredOutput.json_schema``) and
  returned as one call whose arguments are the generated JSON (finish reason ``"stop"``, as the
  OpenAI API answers a forced function).
- ``"required"``: the output is constrained to :func:`required_schema`, a JSON array of at least
  one ``{"name": <one of the tools>, "arguments": <its parameters>}``; each element becomes a
  call (finish reason ``"tool_calls"``).
- ``"auto"`` (the default when tools are given): unconstrained; the answer is parsed for calls
  in the Hermes format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the format
  of the templates that define tool calls (Qwen2.5, Qwen3, Hermes, SmolLM3); text outside them
  stays content. The bundled SmolLM2's template defines no tool calls, so there ``"auto"`` is
  plain text unless the model writes such a block.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from openai_service.errors import bad_request
from openai_service.protocol import MAX_TOOLS
from services.proto import generation_pb2

#: A function name (OpenAI's rule: letters, digits, underscores and dashes, at most 64).
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: One Hermes-format call in an ``"auto"`` answer.
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    """How a request's ``tool_choice`` is served: ``mode`` ``"none"`` | ``"auto"`` |
    ``"required"`` | ``"named"``; ``name`` the forced function (named); ``schema`` the JSON
    Schema text the output is constrained to (named, required), else ``""``."""

    mode: str
    name: str = ""
    schema: str = ""

    @property
    def constrained(self) -> bool:
        return bool(self.schema)


def tools_to_proto(tools: list[Any] | None) -> list[generation_pb2.Tool]:
    """The request's ``tools`` as ``Tool`` messages. Raises :class:`OpenAIError` (400, param
    ``tools``) for more than :data:`MAX_TOOLS`, a tool that is not a function, a bad name, or
    parameters that are not a JSON object (a name given twice: a named choice takes the first)."""
    if not tools:
        return []
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools may be given, got {len(tools)}", param="tools")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad_request(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', "
                              f"got {json.dumps(name)}", param="tools")
        params = fn.get("parameters", {})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON Schema object", param="tools")
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise bad_request(f"tools[{i}].function.description must be a string", param="tools")
        try:
            schema = json.dumps(params)
        except RecursionError:
            raise bad_request(f"tools[{i}].function.parameters nests too deeply", param="tools") from None
        out.append(generation_pb2.Tool(name=name, description=description, parameters=schema))
    return out


def _parameters(tool: generation_pb2.Tool) -> dict:
    return json.loads(tool.parameters) if tool.parameters else {"type": "object"}


def required_schema(tools: list[generation_pb2.Tool]) -> dict:
    """The JSON Schema of ``tool_choice`` ``"required"``: an array of at least one call, each
    ``{"name": <a tool's name>, "arguments": <that tool's parameters>}`` (no other keys)."""
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": _parameters(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}


def plan(tool_choice: Any, tools: list[generation_pb2.Tool]) -> ToolPlan:
    """The :class:`ToolPlan` of ``tool_choice`` (``None``: ``"auto"`` with tools, ``"none"``
    without). Raises :class:`OpenAIError` (400, param ``tool_choice``) for an unknown value, a
    choice that needs tools when there are none, or a function not among them."""
    if tool_choice is None:
        return ToolPlan("auto" if tools else "none")
    if tool_choice == "none":
        return ToolPlan("none")
    if tool_choice in ("auto", "required") and not tools:
        raise bad_request(f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
    if tool_choice == "auto":
        return ToolPlan("auto")
    if tool_choice == "required":
        return ToolPlan("required", schema=json.dumps(required_schema(tools)))
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(fn, dict):
        raise bad_request("tool_choice must be \"none\", \"auto\", \"required\" or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    by_name = {t.name: t for t in reversed(tools)}  # the first of a name wins
    name = fn.get("name")
    if name not in by_name:
        raise bad_request(f"tool_choice names function {json.dumps(name)}, which is not among the tools",
                          param="tool_choice")
    return ToolPlan("named", name=name, schema=json.dumps(_parameters(by_name[name])))


def call_id() -> str:
    """A fresh tool-call id (``call_`` and 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


def tool_calls(plan_: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """The answer ``text`` as ``(content, tool_calls)``, each call ``{"id", "type": "function",
    "function": {"name", "arguments"}}`` with ``arguments`` JSON text. ``"none"``: the text as
    content. Named: one call whose arguments are the text. Required: one call per array element
    (content ``None``). Auto: every well-formed Hermes block is a call; the text around them
    is the content (``None`` when empty). Text that does not parse as the constraint said (a
    length-cut answer) stays content."""
    if plan_.mode == "none":
        return text, []
    if plan_.mode == "named":
        return None, [_call(plan_.name, text)]
    if plan_.mode == "required":
        try:
            calls = json.loads(text)
            return None, [_call(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]
        except (ValueError, TypeError, KeyError, RecursionError):
            return text, []
    calls, rest = [], []
    pos = 0
    for hit in _HERMES_CALL.finditer(text):
        try:
            body = json.loads(hit.group(1))
            call = _call(body["name"], json.dumps(body.get("arguments", {}), ensure_ascii=False))
        except (ValueError, TypeError, KeyError, RecursionError):
            continue
        rest.append(text[pos:hit.start()])
        calls.append(call)
        pos = hit.end()
    rest.append(text[pos:])
    content = "".join(rest).strip() if calls else text
    return (content or None), calls


def _call(name: str, arguments: str) -> dict:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def message_to_proto(role: str, content: str, message: Any) -> generation_pb2.ChatMessage:
    """One request message as a ``ChatMessage``: ``role`` and ``content`` as converted by the
    caller, plus an assistant message's ``tool_calls`` and a tool message's ``tool_call_id`` and
    ``name`` (read from the pydantic model's extra fields). Raises :class:`OpenAIError` (400,
    param ``messages``) for tool calls that are not functions with string arguments."""
    extra = getattr(message, "model_extra", None) or {}
    out = generation_pb2.ChatMessage(role=role, content=content)
    for j, call in enumerate(extra.get("tool_calls") or []):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments", ""), str):
            raise bad_request(f"tool_calls[{j}] must be {{\"id\", \"type\": \"function\", \"function\": "
                              "{\"name\": <string>, \"arguments\": <JSON text>}}", param="messages")
        out.tool_calls.append(generation_pb2.ToolCall(id=str(call.get("id") or ""), name=fn["name"],
                                                      arguments=fn.get("arguments", "")))
    tool_call_id = extra.get("tool_call_id")
    if tool_call_id is not None:
        out.tool_call_id = str(tool_call_id)
    name = getattr(message, "name", None)
    if role == "tool" and name:
        out.name = name
    return out


#: The opening of a Hermes-format call, which ``"auto"`` streams hold text back for.
_OPEN = "<tool_call>"


class ToolStream:
    """One streamed choice's text as chat deltas under a :class:`ToolPlan`: :meth:`feed` takes
    each message's text and returns ``(content, tool_call_deltas)`` to send (content ``""``:
    none). ``"none"``: the text as content. Named: the call's opening delta (``index`` 0, ``id``,
    ``type``, ``function.name``, empty ``arguments``) and then each text as an ``arguments``
    fragment, as OpenAI streams a forced call. Required: held back and sent whole, one delta per
    call, at the end (the array is parsed once complete). Auto: content streams until
    ``<tool_call>`` appears (text that could be its start is held back until it is known not to
    be); from there on the text is held and parsed at the end, as :func:`tool_calls` parses it.
    :attr:`called`: whether calls were sent (the finish reason becomes ``"tool_calls"`` unless
    named)."""

    def __init__(self, plan_: ToolPlan) -> None:
        self.plan = plan_
        self.held = ""
        self.calls_open = False
        self.called = False

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        mode = self.plan.mode
        if mode == "none":
            return text, []
        if mode == "named":
            if not self.calls_open:
                self.calls_open = self.called = True
                call = _call(self.plan.name, text)
                return "", [{"index": 0, **call}]
            return "", [{"index": 0, "function": {"arguments": text}}] if text else []
        self.held += text
        if mode == "auto" and not self.calls_open:
            at = self.held.find(_OPEN)
            if at < 0:
                keep = 0 if final else _open_prefix(self.held)
                out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                return out, []
            self.calls_open = True
            out, self.held = self.held[:at], self.held[at:]
            if not final:
                return out, []
            content, calls = self._finish()
            return out + content, calls
        if not final:
            return "", []
        return self._finish()

    def _finish(self) -> tuple[str, list[dict]]:
        content, calls = tool_calls(self.plan, self.held)
        self.held = ""
        self.called = bool(calls)
        return content or "", [{"index": i, **c} for i, c in enumerate(calls)]


def _open_prefix(text: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``<tool_call>``."""
    for k in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(_OPEN[:k]):
            return k
    return 0
