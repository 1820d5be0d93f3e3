"""``warmserve cache ...``: run the kernel-cache daemon and use a store from the shell.

Commands::

    warmserve cache serve --root DIR [--store s3://BUCKET/PREFIX] [--port 50051] [--max-bytes N] [--auth-file F] [TLS flags]
                          [--max-streams N] [--publish-idle-timeout SECONDS]
    warmserve cache put NAME FINGERPRINT PATH   (--addr HOST:PORT | --root DIR) [--token-file F] [TLS flags]
    warmserve cache get NAME FINGERPRINT OUT    (--addr HOST:PORT | --root DIR)
    warmserve cache ls [PREFIX]                 (--addr HOST:PORT | --root DIR)
    warmserve cache stat                        (--addr HOST:PORT | --root DIR)
    warmserve cache evict [NAME [FINGERPRINT]] [--all]  (--addr | --root) [--token-file F] [TLS flags]
    warmserve cache explain [NAME FINGERPRINT] [--parts FILE] [--limit N] [--json]  (--addr | --root)

``--root`` uses an embedded store in that directory (no daemon); ``--addr`` talks to a daemon.
Neither given: the daemon at ``$WARMSERVE_KERNEL_CACHE_ADDR`` if set, else the embedded store at
the default root (``$WARMSERVE_HOME/kernel-cache``). Exit codes: 0 success, 2 bad usage or input
(a bad key, a missing PATH), 1 a failed operation (a MISS on ``get``, a REJECTED ``put``, an
unreachable daemon). ``explain`` prints which fingerprint parts of a key differ from the stored
entries of its name (``docs/architecture.md`` §5). Heavy modules are imported inside the handlers so the CLI starts fast.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from kernel_cache_service.explain import DEFAULT_NEAREST
from kernel_cache_service.fingerprint import UNKNOWN
from kernel_cache_service.keys import validate_key, validate_part, validate_prefix
from kernel_cache_service.limits import DEFAULT_PUBLISH_IDLE_S
from services.bootstrap import add_server_args, int_at_least, positive_seconds
from services.channel import add_client_security_args, client_security_from_args
from services.errors import FailedPrecondition, InvalidArgument, NotFound
from services.ports import DEFAULT_PORTS, KERNEL_CACHE
from services.table import format_table

ADDR_ENV = "WARMSERVE_KERNEL_CACHE_ADDR"


def register(subparsers) -> None:
    """Add the ``cache`` command group to the top-level ``warmserve`` parser."""
    cache = subparsers.add_parser("cache", help="kernel cache: compiled-program store and daemon")
    sub = cache.add_subparsers(dest="cache_command", metavar="CACHE_COMMAND", required=True)

    serve = sub.add_parser("serve", help="run the KernelCache gRPC daemon")
    serve.add_argument("--root", required=True, help="store directory (created if absent)")
    serve.add_argument("--max-bytes", type=int_at_least(0), default=0,
                       help="byte budget of --root, least recently used evicted first (0 = unlimited)")
    serve.add_argument("--store", default=None, metavar="s3://BUCKET/PREFIX",
                       help="share the programs through this S3 bucket, --root its local tier (AWS environment "
                            "for endpoint and credentials; docs/architecture.md section 6.1)")
    serve.add_argument("--publish-idle-timeout", type=positive_seconds, default=DEFAULT_PUBLISH_IDLE_S,
                       metavar="SECONDS", help="cancel a Publish whose client sends nothing for this long, freeing "
                                               f"its stream slot (default {DEFAULT_PUBLISH_IDLE_S:g})")
    add_server_args(serve, default_port=DEFAULT_PORTS[KERNEL_CACHE])
    serve.set_defaults(func=_cmd_serve)

    put = sub.add_parser("put", help="publish a file or a directory under NAME FINGERPRINT")
    put.add_argument("name")
    put.add_argument("fingerprint")
    put.add_argument("path", help="file or directory to publish")
    put.add_argument("--producer", default="", help="free text stored with the entry")
    _target_args(put)
    put.set_defaults(func=_cmd_put)

    get = sub.add_parser("get", help="fetch an entry to OUT (a file, or a directory for dir entries)")
    get.add_argument("name")
    get.add_argument("fingerprint")
    get.add_argument("out")
    _target_args(get)
    get.set_defaults(func=_cmd_get)

    ls = sub.add_parser("ls", help="list entries whose name starts with PREFIX")
    ls.add_argument("prefix", nargs="?", default="")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    _target_args(ls)
    ls.set_defaults(func=_cmd_ls)

    stat = sub.add_parser("stat", help="store totals and counters (JSON)")
    _target_args(stat)
    stat.set_defaults(func=_cmd_stat)

    evict = sub.add_parser("evict", help="remove one entry, every fingerprint of NAME, or --all")
    evict.add_argument("name", nargs="?", default=None)
    evict.add_argument("fingerprint", nargs="?", default=None)
    evict.add_argument("--all", action="store_true", help="evict every entry")
    _target_args(evict)
    evict.set_defaults(func=_cmd_evict)

    explain = sub.add_parser("explain", help="which fingerprint parts of a key differ from the stored entries of its name")
    explain.add_argument("name", nargs="?", default=None)
    explain.add_argument("fingerprint", nargs="?", default=None)
    explain.add_argument("--parts", default=None, metavar="FILE",
                         help="the key's fingerprint parts record (JSON; '-' reads stdin); default: the record a "
                              "runner of this home left beside its programs (HOME/programs/NAME-FP24.parts.json), "
                              "or the store's own entry")
    explain.add_argument("--limit", type=int_at_least(1), default=DEFAULT_NEAREST,
                         help=f"the nearest entries to show (default {DEFAULT_NEAREST})")
    explain.add_argument("--json", action="store_true", help="one JSON object")
    _target_args(explain)
    explain.set_defaults(func=_cmd_explain)


def _target_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--addr", default=None, help="daemon address HOST:PORT")
    group.add_argument("--root", default=None, help="embedded store directory (no daemon)")
    add_client_security_args(parser)


def _client(args, *, create: bool = False):
    """A client for the command's target. An embedded store is created only by a command that
    stores (``create``): a read-only command (or evict) on a directory that holds no store raises
    ``NotFound`` and creates nothing, so a typo in ``--root`` leaves no state behind."""
    from kernel_cache_service.client import KernelCacheClient
    from services.paths import default_kernel_cache_root

    address = args.addr or (None if args.root else os.environ.get(ADDR_ENV) or None)
    if address is not None:
        return KernelCacheClient(address, security=client_security_from_args(args))
    root = Path(args.root or default_kernel_cache_root()).expanduser()
    if not create and not (root / "entries").is_dir():
        raise NotFound(f"no kernel-cache store at {root}, so every key is a MISS (nothing was created there)")
    return KernelCacheClient(root=root)


def _cmd_serve(args) -> int:
    from kernel_cache_service.daemon import serve_from_args

    serve_from_args(args)
    return 0


def _cmd_put(args) -> int:
    if args.fingerprint == UNKNOWN:
        raise InvalidArgument("fingerprint UNKNOWN is never stored: compute a real program fingerprint")
    validate_key(args.name, args.fingerprint)
    if not (Path(args.path).is_file() or Path(args.path).is_dir()):  # before a store is created for it
        raise InvalidArgument(f"{args.path} is not a file or a directory")
    client = _client(args, create=True)
    try:
        result = client.publish_result(args.name, args.fingerprint, args.path, producer=args.producer)
    finally:
        client.close()
    if result.status == "REJECTED":
        raise FailedPrecondition(f"publish of {args.name}/{args.fingerprint} rejected: {result.reason}")
    print(f"{result.status} {args.name}/{args.fingerprint} {result.entry.size_bytes if result.entry else 0} bytes")
    return 0


def _cmd_get(args) -> int:
    validate_key(args.name, args.fingerprint)  # bad input first: exit 2, whatever the target
    client = _client(args)
    try:
        info = client.fetch(args.name, args.fingerprint, args.out)
    finally:
        client.close()
    if info is None:
        raise NotFound(f"no entry {args.name}/{args.fingerprint} (MISS)")
    print(f"{args.out} {info.size_bytes} bytes sha256={info.sha256} format={info.format}")
    return 0


def _cmd_ls(args) -> int:
    validate_prefix(args.prefix)
    client = _client(args)
    try:
        entries = client.list(args.prefix)
    finally:
        client.close()
    if args.json:
        for e in entries:
            print(json.dumps(e.to_dict()))
        return 0
    rows = [("NAME", "FINGERPRINT", "BYTES", "FORMAT", "LAST_ACCESS", "PRODUCER")]
    for e in entries:
        last = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(e.last_access))
        rows.append((e.name, e.fingerprint, str(e.size_bytes), e.format, last, e.producer))
    print(format_table(rows))
    return 0


def _cmd_stat(args) -> int:
    client = _client(args)
    try:
        stats = client.stat()
    finally:
        client.close()
    print(json.dumps(stats, indent=2, sort_keys=True))
    return 0


def _cmd_evict(args) -> int:
    if args.all and (args.name or args.fingerprint):
        raise InvalidArgument("--all takes no NAME or FINGERPRINT")
    if not args.all and not args.name:
        raise InvalidArgument("give NAME [FINGERPRINT], or --all")
    if args.name:
        validate_part(args.name, "name")
    if args.fingerprint:
        validate_part(args.fingerprint, "fingerprint")
    client = _client(args)
    try:
        count, freed = client.evict(args.name, args.fingerprint, all=args.all)
    finally:
        client.close()
    print(f"evicted {count} entries, freed {freed} bytes")
    return 0


def _read_parts(path: str) -> dict:
    """The parts record in file ``path`` (``-``: stdin); ``InvalidArgument`` when unreadable or
    not a parts record."""
    import sys

    from kernel_cache_service.fingerprint import parse_parts
    from kernel_cache_service.limits import MAX_PARTS_BYTES

    try:
        text = sys.stdin.read(MAX_PARTS_BYTES + 1) if path == "-" else Path(path).read_text()[:MAX_PARTS_BYTES + 1]
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"cannot read the parts record {path}: {getattr(e, 'strerror', None) or e}") from None
    if len(text) > MAX_PARTS_BYTES:
        raise InvalidArgument(f"{path} is over {MAX_PARTS_BYTES} bytes: not a parts record")
    try:
        return parse_parts(text, strict=False)
    except ValueError as e:
        raise InvalidArgument(f"{path}: {e}") from None


def _wanted_parts(args, client) -> tuple[str, str, dict | None]:
    """``(name, fingerprint, record)`` of the key to explain: from ``--parts`` (checked against
    NAME and FINGERPRINT when given), else the record a runner of this home left
    (:func:`~kernel_cache_service.explain.wanted_parts_path`), else the store's entry (``None``
    when the store holds the key but without a record). ``InvalidArgument`` when none is found."""
    from kernel_cache_service.explain import stored_record, wanted_parts_path
    from kernel_cache_service.fingerprint import fingerprint_of
    from services.paths import default_programs_dir

    path = args.parts
    if path is None:
        recorded = wanted_parts_path(default_programs_dir(), args.name, args.fingerprint)
        if not recorded.is_file():
            held = next((e for e in client.list(args.name, with_parts=True)
                         if e.name == args.name and e.fingerprint == args.fingerprint), None)
            if held is None:
                raise InvalidArgument(f"no fingerprint parts record for {args.name}/{args.fingerprint}: the store "
                                      f"does not hold the key and no runner of this home recorded it ({recorded}); "
                                      "pass --parts FILE")
            return args.name, args.fingerprint, stored_record(held)
        path = str(recorded)
    record = _read_parts(path)
    name, fp = record["name"], fingerprint_of(record)
    if args.name is not None and args.name != name:
        raise InvalidArgument(f"the parts record {path} is {name[:60]!r}'s, not {args.name!r}'s")
    if args.fingerprint is not None and args.fingerprint != fp:
        raise InvalidArgument(f"the parts record {path} has fingerprint {fp}, not {args.fingerprint}")
    validate_key(name, fp)
    return name, fp, record


def _cmd_explain(args) -> int:
    if args.parts is None and (args.name is None or args.fingerprint is None):
        raise InvalidArgument("give NAME FINGERPRINT, or --parts FILE (a key's fingerprint parts record)")
    if args.name is not None:
        validate_part(args.name, "name")
    if args.fingerprint is not None:
        validate_part(args.fingerprint, "fingerprint")
        if args.fingerprint == UNKNOWN:
            raise InvalidArgument("fingerprint UNKNOWN has no parts: some part of it could not be computed")
    client = _client(args)
    try:
        name, fp, wanted = _wanted_parts(args, client)
        explanation = client.explain(name, fp, wanted or {}, args.limit)
    finally:
        client.close()
    if args.json:
        print(json.dumps(explanation.to_dict(), sort_keys=True))
        return 0
    print(_explanation_text(explanation))
    return 0


def _explanation_text(e) -> str:
    """``cache explain``'s report: HIT, or each nearest entry with its differing parts
    (``part: stored -> wanted``) and the entries that carry no parts."""
    from kernel_cache_service.explain import show

    key = f"{e.name}/{e.fingerprint}"
    if e.hit:
        return f"HIT {key}: the store holds this key"
    if not e.nearest and not e.without_parts:
        return f"MISS {key}: the store holds no entry of {e.name}"
    lines = [f"MISS {key}; nearest entries of {e.name} (part: stored -> wanted):"]
    for n in e.nearest:
        created = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(n.entry.created))
        lines.append(f"  {n.entry.fingerprint} (created {created}, producer {n.entry.producer or '-'}): "
                     f"{len(n.differences)} part{' differs' if len(n.differences) == 1 else 's differ'}")
        lines += [f"    {d.path}: {show(d.stored, 100)} -> {show(d.wanted, 100)}" for d in n.differences]
    if e.without_parts:
        lines.append(f"  {len(e.without_parts)} entr{'y' if len(e.without_parts) == 1 else 'ies'} without fingerprint "
                     f"parts (published by an older warmserve): {', '.join(fp[:12] for fp in e.without_parts)}")
    return "\n".join(lines)
