"""A tiny byte-level tokenizer for structured-output tests (test helper): ids 0 ``<pad>`` and 1
``<eos>`` (special), then one token per byte (ids 2..257), plus a few multi-character tokens
(JSON punctuation and words) so that a draft or a sampled token can span several grammar steps.
Pair it with :func:`runner_tiny.tiny_args` of a larger vocabulary (the ids past the tokenizer's
are the model's padding rows), or write it into a checkpoint with :func:`write_byte_tokenizer`."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from runner_service.tokenizer import Tokenizer as RunnerTokenizer

#: Multi-character tokens after the bytes (ids 258..).
WORDS = ('{"', '":', '",', '"}', ', "', ': ', 'true', 'false', 'null', 'yes', 'no', 'abc')


#: The tokenizer's ``tokenizer_config.json``: EOS ``<eos>`` (id 1), no BOS, and a chat template
#: that joins the messages' contents.
TOKENIZER_CONFIG = {"eos_token": "<eos>", "add_bos_token": False,
                    "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
#: The tokenizer's EOS id.
EOS_ID = 1


def tiny_tokenizer() -> RunnerTokenizer:
    """The runner's :class:`Tokenizer` over the tiny vocabulary (``vocab_size`` 258 + len(WORDS))."""
    return RunnerTokenizer(byte_tokenizer(), {"eos_token": "<eos>"})


def write_byte_tokenizer(directory: Path) -> None:
    """Write the tiny byte-level ``tokenizer.json`` and :data:`TOKENIZER_CONFIG` into ``directory``
    (a checkpoint's, whose ``vocab_size`` is at least the tokenizer's and whose EOS is :data:`EOS_ID`)."""
    byte_tokenizer().save(str(Path(directory) / "tokenizer.json"))
    (Path(directory) / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))


def byte_tokenizer() -> Tokenizer:
    """The ``tokenizers`` tokenizer of the tiny vocabulary (ByteLevel pre-tokenizer and decoder,
    which llguidance reads)."""
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
    return tok


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
