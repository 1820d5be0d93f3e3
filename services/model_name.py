"""The name a client gives for the model a stack serves (KServe v2 ``model_name``, OpenAI ``model``).

Runners report their model *source* (``ModelInfoResponse.model``): a bundled name such as
``smollm2-135m-instruct``, or a path to a checkpoint directory or file. Front doors publish one
*served name* for it, as vLLM's ``--served-model-name`` does: the operator's choice when given,
else :func:`served_model_name` of the source. A request naming either the served name or the
source itself is accepted (:func:`names_model`).
"""

from __future__ import annotations

from pathlib import PurePosixPath

#: Checkpoint file suffixes dropped from a source path's last component.
_SUFFIXES = (".gguf", ".safetensors")


def served_model_name(source: str) -> str:
    """The default served name of a model source: the last path component with a checkpoint
    suffix (``.gguf``, ``.safetensors``) removed, so ``/models/SmolLM2.Q4_1.gguf`` is
    ``SmolLM2.Q4_1`` and ``/ckpt/deepseek-v4-tiny/`` is ``deepseek-v4-tiny``; a bare name such
    as ``smollm2-135m-instruct`` is itself. Raises ``ValueError`` for an empty source."""
    text = source.strip().rstrip("/\\")
    if not text:
        raise ValueError("the model source is empty")
    name = PurePosixPath(text.replace("\\", "/")).name
    for suffix in _SUFFIXES:
        if name.lower().endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


def names_model(requested: str, *, served_name: str, source: str) -> bool:
    """Whether a request's model name (``requested``) names the served model: equal to its
    served name or to its source string. Case-sensitive, as vLLM and Triton compare them."""
    return requested in (served_name, source)
