"""The ``warmserve`` command line.

Each package contributes its subcommands through a ``register(subparsers)`` function in its own
``cli`` module (listed in :data:`COMMAND_MODULES`), so this file stays a dispatcher. Those modules
import heavy dependencies (torch, the engine) inside their handlers, never at import time, so
``warmserve cache ls`` does not pay for importing torch.

Exit codes: 0 success; 2 bad usage or input (argparse, :class:`services.errors.InvalidArgument`);
1 a failed operation (any other :class:`services.errors.WarmserveError`, or an ``OSError``
such as a busy port); 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from services.errors import run_command
from services.procs import die_with_parent

COMMAND_MODULES = (
    "kernel_cache_service.cli",
    "weight_service.cli",
    "runner_service.cli",
    "router_service.cli",
    "kserve_service.cli",
    "openai_service.cli",
    "warmserve.stack_cli",
    "warmserve.keys_cli",
)


def build_parser() -> argparse.ArgumentParser:
    """The full parser; every subcommand sets ``func(args) -> int``."""
    parser = argparse.ArgumentParser(
        prog="warmserve",
        description="warmserve: LLM serving with warm launches and host-cheap decode.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; returns the process exit code."""
    die_with_parent()  # a child of `warmserve up`: stop when it does
    parser = build_parser()
    args = parser.parse_args(argv)
    args.cli_argv = list(sys.argv[1:] if argv is None else argv)  # what a runner zygote is handed
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
