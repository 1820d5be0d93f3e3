"""`warmserve up`'s and `demo`'s child runner command lines come from the same declarations as
`runner serve` (:mod:`runner_service.options`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_flags import leaf_parser, parse_command_line

from runner_service.options import FORWARDED_OPTIONS, RUNNER_OPTIONS
from warmserve.cli import build_parser
from warmserve.stack import LocalStack
from warmserve.stack_config import StackConfig

#: What the stack gives every runner besides the declared options: the server's own flags.
SERVER_FLAGS = {"--host", "--port", "--drain-grace", "--auth-file", "--token-file"}


def _flag_of(word: str) -> str:
    """The declared flag a word of the stack's argv stands for (``--no-x`` for a switch ``--x``)."""
    for option in RUNNER_OPTIONS:
        if word == option.flag or (option.kind == "switch" and word == "--no-" + option.flag.removeprefix("--")):
            return option.flag
    return word


@pytest.mark.parametrize("argv", [
    ["up"],
    ["up", "--compile", "inductor", "--dtype", "bf16", "--weights-dtype", "int4", "--max-num-seqs", "3",
     "--max-num-batched-tokens", "512", "--no-prefix-caching"],
    ["demo"],
    ["demo", "--compile", "off", "--max-num-seqs", "2"],
])
def test_the_stacks_runner_argv_parses_as_runner_serve_and_forwards_every_option(tmp_path: Path, argv) -> None:
    args = build_parser().parse_args([*argv, "--home", str(tmp_path), "--base-port", "0"])
    stack = LocalStack(StackConfig.from_args(args), progress=None)
    child = stack.runner_argv(0)
    assert child[1:5] == ["-m", "warmserve.cli", "runner", "serve"]
    served = parse_command_line(child[3:])  # every flag a real runner serve option, every value valid
    words = {_flag_of(w) for w in child[5:] if w.startswith("--")}
    assert words <= {o.flag for o in RUNNER_OPTIONS} | SERVER_FLAGS, words
    for option in FORWARDED_OPTIONS:  # each forwarded option reaches the runner, or leaves its default
        given = getattr(args, option.dest)
        expected = option.serve_default if given is None else given
        assert getattr(served, option.dest) == expected, option.flag
        if given is not None and given != option.serve_default:
            assert option.flag in child, option.flag


def test_up_and_demo_take_the_forwarded_options_as_runner_serve_declares_them() -> None:
    serve = leaf_parser(["runner", "serve"])._option_string_actions
    for command in ("up", "demo"):
        actions = leaf_parser([command])._option_string_actions
        for option in FORWARDED_OPTIONS:
            mine, theirs = actions[option.flag], serve[option.flag]
            assert (mine.dest, mine.choices, mine.type, type(mine)) == (
                theirs.dest, theirs.choices, theirs.type, type(theirs)), (command, option.flag)
    assert {o.flag for o in RUNNER_OPTIONS} | {"--help"} <= set(serve) | {"--help"}
