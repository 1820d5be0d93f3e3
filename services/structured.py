"""Structured output (``SamplingParams.structured``, a ``StructuredOutput``): the one spec every
layer shares, its limits, and the vLLM keys the doors accept for it.

:class:`StructuredSpec` is the runner's form of the proto message (hashable: it keys the compile
cache, :mod:`runner_service.structured`); :func:`spec_from_proto` / :func:`spec_to_proto` convert.
:func:`structured_from_vllm` parses vLLM's ``structured_outputs`` / ``guided_decoding`` dicts
(Triton's vLLM backend's ``sampling_parameters``, the OpenAI body), and :func:`structured_from_keys`
the OpenAI door's flat ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
and ``response_format``. At most one constraint per request. Every function raises
:class:`~services.errors.InvalidArgument` naming the key; the grammar itself is compiled (and
refused when it is invalid, too large or too complex) by the runner. See ``docs/architecture.md``
§8 "Structured output".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from services.errors import InvalidArgument
from services.json_text import parse_json
from services.proto import generation_pb2
from services.utf8 import utf8_size

#: Largest constraint text a request may give, in UTF-8 bytes (a JSON schema, a regex, a grammar,
#: or all the choices together): the grammar is compiled on the request's thread, and its size
#: bounds that work before llguidance's own limits do.
MAX_STRUCTURED_BYTES = 64 << 10
#: Most strings a ``choice`` constraint may list.
MAX_CHOICES = 1024
#: The kinds of ``StructuredOutput`` (its oneof), in proto order.
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
#: vLLM's names of the constraint keys (``structured_outputs`` / ``guided_decoding``) -> ours.
VLLM_KINDS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
              "grammar": "grammar"}
#: vLLM's option keys of those dicts that change nothing here (their values are checked for type
#: only): the backend is always llguidance, and the whitespace policy is fixed (no free whitespace).
VLLM_IGNORED_OPTIONS = ("backend", "disable_fallback", "disable_any_whitespace", "disable_additional_properties")


@dataclass(frozen=True)
class StructuredSpec:
    """One constraint: ``kind`` one of :data:`KINDS`; ``text`` the JSON schema (JSON text), the
    regex or the grammar (``""`` for ``json_object`` and ``choice``); ``choices`` the strings of
    ``choice``. Checked at construction against :data:`MAX_STRUCTURED_BYTES` and
    :data:`MAX_CHOICES` (``InvalidArgument``; over a limit: reason ``structured``), and for an
    empty text or choice."""

    kind: str
    text: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"structured output kind {self.kind!r} is not one of {', '.join(KINDS)}")
        object.__setattr__(self, "choices", tuple(self.choices))
        what = f"the structured output's {self.kind.replace('_', ' ')}"
        if self.kind == "choice":
            if not self.choices:
                raise InvalidArgument("the structured output's choice lists no strings")
            if len(self.choices) > MAX_CHOICES:
                raise InvalidArgument(f"the structured output's choice lists {len(self.choices)} strings; at most "
                                      f"{MAX_CHOICES}", reason="structured")
            if any(not c for c in self.choices):
                raise InvalidArgument("the structured output's choice holds an empty string")
            size = sum(utf8_size(c, what) for c in self.choices)
        else:
            size = utf8_size(self.text, what)
            if not self.text and self.kind != "json_object":
                raise InvalidArgument(f"{what} is empty")
        if size > MAX_STRUCTURED_BYTES:
            raise InvalidArgument(f"{what} is {size} bytes; at most {MAX_STRUCTURED_BYTES} (UTF-8)",
                                  reason="structured")


def spec_from_proto(msg: generation_pb2.StructuredOutput) -> StructuredSpec | None:
    """The spec of a ``StructuredOutput`` (``None`` when no kind is set; ``json_object`` false
    counts as unset). Raises ``InvalidArgument`` as :class:`StructuredSpec`."""
    kind = msg.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not msg.json_object):
        return None
    if kind == "choice":
        return StructuredSpec("choice", choices=tuple(msg.choice.choices))
    if kind == "json_object":
        return StructuredSpec("json_object")
    return StructuredSpec(kind, getattr(msg, kind))


def spec_to_proto(spec: StructuredSpec) -> generation_pb2.StructuredOutput:
    if spec.kind == "choice":
        return generation_pb2.StructuredOutput(choice=generation_pb2.ChoiceList(choices=spec.choices))
    if spec.kind == "json_object":
        return generation_pb2.StructuredOutput(json_object=True)
    return generation_pb2.StructuredOutput(**{spec.kind: spec.text})


def _schema_text(where: str, value: object) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text (checked to be an object)."""
    if isinstance(value, str):
        value = parse_json(value, where)
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where} must be a JSON schema (an object), got {json.dumps(value)[:100]}")
    try:
        return json.dumps(value, ensure_ascii=False)
    except RecursionError:
        raise InvalidArgument(f"{where} nests too deeply") from None


def _string(where: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{where} must be a string, got {json.dumps(value)[:100]}")
    return value


def _spec(kind: str, where: str, value: object) -> StructuredSpec:
    """The spec of one constraint key (our kind) and its value, as vLLM takes it."""
    if kind == "json_schema":
        return StructuredSpec(kind, _schema_text(where, value))
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidArgument(f"{where} must be a list of strings, got {json.dumps(value)[:100]}")
        return StructuredSpec(kind, choices=tuple(value))
    if kind == "json_object":
        return StructuredSpec(kind)
    return StructuredSpec(kind, _string(where, value))


def _one(found: list[tuple[str, StructuredSpec]]) -> StructuredSpec | None:
    if len(found) > 1:
        raise InvalidArgument(f"give at most one structured-output constraint, got {len(found)}: "
                              f"{', '.join(name for name, _ in found)}")
    return found[0][1] if found else None


def structured_from_vllm(key: str, value: object) -> StructuredSpec | None:
    """The spec of vLLM's ``structured_outputs`` (``StructuredOutputsParams``) or
    ``guided_decoding`` (``GuidedDecodingParams``) dict ``value`` under ``key``: one of ``json``
    (a schema object or its JSON text), ``regex``, ``choice`` (a list of strings), ``grammar``
    (GBNF or Lark) or ``json_object`` (true); :data:`VLLM_IGNORED_OPTIONS` may be given (any
    value), ``whitespace_pattern`` only null. ``value`` may be the dict's JSON text. ``None`` when no constraint is set (keys null or
    ``json_object`` false). Raises ``InvalidArgument`` for an unknown key, a wrong type, or more
    than one constraint."""
    if value is None:
        return None
    if isinstance(value, str):  # a request parameter's string value (Triton's parameters map)
        value = parse_json(value, f"'{key}'")
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"'{key}' must be an object, got {json.dumps(value)[:100]}")
    found = []
    for name, v in value.items():
        if v is None or name in VLLM_IGNORED_OPTIONS:
            continue
        if name == "json_object":
            if not isinstance(v, bool):
                raise InvalidArgument(f"'{key}.json_object' must be true or false, got {json.dumps(v)[:100]}")
            if not v:
                continue
        elif name not in VLLM_KINDS:
            raise InvalidArgument(f"'{key}.{name}' is not supported (supported: {', '.join(VLLM_KINDS)}; "
                                  f"ignored: {', '.join(VLLM_IGNORED_OPTIONS)})")
        found.append((f"{key}.{name}", _spec(VLLM_KINDS[name], f"'{key}.{name}'", v)))
    return _one(found)


#: The OpenAI door's flat vLLM keys (``guided_*``) -> our kinds.
GUIDED_KEYS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
               "guided_grammar": "grammar"}


def response_format_spec(response_format: Mapping | None) -> StructuredSpec | None:
    """The spec of an OpenAI ``response_format``: ``{"type": "text"}`` (or none) is ``None``;
    ``{"type": "json_object"}`` any JSON object; ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict", "description"}}`` the schema (``strict`` or not: the output always
    follows it). Raises ``InvalidArgument`` for another type or a missing schema."""
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object")
    if kind == "json_schema":
        js = response_format.get("json_schema")
        if not isinstance(js, Mapping) or js.get("schema") is None:
            raise InvalidArgument("response_format of type json_schema needs json_schema.schema (a JSON schema)")
        return StructuredSpec("json_schema", _schema_text("response_format.json_schema.schema", js["schema"]))
    raise InvalidArgument(f"response_format type {kind!r} is not supported (text, json_object or json_schema)")


def structured_from_keys(keys: Mapping[str, object]) -> StructuredSpec | None:
    """The one constraint among a request's keys: ``response_format`` (:func:`response_format_spec`),
    :data:`GUIDED_KEYS`, ``structured_outputs`` and ``guided_decoding``
    (:func:`structured_from_vllm`); keys absent or null are not constraints. Raises
    ``InvalidArgument`` for a bad value or more than one constraint."""
    found = []
    for key, value in keys.items():
        if value is None:
            continue
        if key == "response_format":
            spec = response_format_spec(value)
        elif key in GUIDED_KEYS:
            spec = _spec(GUIDED_KEYS[key], f"'{key}'", value)
        elif key in ("structured_outputs", "guided_decoding"):
            spec = structured_from_vllm(key, value)
        else:
            raise InvalidArgument(f"'{key}' is not a structured-output key")
        if spec is not None:
            found.append((key, spec))
    return _one(found)
