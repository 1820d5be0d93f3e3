"""``warmserve cache serve``: a :class:`~kernel_cache_service.store.KernelStore` (or, with
``--store s3://BUCKET/PREFIX``, an :class:`~kernel_cache_service.s3_store.S3KernelStore`: the
bucket behind ``--root`` as its local tier) behind the server bootstrap, run from the
command-line flags until SIGTERM/SIGINT drains it. A bad ``--store`` (malformed URL, unreachable
endpoint, missing bucket, denied access) fails before the server starts: ``InvalidArgument``,
exit 2."""

from __future__ import annotations

import logging

from kernel_cache_service.servicer import build_server
from kernel_cache_service.store import KernelStore
from services.bootstrap import config_from_args, ensure_bindable
from services.log import configure_logging

log = logging.getLogger(__name__)


def serve_from_args(args) -> None:
    """Entry point of ``warmserve cache serve``: run until SIGTERM/SIGINT, then drain."""
    configure_logging("kernel-cache", args.log_level)
    config = config_from_args(args, "kernel-cache")
    ensure_bindable(config)  # a busy port fails before the store is opened (and its root created)
    if getattr(args, "store", None):
        from kernel_cache_service.s3_store import S3KernelStore

        store = S3KernelStore.open_url(args.store, args.root, max_bytes=args.max_bytes)
    else:
        store = KernelStore(args.root, max_bytes=args.max_bytes)
    server = build_server(store, config, publish_idle_s=args.publish_idle_timeout)
    server.start()
    log.info("kernel cache ready", extra={"root": str(store.root), "max_bytes": store.max_bytes,
                                          "store": getattr(store, "url", str(store.root)),
                                          "address": server.address, "swept": store.swept})
    server.serve_forever()
