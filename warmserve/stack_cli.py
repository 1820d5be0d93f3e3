"""``warmserve up | generate | chat | status | demo``: the local stack and its clients.

``up`` starts kernel-cache, weights, N runners, the router and the OpenAI-compatible HTTP door as
child processes (:class:`warmserve.stack.LocalStack`); ``generate``/``chat`` stream text from a
Generation endpoint (the router by default); ``status`` shows the router's runners and the health
of each service; ``demo`` is the main job (``make run``). Heavy imports happen inside the handlers.
"""

from __future__ import annotations

import argparse

from router_service.config import DEFAULT_POLICY, POLICY_NAMES
from runner_service.options import add_forwarded_options
from services.bootstrap import positive_seconds
from services.channel import add_client_security_args, client_security_from_args
from services.ports import DEFAULT_BASE_PORT, DEFAULT_ROUTER
from weight_service.sources import BUNDLED_SMOLLM2

DEFAULT_MODEL = BUNDLED_SMOLLM2


def _add_stack_args(p: argparse.ArgumentParser, *, runners: int, base_port: int, home_help: str,
                    runner_defaults: dict[str, object] | None = None) -> None:
    p.add_argument("--runners", type=int, default=runners, help=f"number of runners (default {runners})")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model source (default {DEFAULT_MODEL}, bundled)")
    p.add_argument("--base-port", type=int, default=base_port,
                   help=f"router port, the others above it (docs/architecture.md §1); 0 = free ports "
                        f"(default {base_port})")
    p.add_argument("--home", default=None, help=home_help)
    add_forwarded_options(p, runner_defaults)
    p.add_argument("--policy", choices=POLICY_NAMES, default=DEFAULT_POLICY,
                   help=f"router policy (default {DEFAULT_POLICY})")
    p.add_argument("--no-runner-zygote", dest="runner_zygote", action="store_false",
                   help="launch each runner as a fresh interpreter, not forked from the stack's runner zygote")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr", default=DEFAULT_ROUTER, help=f"Generation endpoint (default {DEFAULT_ROUTER})")
    # Unset sampling flags stay unset on the wire: the runner applies the model's defaults
    # (its generation_config.json), else its own.
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens to generate at most (default: the model's max_new_tokens, else the runner's)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy; default: the model's generation_config.json, else greedy")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling, 0 = off; default: the model's, else off")
    p.add_argument("--top-k", type=int, default=None, help="0 = off; default: the model's, else off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--timeout", type=positive_seconds, default=120.0,
                   help="request deadline in seconds, > 0 (default 120)")
    add_client_security_args(p)


def _security(args: argparse.Namespace, home: str | None = None):
    """``--token-file``/``$WARMSERVE_TOKEN`` and the TLS flags, else the ``client`` token of the
    ``warmserve up`` in ``home`` (default ``$WARMSERVE_HOME``) when ``--addr`` is its router."""
    from pathlib import Path

    from services.channel import ClientSecurity
    from services.paths import warmserve_home
    from warmserve.stack_auth import cli_security

    tls = client_security_from_args(args).tls
    token = cli_security(args.token_file, args.addr, Path(home).expanduser() if home else warmserve_home()).token
    return ClientSecurity(token=token, tls=tls)


def register(subparsers) -> None:
    """Add ``up``, ``generate``, ``chat``, ``status`` and ``demo`` to the ``warmserve`` parser."""
    up = subparsers.add_parser("up", help="start the whole stack locally until Ctrl-C")
    _add_stack_args(up, runners=2, base_port=DEFAULT_BASE_PORT,
                    home_help="state directory (default $WARMSERVE_HOME, else ~/.cache/warmserve)")
    up.add_argument("--openai-port", type=int, default=None,
                    help="port of the OpenAI-compatible HTTP API (default: base port + 3; 0 = a free port)")
    up.add_argument("--no-openai", dest="openai", action="store_false",
                    help="do not start the OpenAI-compatible HTTP API")
    up.add_argument("--served-model-name", default=None, metavar="NAME",
                    help="the model name both doors publish (default: derived from the model source)")
    up.add_argument("--tls", action="store_true",
                    help="mTLS everywhere: a throw-away CA and certificate in HOME/tls/ for every daemon and door")
    up.add_argument("--store", default=None, metavar="s3://BUCKET/PREFIX",
                    help="share programs and sidecars with other hosts through this S3 bucket (AWS environment "
                         "for endpoint and credentials)")
    up.set_defaults(func=_up)

    gen = subparsers.add_parser("generate", help="stream a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="send plain text, without the chat template")
    gen.add_argument("--allow-special-tokens", action="store_true",
                     help="with --raw: special-token text in the prompt (e.g. <|im_end|>) is the control token")
    gen.add_argument("--system", default=None, help="system message (chat mode)")
    _add_sampling_args(gen)
    gen.set_defaults(func=_generate)

    from warmserve.chat import CHAT_COMMANDS

    chat = subparsers.add_parser(
        "chat", help="interactive chat (reads stdin, keeps history)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands (a line that is one of these):\n" + "".join(f"  {c:<8} {what}\n"
                                                                   for c, what in CHAT_COMMANDS.items()))
    chat.add_argument("--system", default=None, help="system message")
    _add_sampling_args(chat)
    chat.set_defaults(func=_chat)

    status = subparsers.add_parser("status", help="runners, leases, load and service health")
    status.add_argument("--addr", default=DEFAULT_ROUTER, help=f"router address (default {DEFAULT_ROUTER})")
    status.add_argument("--service", action="append", default=[], metavar="NAME=ADDR",
                        help="another service to health-check (repeatable), e.g. weights=127.0.0.1:50052")
    status.add_argument("--home", default=None,
                        help="report the services and restarts of the `warmserve up` of this home too "
                             "(default $WARMSERVE_HOME)")
    add_client_security_args(status)
    status.set_defaults(func=_status)

    demo = subparsers.add_parser("demo", help="the main job: stack up, chat through the router, reports")
    # The demo shows what a warm launch saves, so it compiles (AOTInductor): the cold launch
    # builds the program and publishes it to the kernel cache, the warm one loads it.
    _add_stack_args(demo, runners=1, base_port=0, runner_defaults={"compile": "aoti", "max_num_seqs": 8},
                    home_help="state directory, kept for the next (warm) run (default $WARMSERVE_HOME)")
    demo.add_argument("--fresh", action="store_true",
                      help="a deliberately cold run: a new temporary home, removed at the end")
    demo.add_argument("--max-tokens", type=int, default=64, help="tokens per answer at most (default 64)")
    demo.set_defaults(func=_demo)


def _stack_config(args: argparse.Namespace):
    from warmserve.stack_config import StackConfig

    return StackConfig.from_args(args)


def _up(args: argparse.Namespace) -> int:
    from warmserve.up import run_up

    return run_up(_stack_config(args))


def _sampling(args: argparse.Namespace):
    from services.generation_client import sampling_params

    return sampling_params(max_tokens=args.max_tokens, temperature=args.temperature,
                           top_p=args.top_p, top_k=args.top_k, seed=args.seed)


class _Streamed:
    """A text stream that remembers whether anything was written to it (``wrote``)."""

    def __init__(self, out) -> None:
        self._out, self.wrote = out, False

    def write(self, text: str) -> int:
        self.wrote = self.wrote or bool(text)
        return self._out.write(text)

    def flush(self) -> None:
        self._out.flush()


def _generate(args: argparse.Namespace) -> int:
    import sys

    import grpc

    from services.errors import WarmserveError
    from services.generation_client import GenerationClient, chat_request, text_request

    if args.allow_special_tokens and not args.raw:
        print("warmserve: error: --allow-special-tokens needs --raw (chat messages are always plain text)",
              file=sys.stderr)
        return 2
    if args.raw:
        request = text_request(args.prompt, _sampling(args), allow_special_tokens=args.allow_special_tokens)
    else:
        # an empty --system is a system message too: it replaces the template's default one
        messages = ([("system", args.system)] if args.system is not None else []) + [("user", args.prompt)]
        request = chat_request(messages, _sampling(args))
    out = _Streamed(sys.stdout)
    with GenerationClient(args.addr, fail_fast=True, security=_security(args)) as client:
        try:
            result = client.stream_to(request, out, timeout_s=args.timeout)
        except WarmserveError as e:
            if out.wrote:
                print(flush=True)  # end the streamed line before the error goes to stderr
            cause = e.__cause__
            if isinstance(cause, grpc.RpcError) and cause.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise WarmserveError(f"timed out after {args.timeout:g} s (--timeout)") from e
            raise
    print()
    print(result.summary(), file=sys.stderr)
    return 0


def _chat(args: argparse.Namespace) -> int:
    import sys

    from services.generation_client import GenerationClient
    from warmserve.chat import interactive_chat

    with GenerationClient(args.addr, fail_fast=True, security=_security(args)) as client:
        return interactive_chat(client, _sampling(args), system=args.system, timeout_s=args.timeout,
                                stdin=sys.stdin, stdout=sys.stdout)


def _status(args: argparse.Namespace) -> int:
    import sys

    from warmserve.stack_report import print_status

    services = {}
    for item in args.service:
        name, sep, addr = item.partition("=")
        if not sep or not name or not addr:
            from services.errors import InvalidArgument

            raise InvalidArgument(f"--service wants NAME=ADDR, got {item!r}")
        services[name] = addr
    from pathlib import Path

    from services.address import parse_address
    from services.paths import warmserve_home
    from warmserve.stack_state import read_state, stack_services

    parse_address(args.addr, what="--addr")
    home = Path(args.home).expanduser() if args.home else warmserve_home()
    own = stack_services(home, args.addr)
    if args.home and not own:
        print(f"note: no running `warmserve up` with home {home} serves the router at {args.addr}; showing that "
              "router alone", file=sys.stderr)
    services = {**own, **services}  # a running `up`'s own, then --service
    code = print_status(args.addr, services, out=sys.stdout, restarts=read_state(home, args.addr),
                        security=_security(args, args.home))
    if code:
        print(f"warmserve: error: no router answers at {args.addr} (is `warmserve up` running?)", file=sys.stderr)
    return code


def _demo(args: argparse.Namespace) -> int:
    from warmserve.demo import run_demo

    if args.fresh and args.home:
        from services.errors import InvalidArgument

        raise InvalidArgument("--fresh uses a new temporary home: give --fresh or --home, not both")
    return run_demo(_stack_config(args), max_tokens=args.max_tokens, fresh=args.fresh)
