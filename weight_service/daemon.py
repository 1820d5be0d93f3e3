"""``warmserve weights serve``: the sidecars under a root directory behind the server bootstrap,
run from the command-line flags until SIGTERM/SIGINT drains it, serving the bundled model and
the checkpoints under its ``--model-root`` directories only (:mod:`weight_service.model_roots`);
with ``--store s3://BUCKET/PREFIX`` they are shared through that bucket
(:mod:`weight_service.s3_sidecars`). A bad ``--store``
(malformed URL, unreachable endpoint, missing bucket, denied access) fails before the server
starts: ``InvalidArgument``, exit 2."""

from __future__ import annotations

import logging
from pathlib import Path

from services.bootstrap import config_from_args, ensure_bindable
from services.log import configure_logging
from services.paths import default_sidecar_root
from weight_service.servicer import build_server

log = logging.getLogger(__name__)


def serve_from_args(args) -> None:
    """Entry point of ``warmserve weights serve``: run until SIGTERM/SIGINT, then drain."""
    configure_logging("weights", args.log_level)
    root = Path(args.root).expanduser() if args.root else default_sidecar_root()
    config = config_from_args(args, "weights")
    ensure_bindable(config)  # a busy port fails before the sidecar root is touched
    remote = None
    if getattr(args, "store", None):
        from weight_service.s3_sidecars import RemoteSidecars

        remote = RemoteSidecars.open_url(args.store)  # a bad --store: InvalidArgument (exit 2) before serving
    server = build_server(config, root, remote, model_roots=args.model_root, prepare_workers=args.prepare_workers)
    server.start()
    log.info("weights ready", extra={"address": server.address, "root": str(root),
                                     "model_roots": [str(Path(r).expanduser()) for r in args.model_root]})
    server.serve_forever()
