"""``warmserve cache serve``: a :class:`~kernel_cache_service.store.KernelStore` behind the
server bootstrap, run from the command-line flags until SIGTERM/SIGINT drains it."""

from __future__ import annotations

import logging

from kernel_cache_service.servicer import PROTECTED_METHODS, build_server
from kernel_cache_service.store import KernelStore
from services.bootstrap import config_from_args
from services.errors import Unavailable
from services.log import configure_logging

log = logging.getLogger(__name__)


def serve_from_args(args) -> None:
    """Entry point of ``warmserve cache serve``: run until SIGTERM/SIGINT, then drain."""
    configure_logging("kernel-cache", args.log_level)
    store = KernelStore(args.root, max_bytes=args.max_bytes)
    config = config_from_args(args, "kernel-cache", PROTECTED_METHODS)
    server = build_server(store, config)
    try:
        server.start()
    except OSError as e:
        raise Unavailable(f"cannot serve on {config.host}:{config.port}: {e}") from e
    log.info("kernel cache ready", extra={"root": str(store.root), "max_bytes": store.max_bytes,
                                          "address": server.address, "swept": store.swept})
    server.serve_forever()
