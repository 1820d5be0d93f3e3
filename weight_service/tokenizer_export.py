"""Build a ``tokenizers`` tokenizer (saved as ``tokenizer.json``) from GGUF ``tokenizer.*`` metadata.

Only byte-level BPE (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Llama 3, Qwen2) is supported;
the pieces follow the GPT-2 byte-level BPE design that HF ``tokenizers`` implements:

- model: ``BPE(vocab, merges)``; the vocabulary is ``tokenizer.ggml.tokens`` in id order, each
  token spelled in the GPT-2 byte alphabet (:func:`bytes_to_unicode`, from OpenAI's GPT-2
  ``encoder.py``); a token using other characters is re-spelled from its UTF-8 bytes;
- pre-tokenizer: the split regex of the vocabulary's family (``tokenizer.ggml.pre``; the GPT-2
  regex by default, the Llama 3 or Qwen2 regex for those families) then byte-level mapping;
- special tokens: ``token_type == 3`` (llama.cpp CONTROL) as special added tokens, ``4``
  (USER_DEFINED) as plain added tokens, so ``<|im_start|>`` stays one token;
- post-processor: BOS prepended only when ``tokenizer.ggml.add_bos_token`` is true.

``tokenizer_config.json`` carries ``chat_template``, ``bos_token``, ``eos_token`` and
``add_bos_token`` (plus ``unk_token``/``pad_token`` when the file names them).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from services.errors import InvalidArgument

_CONTROL, _USER_DEFINED = 3, 4

# Split regexes of the Llama 3 and Qwen2 byte-level vocabularies (from their tokenizer.json files).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (OpenAI ``gpt-2/src/encoder.py``):
    printable Latin-1 bytes map to themselves, the other 68 to ``chr(256 + n)``."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def gguf_tokenizer(value: Callable[..., object]) -> tuple[Tokenizer, dict]:
    """``(tokenizer, tokenizer_config)`` from GGUF metadata; ``value(key, default=None)`` reads
    one metadata key. Raises ``InvalidArgument`` for a non-byte-level vocabulary."""
    model_type = value("tokenizer.ggml.model")
    if model_type != "gpt2":
        raise InvalidArgument(f"GGUF tokenizer model {model_type!r} is not supported; only byte-level "
                              "BPE ('gpt2') can be exported")
    tokens: list[str] = list(value("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in value("tokenizer.ggml.merges", [])]
    token_types = list(value("tokenizer.ggml.token_type", []) or [])
    alphabet = set(bytes_to_unicode().values())
    spell = bytes_to_unicode()

    def spelled(token: str) -> str:
        return token if set(token) <= alphabet else "".join(spell[b] for b in token.encode("utf-8"))

    vocab = {spelled(t): i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=False, byte_fallback=False))
    split = _SPLITS.get(value("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, token_types, strict=False) if kind == _CONTROL and set(t) <= alphabet]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, token_types, strict=False) if kind == _USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)

    def token_of(key: str) -> str | None:
        idx = value(f"tokenizer.ggml.{key}")
        return None if idx is None or not 0 <= int(idx) < len(tokens) else tokens[int(idx)]

    bos, eos = token_of("bos_token_id"), token_of("eos_token_id")
    add_bos = bool(value("tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        bos_id = int(value("tokenizer.ggml.bos_token_id"))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    config = {
        "chat_template": value("tokenizer.chat_template"),
        "bos_token": bos,
        "eos_token": eos,
        "add_bos_token": add_bos,
    }
    for name, key in (("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        if (token := token_of(key)) is not None:
            config[name] = token
    return tok, config
