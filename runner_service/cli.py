"""``warmserve runner ...``: the runner daemon's command line.

``warmserve runner serve --model SOURCE`` prepares (or fetches) the weight sidecar, builds the
engine (weights, compiled programs, KV cache, warm-up), and only then starts the ``Generation``
gRPC service, so health reports ``SERVING`` once the runner can actually generate.

Heavy imports (torch, the engine) happen inside the handler, never at import time.
"""

from __future__ import annotations

import argparse

from runner_service.config import COMPILE_MODES, DTYPES, WEIGHTS_DTYPES

DEFAULT_PORT = 50061


def register(subparsers) -> None:
    """Add ``runner serve`` to the ``warmserve`` parser."""
    from services.bootstrap import add_server_args, int_at_least

    positive_int = int_at_least(1)

    runner = subparsers.add_parser("runner", help="the data-plane runner (Generation service)")
    sub = runner.add_subparsers(dest="runner_command", metavar="SUBCOMMAND", required=True)

    serve = sub.add_parser("serve", help="serve a model over gRPC (Generation)")
    serve.add_argument("--model", required=True, help="model source: a GGUF file or an HF checkpoint dir")
    serve.add_argument("--weights", default=None, metavar="ADDR",
                       help="weight-sidecar service address; without it the runner prepares the sidecar itself")
    cache = serve.add_mutually_exclusive_group()
    cache.add_argument("--kernel-cache", default=None, metavar="ADDR", help="kernel-cache service address")
    cache.add_argument("--kernel-cache-dir", default=None, metavar="DIR", help="local kernel-cache directory")
    serve.add_argument("--kernel-cache-token-file", default=None, metavar="F",
                       help="file holding the bearer token of the kernel-cache service (one started with "
                            "--token-file needs it to publish and claim builds); --token-file is this runner's own")
    serve.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="compute and KV-cache dtype (default auto: bf16 on a CPU with AVX512-BF16 or AMX, "
                            "else f32)")
    serve.add_argument("--weights-dtype", choices=WEIGHTS_DTYPES, default="auto",
                       help="the weight sidecar's dtype; int4/int8 keep the weights quantized (default auto: the "
                            "checkpoint's own, int4 for a Q4_0/Q4_1 GGUF)")
    serve.add_argument("--compile", choices=COMPILE_MODES, default="aoti",
                       help="compiled decode and prefill programs, through the kernel cache (default aoti; "
                            "off: eager)")
    serve.add_argument("--compile-in-background", action=argparse.BooleanOptionalAction, default=True,
                       help="with --compile aoti: when the programs are not in the kernel cache, serve eager at "
                            "once and install them between two steps once fetched or built (lower CPU "
                            "priority); --no-compile-in-background waits for them before serving (default: on)")
    serve.add_argument("--build-lease-ttl", type=float, default=30.0, metavar="SECONDS",
                       help="TTL of the kernel-cache build lease this runner holds while it compiles a program "
                            "other runners wait for; a runner that dies loses it after this long (default 30)")
    serve.add_argument("--max-num-seqs", type=positive_int, default=32,
                       help="sequences decoded together at most (default 32)")
    serve.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                       help="tokens per scheduler step at most (default max(2048, max-model-len))")
    serve.add_argument("--max-model-len", type=positive_int, default=None,
                       help="context length in tokens (default: the model's, capped at 2048)")
    serve.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default 16)")
    serve.add_argument("--kv-cache-bytes", type=positive_int, default=None,
                       help="KV cache size in bytes (default: a fraction of free memory)")
    serve.add_argument("--sidecar-dir", default=None, metavar="DIR",
                       help="where sidecars are prepared or fetched to (default $WARMSERVE_HOME/sidecars)")
    serve.add_argument("--runner-id", default=None, help="name reported to clients and the router")
    serve.add_argument("--router", default=None, metavar="ADDR", help="register with this router")
    serve.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] | npu[:N] (default auto)")
    serve.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                       help="do not reuse KV blocks across requests that share a prompt prefix "
                            "(default: reuse them when the model family supports it)")
    serve.add_argument("--threads", type=positive_int, default=None,
                       help="CPU threads for torch ops (default: torch's choice)")
    add_server_args(serve, default_port=DEFAULT_PORT)
    serve.set_defaults(func=_serve)


def _serve(args) -> int:
    from runner_service.daemon import serve_from_args

    return serve_from_args(args)
