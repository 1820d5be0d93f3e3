"""``warmserve demo`` twice on one home (issue 11 item 2): the first run is cold (packs the
sidecar, compiles the programs in the background and publishes them), the second finds both in
the home and compiles nothing. A tiny random Llama with a word tokenizer keeps it short (one AOTI
build of decode and prefill, ~40 s on 2 cores; answers of 4 tokens)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from weights_tiny import write_tiny_checkpoint

from warmserve.demo import run_demo
from warmserve.stack_config import StackConfig

pytestmark = pytest.mark.slow
VOCAB = 128


def _tiny_chat_model(directory: Path) -> Path:
    """A tiny checkpoint whose tokenizer maps every word the demo sends to some id < VOCAB."""
    write_tiny_checkpoint(directory, vocab=VOCAB, extra_config={"eos_token_id": VOCAB + 5})  # never stops early
    words = {f"w{i}": i for i in range(VOCAB - 1)}
    words["[UNK]"] = VOCAB - 1
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"}))
    return directory


def _demo(home: Path, model: Path) -> str:
    out = io.StringIO()
    config = StackConfig(runners=1, base_port=0, home=home, model=str(model), compile="aoti", max_num_seqs=8)
    assert run_demo(config, out=out, max_tokens=4) == 0
    return out.getvalue()


def test_the_second_demo_on_a_home_is_warm_and_compiles_nothing(tmp_path: Path) -> None:
    model = _tiny_chat_model(tmp_path / "model")
    home = tmp_path / "home"
    first = _demo(home, model)
    assert f"home {home}: cold: the sidecar was packed and the programs are compiled" in first
    assert "runner-0: compiled programs installed at" in first  # built in the background, then took over
    programs = sorted(p.name for p in (home / "kernel-cache").rglob("*") if p.is_file() and "lease" not in str(p))
    assert programs, "the cold run published nothing to the home's kernel cache"
    # the summary: time to compiled speed on both launches (and their ratio), the cold answer's
    # longest gap while compiling, the warm runner's first request against its steady ones
    summary = first.split("cold launch -> warm launch, seconds from the runner process's start:\n")[1]
    token, compiled, unrolled, gap, first_request = summary.splitlines()[:5]
    assert token.split()[:2] == ["first", "token"] and compiled.split()[:4] == ["serving", "at", "compiled", "speed"]
    assert compiled.endswith("x)") and "never" not in compiled, compiled
    # a tiny model (under LOOP_MIN_LAYERS layers) builds the unrolled programs only: they are the compiled ones
    assert unrolled.split()[:3] == ["unrolled", "programs", "installed"] and unrolled.split()[3] == compiled.split()[4]
    assert gap.split()[:4] == ["longest", "gap", "while", "compiling"] and gap.split()[5:] == ["s", "->", "no", "compile"]
    assert first_request.startswith("first request after the warm launch "), first_request

    second = _demo(home, model)
    assert f"home {home}: warm: programs from the kernel cache, sidecar HOT" in second
    assert "--fresh" in second and "compiled programs installed at" not in second
    assert "sidecar BUILT" not in second
    assert "warm launch -> warm launch, seconds from the runner process's start:" in second
    assert " ".join(second.split("longest gap while compiling")[1].split()[:5]) == "no compile -> no compile"
    first_launch = second.split("== first launch (warm): runner-0 start-up report")[1].split("\n\n")[0]
    assert first_launch.count("kernel cache HIT") == 2, first_launch  # decode and prefill, fetched
    assert "compiled" not in first_launch
    # the second run added no program to the kernel cache, and kept no stack.json behind
    assert sorted(p.name for p in (home / "kernel-cache").rglob("*")
                  if p.is_file() and "lease" not in str(p)) == programs
    assert not (home / "stack.json").exists()
