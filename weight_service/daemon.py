"""``warmserve weights serve``: the sidecars under a root directory behind the server bootstrap,
run from the command-line flags until SIGTERM/SIGINT drains it."""

from __future__ import annotations

from pathlib import Path

from services.bootstrap import config_from_args, ensure_bindable
from services.log import configure_logging
from services.paths import default_sidecar_root
from weight_service.servicer import build_server


def serve_from_args(args) -> None:
    """Entry point of ``warmserve weights serve``: run until SIGTERM/SIGINT, then drain."""
    configure_logging("weights", args.log_level)
    root = Path(args.root).expanduser() if args.root else default_sidecar_root()
    config = config_from_args(args, "weights")
    ensure_bindable(config)  # a busy port fails before the sidecar root is touched
    server = build_server(config, root)
    server.serve_forever()
