"""vLLM ``SamplingParams`` keys -> warmserve ``SamplingParams``, the one parser both doors use:
Triton's vLLM backend's ``sampling_parameters`` JSON (:mod:`kserve_service.convert`) and the
OpenAI body's sampling fields (:mod:`openai_service.convert`). See ``docs/architecture.md`` §10.

Keys: ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` (-1 = off, as vLLM), ``seed``,
``stop`` (a string or a list of strings), ``stop_token_ids``, ``ignore_eos``, ``presence_penalty``
and ``frequency_penalty`` (in [-2, 2]), ``repetition_penalty`` (in (0, 2]), ``min_tokens`` (>= 0),
``logit_bias`` (an object of token id -> bias in [-100, 100], at most 300 entries; the ids as
integers or as strings of digits, as OpenAI's API sends them), and structured output:
``structured_outputs`` / ``guided_decoding`` (vLLM's ``StructuredOutputsParams`` /
``GuidedDecodingParams`` as an object or its JSON text, at most one constraint:
:func:`services.structured.structured_from_vllm`); a vLLM key warmserve has no use for is
accepted only at its no-op value (:data:`NEUTRAL_SAMPLING`). The ranges are the named constants
below, which the runner's ``SamplingParams`` and the OpenAI door's schema import. Numbers may be
JSON numbers or strings (``"0.1"``, ``"100"``), as the vLLM backend converts each value with the
field's type. Every function raises :class:`services.errors.InvalidArgument` naming the key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

from services.errors import InvalidArgument
from services.proto import generation_pb2
from services.structured import spec_to_proto, structured_from_keys
from services.utf8 import utf8_size

#: The largest finite float32: the proto's ``temperature``/``top_p`` are 32-bit floats.
FLOAT32_MAX = 3.4028234663852886e38
#: The largest int32: the proto's token counts, token ids and ``top_k``.
INT32_MAX = 2**31 - 1
#: Most choices one request may ask for (``SamplingParams.n``; the runner's and the OpenAI door's
#: bound). Every choice is a sequence of its own, decoded in the runner's batch: one request may
#: hold at most half of a runner's rows at the default ``--max-num-seqs`` (32), so it cannot
#: crowd out every other request (a runner with fewer rows refuses a larger ``n`` itself).
MAX_N = 16

#: ``presence_penalty`` and ``frequency_penalty`` lie in ``[-PENALTY_MAX, PENALTY_MAX]`` (OpenAI's and
#: vLLM's range; 0 = off).
PENALTY_MAX = 2.0
#: ``repetition_penalty`` lies in ``(0, REPETITION_PENALTY_MAX]`` (1 = off).
REPETITION_PENALTY_MAX = 2.0
#: Most ``logit_bias`` entries a request may give (the OpenAI API's limit).
MAX_LOGIT_BIAS_ENTRIES = 300
#: Each ``logit_bias`` value lies in ``[-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX]`` (the OpenAI API's range).
LOGIT_BIAS_MAX = 100.0

#: vLLM sampling keys warmserve accepts only at the value that changes nothing (vLLM's default).
NEUTRAL_SAMPLING: Mapping[str, object] = {
    "n": 1, "best_of": 1, "min_p": 0.0, "detokenize": True, "include_stop_str_in_output": False,
    "logprobs": None, "prompt_logprobs": None,
}

#: The keys :func:`sampling_from_dict` maps (besides :data:`NEUTRAL_SAMPLING`'s), for its sentences.
SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias",
                 "structured_outputs", "guided_decoding")

def _int(key: str, value: object) -> int:
    if isinstance(value, bool):
        raise InvalidArgument(f"sampling parameter '{key}' must be an integer, got {json.dumps(value)}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise InvalidArgument(f"sampling parameter '{key}' must be an integer, got {json.dumps(value)}")


def _float(key: str, value: object) -> float:
    out: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        out = float(value)
    elif isinstance(value, str):
        try:
            out = float(value.strip())
        except ValueError:
            out = None
    if out is None or not math.isfinite(out) or abs(out) > FLOAT32_MAX:
        raise InvalidArgument(f"sampling parameter '{key}' must be a finite number, got {json.dumps(value)}")
    return out


def _bool(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise InvalidArgument(f"sampling parameter '{key}' must be true or false, got {json.dumps(value)}")


def _in_range(key: str, value: int | float, low: int | float, high: int | float) -> int | float:
    if not low <= value <= high:
        def text(v: int | float) -> str:
            return f"{v:g}" if isinstance(v, float) else str(v)
        raise InvalidArgument(f"sampling parameter '{key}' must be in [{text(low)}, {text(high)}], got {text(value)}")
    return value


def _logit_bias(value: object) -> dict[int, float]:
    """``logit_bias``: an object of token id (an integer, or a string of one) -> bias."""
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"sampling parameter 'logit_bias' must be an object of token id -> bias, "
                              f"got {json.dumps(value)[:80]}")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgument(f"sampling parameter 'logit_bias' has {len(value)} entries; at most "
                              f"{MAX_LOGIT_BIAS_ENTRIES} are allowed")
    out = {}
    for token, bias in value.items():
        if isinstance(token, str) and not token.strip().isdigit():
            raise InvalidArgument(f"sampling parameter 'logit_bias' keys must be token ids, got {json.dumps(token)}")
        out[_in_range("logit_bias", _int("logit_bias", token), 0, INT32_MAX)] = _in_range(
            f"logit_bias[{token}]", _float("logit_bias", bias), -LOGIT_BIAS_MAX, LOGIT_BIAS_MAX)
    return out


def sampling_from_dict(params: Mapping[str, object]) -> generation_pb2.SamplingParams:
    """warmserve ``SamplingParams`` from vLLM sampling keys (see the module docstring); a key
    whose value is ``None`` (JSON ``null``) is left unset. Raises ``InvalidArgument`` naming the
    key for an unknown key, a value of the wrong type or out of range, a stop string that is not
    valid Unicode (a lone surrogate), ``lora_name``, or a :data:`NEUTRAL_SAMPLING` key at another
    value. The count and length of stop strings and ids are the runner's to check
    (:mod:`runner_service.limits`)."""
    out = generation_pb2.SamplingParams()
    structured = {}
    for key, value in params.items():
        if value is None and key in (*SAMPLING_KEYS, *NEUTRAL_SAMPLING):
            continue
        if key == "max_tokens":
            out.max_tokens = _in_range(key, _int(key, value), 1, INT32_MAX)
        elif key == "temperature":
            out.temperature = _float(key, value)
        elif key == "top_p":
            out.top_p = _float(key, value)
        elif key == "top_k":
            top_k = _int(key, value)
            out.top_k = 0 if top_k == -1 else _in_range(key, top_k, 0, INT32_MAX)  # vLLM: -1 = off
        elif key == "seed":
            out.seed = _in_range(key, _int(key, value), 0, 2**64 - 1)
        elif key == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise InvalidArgument(f"sampling parameter 'stop' must be a string or a list of strings, "
                                      f"got {json.dumps(value)}")
            for i, stop in enumerate(stops):
                utf8_size(stop, f"sampling parameter 'stop' string {i}")  # a lone surrogate: InvalidArgument
            out.stop.extend(stops)
        elif key == "stop_token_ids":
            if not isinstance(value, list):
                raise InvalidArgument(f"sampling parameter 'stop_token_ids' must be a list of integers, "
                                      f"got {json.dumps(value)}")
            out.stop_token_ids.extend(_in_range(key, _int(key, v), 0, INT32_MAX) for v in value)
        elif key == "ignore_eos":
            out.ignore_eos = _bool(key, value)
        elif key in ("presence_penalty", "frequency_penalty"):
            setattr(out, key, _in_range(key, _float(key, value), -PENALTY_MAX, PENALTY_MAX))
        elif key == "repetition_penalty":
            penalty = _float(key, value)
            if not 0 < penalty <= REPETITION_PENALTY_MAX:
                raise InvalidArgument(f"sampling parameter 'repetition_penalty' must be in "
                                      f"(0, {REPETITION_PENALTY_MAX:g}], got {penalty:g}")
            out.repetition_penalty = penalty
        elif key == "min_tokens":
            out.min_tokens = _in_range(key, _int(key, value), 0, INT32_MAX)
        elif key == "logit_bias":
            out.logit_bias.update(_logit_bias(value))
        elif key in ("structured_outputs", "guided_decoding"):
            structured[key] = value
        elif key == "lora_name":
            raise InvalidArgument("sampling parameter 'lora_name': LoRA adapters are not supported")
        elif key in NEUTRAL_SAMPLING:
            _check_neutral(key, value)
        else:
            raise InvalidArgument(f"unknown sampling parameter '{key}' (supported: {', '.join(SAMPLING_KEYS)}, "
                                  f"and at their defaults {', '.join(NEUTRAL_SAMPLING)})")
    spec = structured_from_keys(structured)
    if spec is not None:
        out.structured.CopyFrom(spec_to_proto(spec))
    return out


def _check_neutral(key: str, value: object) -> None:
    neutral = NEUTRAL_SAMPLING[key]
    if neutral is None:
        same = False
    elif isinstance(neutral, bool):
        same = _bool(key, value) == neutral
    elif isinstance(neutral, int):
        same = _int(key, value) == neutral
    else:
        same = _float(key, value) == neutral
    if not same:
        raise InvalidArgument(f"sampling parameter '{key}' = {json.dumps(value)} is not supported "
                              f"(only its default, {json.dumps(neutral)})")
