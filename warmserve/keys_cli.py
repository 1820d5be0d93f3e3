"""``warmserve keys new --out DIR --name NAME``: an Ed25519 signing key pair for a publisher
(a runner, the weight service, a builder): ``DIR/NAME.key`` (PKCS8 PEM, mode 0600, never
overwritten) and ``DIR/NAME.pub``, which goes into the verifiers' ``--trusted-keys`` directory
(``docs/security.md``, "Signed artifacts")."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    """Add ``keys new`` to the ``warmserve`` dispatcher."""
    keys = subparsers.add_parser("keys", help="signing keys for programs and sidecars")
    ksub = keys.add_subparsers(dest="keys_command", metavar="SUBCOMMAND", required=True)
    new = ksub.add_parser("new", help="write a new Ed25519 key pair: DIR/NAME.key (0600) and DIR/NAME.pub")
    new.add_argument("--out", required=True, metavar="DIR", help="directory for the two files (created 0700)")
    new.add_argument("--name", required=True, help="file name stem, e.g. runner-0 or weights")
    new.set_defaults(func=_new)


def _new(args: argparse.Namespace) -> int:
    from pathlib import Path

    from services.errors import InvalidArgument
    from services.fsmode import check_private_dir
    from services.signing import SigningKey

    if not args.name or "/" in args.name or args.name.startswith("."):
        raise InvalidArgument(f"--name must be a plain file name stem, got {args.name!r}")
    out = Path(args.out).expanduser().resolve()
    if out.exists():  # a directory another user can change could have the key swapped under us
        check_private_dir(out, "the key directory")
    else:
        out.mkdir(parents=True, mode=0o700)
    key = SigningKey.generate()
    key_path, pub_path = key.write(out, args.name)
    print(f"{key_path} (private, keep it with its publisher)\n{pub_path} (public, key id {key.key_id}: "
          "put it in the verifiers' --trusted-keys directory)")
    return 0
