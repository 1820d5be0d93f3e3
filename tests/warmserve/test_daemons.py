"""Every daemon's ``serve`` honours the bootstrap's common flags; here ``--log-level``."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from services.bootstrap import ServiceServer
from warmserve.cli import build_parser


@pytest.fixture
def root_logger():
    """The root logger, with its handlers and level put back after the test."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("command", [
    ["cache", "serve", "--root", "{tmp}"],
    ["weights", "serve", "--root", "{tmp}"],
    ["router", "serve"],
])
@pytest.mark.parametrize("level", ["WARNING", "DEBUG"])
def test_serve_honours_log_level(command: list[str], level: str, tmp_path: Path, root_logger,
                                 monkeypatch) -> None:
    served = []
    # Stop at once instead of serving until a signal.
    monkeypatch.setattr(ServiceServer, "serve_forever", lambda self: served.append(self) or self.stop())
    argv = [a.format(tmp=tmp_path) for a in command] + ["--port", "0", "--log-level", level]
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    assert len(served) == 1
    assert root_logger.level == getattr(logging, level)
