"""Regenerate the Python gRPC stubs under ``services/proto/`` from ``protos/warmserve/v1``.

``protoc`` writes ``from warmserve.v1 import x_pb2`` for cross-file imports; the stubs live in the
``services.proto.warmserve.v1`` package, so those imports are rewritten to absolute package
imports. :func:`generate` is used by ``make proto`` and by the test that checks the committed
stubs are current.

Run: ``python -m services.protogen [OUT_DIR]`` (default: the committed location).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"
STUB_ROOT = REPO / "services" / "proto"
PACKAGE = "services.proto"


def proto_files() -> list[Path]:
    """All ``.proto`` files of the ``warmserve.v1`` package, sorted by path."""
    return sorted((PROTO_ROOT / "warmserve" / "v1").glob("*.proto"))


def generate(out_dir: Path = STUB_ROOT) -> list[Path]:
    """Run ``grpc_tools.protoc`` for every proto into ``out_dir`` and fix imports.

    Returns the generated ``.py``/``.pyi`` files. Raises ``RuntimeError`` when protoc fails.
    """
    import grpc_tools
    from grpc_tools import protoc  # dev/test dependency only

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed; see the messages above")
    generated = sorted((out_dir / "warmserve" / "v1").glob("*.py*"))
    pattern = re.compile(r"^from warmserve\.v1 import", re.MULTILINE)
    for path in generated:
        text = path.read_text()
        path.write_text(pattern.sub(f"from {PACKAGE}.warmserve.v1 import", text))
    for pkg in (out_dir / "warmserve", out_dir / "warmserve" / "v1"):
        (pkg / "__init__.py").write_text("")
    return generated


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else STUB_ROOT
    for f in generate(target):
        print(f.relative_to(target))
