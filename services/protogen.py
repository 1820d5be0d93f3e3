"""Regenerate the Python gRPC stubs under ``services/proto/`` from ``protos/warmserve/v1`` and
from Triton's vendored KServe v2 protos in ``third_party/triton``.

``protoc`` writes ``from warmserve.v1 import x_pb2`` for cross-file imports; the stubs live in the
``services.proto.warmserve.v1`` package, so those imports are rewritten to absolute package
imports. Triton's ``grpc_service.proto`` (package ``inference``) imports ``model_config.proto``
from its own directory, for which ``protoc`` writes a top-level ``import model_config_pb2``; its
stubs go to the ``services.proto.triton`` package and that import becomes
``from services.proto.triton import model_config_pb2``. :func:`generate` is used by ``make proto``
and by the test that checks the committed stubs are current.

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
#: Triton's own protos, vendored unmodified (``third_party/triton/README.md`` says from where).
TRITON_PROTO_ROOT = REPO / "third_party" / "triton"
#: The sub-package of :data:`PACKAGE` (and directory under the stub root) of Triton's stubs.
TRITON_PACKAGE = "triton"


def proto_files() -> list[Path]:
    """All ``.proto`` files of the ``warmserve.v1`` package, sorted by path."""
    return sorted((PROTO_ROOT / "warmserve" / "v1").glob("*.proto"))


def triton_proto_files() -> list[Path]:
    """The vendored Triton protos (``grpc_service.proto``, ``model_config.proto``), sorted by path."""
    return sorted(TRITON_PROTO_ROOT.glob("*.proto"))


def _protoc(args: list[str]) -> None:
    from grpc_tools import protoc  # dev/test dependency only

    if protoc.main(["protoc", *args]) != 0:
        raise RuntimeError("protoc failed; see the messages above")


def generate(out_dir: Path = STUB_ROOT) -> list[Path]:
    """Run ``grpc_tools.protoc`` for every proto (warmserve's and Triton's) into ``out_dir`` and
    fix imports.

    Returns the generated ``.py``/``.pyi`` files (``__init__.py`` files not included). Raises
    ``RuntimeError`` when protoc fails.
    """
    import grpc_tools

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    _protoc([
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ])
    generated = sorted((out_dir / "warmserve" / "v1").glob("*.py*"))
    pattern = re.compile(r"^from warmserve\.v1 import", re.MULTILINE)
    for path in generated:
        text = path.read_text()
        path.write_text(pattern.sub(f"from {PACKAGE}.warmserve.v1 import", text))
    for pkg in (out_dir / "warmserve", out_dir / "warmserve" / "v1"):
        (pkg / "__init__.py").write_text("")
    return generated + _generate_triton(out_dir, include)


def _generate_triton(out_dir: Path, include: Path) -> list[Path]:
    """Triton's stubs into ``out_dir/triton``; ``import x_pb2 as y`` (a sibling module, as protoc
    writes it for a proto in the same include root) becomes an absolute package import."""
    triton_dir = out_dir / TRITON_PACKAGE
    triton_dir.mkdir(parents=True, exist_ok=True)
    _protoc([
        f"-I{TRITON_PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={triton_dir}",
        f"--pyi_out={triton_dir}",
        f"--grpc_python_out={triton_dir}",
        *[p.name for p in triton_proto_files()],
    ])
    siblings = "|".join(re.escape(p.stem) for p in triton_proto_files())
    pattern = re.compile(rf"^import ({siblings})_pb2 as", re.MULTILINE)
    generated = sorted(p for p in triton_dir.glob("*.py*") if p.name != "__init__.py")
    for path in generated:
        text = path.read_text()
        path.write_text(pattern.sub(rf"from {PACKAGE}.{TRITON_PACKAGE} import \1_pb2 as", text))
    (triton_dir / "__init__.py").write_text(
        '"""Generated stubs of Triton\'s vendored KServe v2 protos (``third_party/triton``; '
        '``make proto``)."""\n')
    return generated


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else STUB_ROOT
    for f in generate(target):
        print(f.relative_to(target))
