"""`make run` (the demo) and `warmserve up` on the same home share their compiled programs: the
program keys of their runners' configurations are equal (issue 25). Nothing is compiled: each
runner's ``runner serve`` command line, as the stack builds it, is parsed into the engine config
a real runner would use, a runner over a tiny model is built from it the way the engine builds
one (its torch thread count set, ``auto`` dtype resolved, context length from the model), and
``program_key`` is computed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runner_tiny import tiny_args

from model_families.llama import FAMILY as LLAMA
from runner_service.daemon import engine_config_from_args
from runner_service.device import resolve_dtype, select_device, torch_dtype
from runner_service.kv_cache import KVCache
from runner_service.model_runner import ModelRunner
from runner_service.options import MAX_PROGRAM_BATCH
from runner_service.programs.key import program_key
from services.errors import InvalidArgument
from warmserve.cli import build_parser
from warmserve.demo import demo_config
from warmserve.stack_config import PortPlan, StackCommands, StackConfig

ARGS = tiny_args(vocab=96, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=8, max_pos=128)


def _stack(argv: list[str], home: Path) -> StackConfig:
    config = StackConfig.from_args(build_parser().parse_args([*argv, "--home", str(home), "--base-port", "0"]))
    return demo_config(config) if argv[0] == "demo" else config


def _keys(config: StackConfig, home: Path, index: int, num_blocks: int = 24) -> dict[str, tuple[str, str]]:
    """Program keys (both kinds, the runner's ``--compile`` mode) of runner ``index`` of ``config``."""
    argv = StackCommands(config, home, PortPlan(config)).runner(index)
    assert argv[3:5] == ["runner", "serve"]
    engine = engine_config_from_args(build_parser().parse_args(argv[3:]))
    threads = torch.get_num_threads()
    try:
        if engine.num_threads is not None:  # as LLMEngine does, process-wide
            torch.set_num_threads(engine.num_threads)
        device = select_device(engine.device)
        dtype = torch_dtype(resolve_dtype(engine.dtype, device))
        weights = LLAMA.random_weights(ARGS, dtype=dtype, seed=0)
        kv = KVCache(LLAMA.cache_specs(ARGS, engine.block_size), num_blocks, engine.block_size, dtype, device)
        runner = ModelRunner(ARGS, weights, kv, engine, engine.resolved_max_model_len(ARGS), device, prepack=False)
        spec = runner.program_spec()
        return {kind: program_key(spec, engine.compile, kind=kind) for kind in spec.kinds()}
    finally:
        torch.set_num_threads(threads)


def test_the_demos_runners_and_ups_have_the_same_program_keys(tmp_path: Path) -> None:
    demo, up = _stack(["demo"], tmp_path), _stack(["up"], tmp_path)
    # what used to separate them: the demo's runners run 8 sequences, up's 32
    assert (demo.max_num_seqs, up.max_num_seqs) == (8, None)
    first, warm = _keys(demo, tmp_path, 0), _keys(demo, tmp_path, 1)  # runner-0, then the warm launch
    ups = [_keys(up, tmp_path, i) for i in range(up.runners)]
    assert all(name.endswith(".aoti") for name, _ in first.values())
    assert first == warm and all(keys == first for keys in ups)


def test_the_key_leaves_out_max_num_seqs_and_the_kv_cache_size_but_not_the_thread_count(tmp_path: Path) -> None:
    base = _keys(_stack(["up"], tmp_path), tmp_path, 0)
    assert _keys(_stack(["up", "--max-num-seqs", "3"], tmp_path), tmp_path, 0) == base
    assert _keys(_stack(["up", "--max-num-seqs", str(MAX_PROGRAM_BATCH)], tmp_path), tmp_path, 0) == base
    assert _keys(_stack(["up"], tmp_path), tmp_path, 0, num_blocks=40) == base
    more = StackConfig.from_args(build_parser().parse_args(["up", "--home", str(tmp_path), "--base-port", "0"]))
    threads = StackCommands(more, tmp_path, PortPlan(more)).runner(0)
    count = int(threads[threads.index("--threads") + 1])
    from dataclasses import replace

    other = _keys(replace(more, runner_threads=count + 1), tmp_path, 0)
    assert set(base) == {"decode", "prefill"}  # no verify program: speculation is off
    assert all(other[k][1] != base[k][1] for k in base)  # Inductor writes the count into the code


@pytest.mark.parametrize("argv", [["up", "--max-num-seqs", str(MAX_PROGRAM_BATCH + 1)],
                                  ["demo", "--max-num-seqs", str(MAX_PROGRAM_BATCH + 1), "--compile", "inductor"]])
def test_more_sequences_than_a_program_takes_are_refused_unless_eager(argv, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=f"exceeds {MAX_PROGRAM_BATCH}"):
        _stack(argv, tmp_path)
    assert _stack([*argv, "--compile", "off"], tmp_path).max_num_seqs == MAX_PROGRAM_BATCH + 1
