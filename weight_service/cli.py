"""``warmserve weights serve`` and ``warmserve prepack``.

Heavy modules (torch, gguf, the packer) are imported inside the handlers so the CLI starts fast.
"""

from __future__ import annotations

import argparse
import sys

from services.ports import DEFAULT_PORTS, WEIGHTS


def register(subparsers) -> None:
    """Add ``weights serve`` and ``prepack`` to the ``warmserve`` dispatcher."""
    from model_families.dtypes import WEIGHTS_DTYPE_CHOICES as DTYPE_CHOICES
    from services.bootstrap import add_server_args, int_at_least
    from services.signing import add_signing_args
    from weight_service.prepare_pool import DEFAULT_PREPARE_WORKERS

    weights = subparsers.add_parser("weights", help="the weight-sidecar service")
    wsub = weights.add_subparsers(dest="weights_command", metavar="SUBCOMMAND", required=True)
    serve = wsub.add_parser("serve", help="run the Weights gRPC daemon")
    serve.add_argument("--root", default=None, help="sidecar directory (default $WARMSERVE_HOME/sidecars)")
    serve.add_argument("--store", default=None, metavar="s3://BUCKET/PREFIX",
                       help="share sidecars through this S3 bucket: upload those packed here, fetch those missing "
                            "(AWS environment for endpoint and credentials)")
    serve.add_argument("--model-root", action="append", default=[], metavar="DIR",
                       help="serve checkpoints under DIR (repeatable); the bundled smollm2-135m-instruct is always "
                            "served, any other source is refused")
    serve.add_argument("--prepare-workers", type=int_at_least(1), default=DEFAULT_PREPARE_WORKERS, metavar="N",
                       help=f"Prepares packing at once; more wait for a worker (default {DEFAULT_PREPARE_WORKERS})")
    add_server_args(serve, default_port=DEFAULT_PORTS[WEIGHTS])
    add_signing_args(serve, verify=False)
    serve.set_defaults(func=_serve)

    prepack = subparsers.add_parser("prepack", help="pack a checkpoint into a runner-ready weight sidecar")
    prepack.add_argument("source", metavar="SOURCE",
                         help="a safetensors directory, a .gguf file, or smollm2-135m-instruct")
    prepack.add_argument("--weights-dtype", "--dtype", dest="dtype", choices=DTYPE_CHOICES, default="auto",
                         help="packed weights dtype; int4/int8 stay quantized (default auto: the checkpoint's own)")
    prepack.add_argument("--out", default=None, help="sidecar root directory (default $WARMSERVE_HOME/sidecars)")
    prepack.add_argument("--force", action="store_true", help="repack even when a valid sidecar exists")
    prepack.add_argument("--cold-policy", choices=("accept", "reject"), default="accept",
                         help="what to do with a valid sidecar that is not in the page cache")
    prepack.set_defaults(func=_prepack)


def _serve(args: argparse.Namespace) -> int:
    from weight_service.daemon import serve_from_args

    serve_from_args(args)
    return 0


def _prepack(args: argparse.Namespace) -> int:
    from pathlib import Path

    from weight_service.prepare import prepare
    from weight_service.progress import ProgressBar

    root = Path(args.out).expanduser() if args.out else None
    bar = ProgressBar(sys.stderr)
    try:
        handle = prepare(args.source, dtype=args.dtype, root=root, force=args.force,
                         cold_policy=args.cold_policy, progress=bar.update)
    finally:
        bar.finish()
    residency = "unknown" if handle.residency is None else f"{handle.residency:.2f}"
    print(f"{handle.state} {handle.path} fingerprint={handle.fingerprint[:16]} "
          f"bytes={handle.size_bytes} residency={residency} seconds={handle.seconds:.2f}")
    return 0
