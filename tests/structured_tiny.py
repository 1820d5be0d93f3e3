"""A tiny byte-level tokenizer for structured-output tests (test helper): ids 0 ``<pad>`` and 1
``<eos>`` (special), then one token per byte (ids 2..257), plus a few multi-character tokens
(JSON punctuation and words) so that a draft or a sampled token can span several grammar steps.
Pair it with :func:`runner_tiny.tiny_args` of a larger vocabulary (the ids past the tokenizer's
are the model's padding rows)."""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from runner_service.tokenizer import Tokenizer as RunnerTokenizer

#: Multi-character tokens after the bytes (ids 258..).
WORDS = ('{"', '":', '",', '"}', ', "', ': ', 'true', 'false', 'null', 'yes', 'no', 'abc')


def tiny_tokenizer() -> RunnerTokenizer:
    """The runner's :class:`Tokenizer` over the tiny vocabulary (``vocab_size`` 258 + len(WORDS))."""
    alphabet = ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {"<pad>": 0, "<eos>": 1}
    for i, ch in enumerate(byte_chars):
        vocab[ch] = 2 + i
    merges = []
    for w in WORDS:
        spelled = "".join(_char_of(b) for b in w.encode())
        prefix = spelled[0]
        for ch in spelled[1:]:
            if prefix + ch not in vocab:
                vocab[prefix + ch] = len(vocab)
                merges.append((prefix, ch))
            prefix += ch
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<pad>", special=True), AddedToken("<eos>", special=True)])
    return RunnerTokenizer(tok, {"eos_token": "<eos>"})


def _byte_map() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


_BYTES = _byte_map()
_CHARS = {c: b for b, c in _BYTES.items()}


def _byte_of(ch: str) -> int:
    return _CHARS[ch]


def _char_of(b: int) -> str:
    return _BYTES[b]
