"""The model's generation defaults: the sidecar's ``generation_config.json``.

The weight service copies a safetensors checkpoint's ``generation_config.json`` into the sidecar,
or builds one from a GGUF's metadata (its EOS, EOT and EOM ids and llama.cpp's
``general.sampling.*`` keys); :meth:`GenerationConfig.from_dir` reads it. Two things come out:

- **EOS ids** (``eos_token_id``, an int or a list): the engine stops on these as well as on
  ``config.json``'s (:attr:`runner_service.engine.LLMEngine.eos_token_ids`, the union), as
  transformers' ``generate`` stops on the generation config's; several instruct models list their
  end-of-turn token only there.
- **Sampling defaults** (``max_new_tokens`` -> ``max_tokens``, ``temperature``, ``top_k``,
  ``top_p``): what a request that leaves the field unset gets
  (:meth:`GenerationConfig.sampling_defaults`; a field the request sets, even to 0, wins).

``do_sample`` is not consulted. transformers applies ``temperature``/``top_k``/``top_p`` only when
``do_sample`` is true (greedy otherwise); vLLM's ``ModelConfig.get_diff_sampling_param`` takes
``temperature``, ``top_k``, ``top_p`` and ``max_new_tokens`` from the file whatever
``do_sample`` says, and this module does the same: a serving API's defaults are the model
author's recommended settings, which is what these keys hold in released instruct models (they
pair them with ``do_sample: true``). One difference from vLLM, which reads the file through
transformers' ``to_diff_dict`` and so drops values equal to transformers' own defaults: an
explicit ``top_k: 50`` is honoured here (vLLM then applies no top-k); for ``temperature: 1.0`` and
``top_p: 1.0`` the result is the same either way.

Every value is validated: one that is the wrong type or out of range (say ``top_p: 1.5``, an EOS
id outside the vocabulary) is ignored with a logged warning; an unreadable file counts as absent.
A model never fails to load because of this file.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from runner_service.sampling_params import SamplingDefaults
from weight_service.sidecar import GENERATION_CONFIG_FILE

log = logging.getLogger(__name__)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


#: HF key -> (our name, validity check, the rule in words).
_SAMPLING_KEYS = {
    "max_new_tokens": ("max_tokens", lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "temperature": ("temperature", lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "top_k": ("top_k", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "top_p": ("top_p", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
}


@dataclass(frozen=True)
class GenerationConfig:
    """The validated generation defaults of one model; ``None`` (or ``()``) where the file gives
    nothing usable."""

    eos_token_ids: tuple[int, ...] = ()
    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    @classmethod
    def from_dict(cls, data: dict, *, vocab_size: int | None = None,
                  source: str = GENERATION_CONFIG_FILE) -> GenerationConfig:
        """Take the keys this runner uses from an HF ``generation_config.json`` dict; a bad value
        (or an EOS id outside ``[0, vocab_size)``) is logged and ignored; ``null`` is absent."""
        if not isinstance(data, dict):
            log.warning("ignoring %s: not a JSON object", source)
            return cls()
        eos = data.get("eos_token_id")
        ids: list[int] = []
        for e in eos if isinstance(eos, list) else ([] if eos is None else [eos]):
            if _is_int(e) and e >= 0 and (vocab_size is None or e < vocab_size):
                ids.append(e)
            else:
                log.warning("ignoring eos_token_id %r in %s: not a token id of the vocabulary (%s)",
                            e, source, vocab_size)
        values: dict = {}
        for key, (name, valid, rule) in _SAMPLING_KEYS.items():
            value = data.get(key)
            if value is None:
                continue
            if valid(value):
                values[name] = float(value) if name in ("temperature", "top_p") else value
            else:
                log.warning("ignoring %s %r in %s: it must be %s", key, value, source, rule)
        return cls(eos_token_ids=tuple(dict.fromkeys(ids)), **values)

    @classmethod
    def from_dir(cls, directory: str | Path, *, vocab_size: int | None = None) -> GenerationConfig:
        """The sidecar directory's ``generation_config.json`` (:meth:`from_dict`); empty when
        there is none, and, with a logged warning, when it cannot be read or is not JSON."""
        path = Path(directory) / GENERATION_CONFIG_FILE
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as e:
            log.warning("ignoring %s: %s", path, e)
            return cls()
        return cls.from_dict(data, vocab_size=vocab_size, source=str(path))

    def sampling_defaults(self, max_tokens: int) -> SamplingDefaults:
        """These defaults over the runner's (``max_tokens``: ``EngineConfig.default_max_tokens``;
        temperature 0, top-k 0, top-p 1.0: :class:`SamplingDefaults`)."""
        given = {k: getattr(self, k) for k in ("temperature", "top_k", "top_p") if getattr(self, k) is not None}
        return SamplingDefaults(max_tokens=self.max_tokens or max_tokens, **given)
