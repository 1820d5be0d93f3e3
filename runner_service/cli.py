"""``warmserve runner serve``: the runner daemon's command line.

It prepares (or fetches) the weight sidecar, builds the engine and only then starts the
``Generation`` service, so health says ``SERVING`` once the runner can generate. Its flags are
declared in :mod:`runner_service.options`; heavy imports happen inside the handler.
"""

from __future__ import annotations

from runner_service.options import add_serve_options
from services.ports import DEFAULT_PORTS, RUNNER


def register(subparsers) -> None:
    """Add ``runner serve`` and ``runner zygote`` to the ``warmserve`` parser."""
    from services.bootstrap import add_log_level_arg, add_server_args

    runner = subparsers.add_parser("runner", help="the data-plane runner (Generation service)")
    sub = runner.add_subparsers(dest="runner_command", metavar="SUBCOMMAND", required=True)
    serve = sub.add_parser("serve", help="serve a model over gRPC (Generation)")
    add_serve_options(serve)
    add_server_args(serve, default_port=DEFAULT_PORTS[RUNNER])
    serve.set_defaults(func=_serve)
    zygote = sub.add_parser("zygote", help="a pre-started runner process: `runner serve --zygote PATH` launches "
                                           "fork from it, without an interpreter start or imports")
    zygote.add_argument("--socket", required=True, metavar="PATH",
                        help="the Unix socket it serves launches on, in a directory of this user's that only it "
                             "can enter (0700; made if missing)")
    add_log_level_arg(zygote)
    zygote.set_defaults(func=_zygote)


def _serve(args) -> int:
    if args.zygote:  # hand everything but --zygote to the zygote, then stand in for the runner it forks
        from runner_service.zygote import launch, without_zygote_flag

        return launch(args.zygote, without_zygote_flag(args.cli_argv))
    from runner_service.daemon import serve_from_args

    return serve_from_args(args)


def _zygote(args) -> int:
    from runner_service.zygote import serve_zygote
    from services.log import configure_logging

    configure_logging("runner-zygote", args.log_level)
    return serve_zygote(args.socket)
