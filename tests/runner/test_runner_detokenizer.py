"""Incremental detokenization with SmolLM2's real tokenizer: streamed pieces add up to the full
decode (multi-byte characters split across byte-level tokens included) and stop strings are cut
and never streamed, even when split over several tokens."""

from __future__ import annotations

import pytest

from runner_service.detokenizer import IncrementalDetokenizer
from runner_service.tokenizer import Tokenizer

TEXT = "Héllo wörld! 世界 says 🙂🚀 — naïve café, ok?"


@pytest.fixture(scope="module")
def tok(smollm2_sidecar):
    return Tokenizer.from_dir(smollm2_sidecar)


def test_streamed_pieces_add_up_to_the_full_decode(tok, hf_tokenizer):
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert ids == hf_tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok)
    pieces = []
    for i in ids:
        detok.push(i)
        pieces.append(detok.delta())
    pieces.append(detok.flush())
    assert "".join(pieces) == TEXT == hf_tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p == "") > 0  # some tokens carried half a character


def test_a_character_cut_by_max_tokens_is_not_a_replacement_character(tok, hf_tokenizer):
    ids = tok.encode(TEXT, add_special_tokens=False)
    for cut in range(1, len(ids)):
        if not hf_tokenizer.decode(ids[:cut]).endswith("\ufffd"):
            continue  # the cut falls between characters
        detok = IncrementalDetokenizer(tok)
        pieces = []
        for i in ids[:cut]:
            detok.push(i)
            pieces.append(detok.delta())
        pieces.append(detok.flush())
        text = "".join(pieces)
        assert "\ufffd" not in text
        assert text == hf_tokenizer.decode(ids[:cut]).rstrip("\ufffd")  # every complete character, in order
        break
    else:
        pytest.fail("no cut of TEXT falls inside a character")


def test_stop_string_split_over_tokens_is_cut_and_held_back(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=("says 🙂",))
    streamed = ""
    for i in ids:
        stopped = detok.push(i)
        streamed += detok.delta()
        assert "says" not in streamed
        if stopped:
            break
    streamed += detok.flush()
    assert detok.stopped
    assert streamed == "Héllo wörld! 世界 "


def test_earliest_of_several_stop_strings_wins(tok):
    detok = IncrementalDetokenizer(tok, stop=("café", "wörld"))
    for i in tok.encode(TEXT, add_special_tokens=False):
        if detok.push(i):
            break
    assert detok.delta() + detok.flush() == "Héllo "
