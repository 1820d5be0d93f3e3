"""Checks that a ``warmserve`` command line (from compose.yaml, deploy/k8s/ or the local stack)
uses only real options, each spelled in full, with a value the real parser accepts."""

from __future__ import annotations

import argparse
import contextlib
import io

from warmserve.cli import build_parser


def leaf_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)parser that reads ``argv``'s options: ``runner serve``'s for ``runner serve ...``."""
    parser, words = build_parser(), list(argv)
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None:
            return parser
        name = next(w for w in words if w in sub.choices)
        words = words[words.index(name) + 1:]
        parser = sub.choices[name]


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed by the real parser; ``AssertionError`` naming the problem when a flag is not
    one of the command's options spelled in full (argparse would take an abbreviation) or a value
    is refused (a bad choice or type: argparse's message is quoted)."""
    flags = {w.split("=", 1)[0] for w in argv if w.startswith("--")}
    unknown = sorted(flags - set(leaf_parser(argv)._option_string_actions))
    assert not unknown, f"{unknown} are not options of `warmserve {' '.join(argv[:2])}`"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return build_parser().parse_args(argv)
        except SystemExit:
            raise AssertionError(f"warmserve refuses {argv}: {err.getvalue().strip()}") from None


#: The credential, TLS and health flags compose.yaml and deploy/k8s pass (each takes a value).
CREDENTIAL_FLAGS = ("--auth-file", "--token-file", "--tls-cert", "--tls-key", "--tls-ca", "--tls-server-name",
                    "--health-port", "--signing-key", "--trusted-keys", "--api-key-file", "--router-tls-ca")


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value given to ``flag`` in ``argv`` (the last one), or ``None``."""
    values = [argv[i + 1] for i, w in enumerate(argv[:-1]) if w == flag]
    return values[-1] if values else None
