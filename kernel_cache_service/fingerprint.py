"""Program fingerprints: the key half that says *which* compiled program an artifact is.

A program fingerprint (``docs/architecture.md``, "Program fingerprint") is the sha256 of two parts:

- the **code fingerprint**: for every source module/file, the sha256 of its canonical AST
  (``ast.dump`` without line/column attributes, so formatting and comments do not matter; a file
  that does not parse falls back to its raw bytes), plus the Python ``major.minor``, torch and
  warmserve versions;
- the **params fingerprint**: program name, platform (machine, OS, vector ISA, device type and,
  on Linux, a digest of the CPU flags, since Inductor builds with ``-march=native``), layout
  dims (batch bucket, block size, max blocks per sequence, ...), model architecture config, dtype
  and compile options, serialised as canonical JSON (sorted keys, no NaN/inf).

Any part that cannot be computed (an unreadable source, a ``None`` value, a value JSON cannot
represent, a missing package version) makes the whole fingerprint :data:`UNKNOWN`. The store
never stores an ``UNKNOWN`` key and a lookup of one is always a MISS, so an incomplete key can
never hand back a program built for something else.

Every fingerprint returned here is 64 lowercase hex characters or :data:`UNKNOWN`. torch is
imported only by :func:`detect_platform` (and only when the caller does not pass ``platform``).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import inspect
import json
import math
import platform as _platform
import sys
import types
from collections.abc import Iterable, Mapping
from pathlib import Path

UNKNOWN = "UNKNOWN"

#: Bumped when the way fingerprints are computed changes, so old entries stop matching.
FINGERPRINT_SCHEMA = 1

Source = str | Path | types.ModuleType


class _Unknown(Exception):
    """Internal: some part of a fingerprint cannot be computed."""


def _sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _source_bytes(source: Source) -> bytes:
    if isinstance(source, types.ModuleType):
        try:
            path = inspect.getsourcefile(source)
        except TypeError:  # built-in or frozen module: no source file
            path = None
        if path is None:
            raise _Unknown(f"module {source.__name__} has no source file")
        source = path
    if not isinstance(source, str | Path):
        raise _Unknown(f"unsupported source {source!r}")
    try:
        return Path(source).read_bytes()
    except OSError as e:
        raise _Unknown(f"cannot read {source}: {e}") from e


def source_digest(data: bytes) -> str:
    """sha256 (hex) of one source file's canonical form.

    The canonical form is ``ast.dump(ast.parse(data), include_attributes=False)`` with the
    docstrings of the module, its classes and functions left out: two files that differ only in
    whitespace, line breaks, comments, docstrings or quoting style give the same digest (a
    documentation edit does not recompile programs). A file with a syntax error is hashed as raw
    bytes (tagged so it cannot collide with an AST).
    """
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError):
        return _sha256_hex(b"raw\0" + data)
    _strip_docstrings(tree)
    return _sha256_hex(b"ast\0" + ast.dump(tree, annotate_fields=True, include_attributes=False).encode())


def _strip_docstrings(tree: ast.AST) -> None:
    """Drop the leading string-constant statement of every module, class and function body
    (an emptied body gets ``pass``), in place."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]


def _torch_version() -> str:
    torch = sys.modules.get("torch")
    version = getattr(torch, "__version__", None) if torch is not None else None
    return str(version) if version else importlib.metadata.version("torch")


def _package_version() -> str:
    return importlib.metadata.version("warmserve")


def code_fingerprint(
    sources: Iterable[Source] | Source,
    *,
    package_version: str | None = None,
    torch_version: str | None = None,
    python_version: str | None = None,
) -> str:
    """Hex sha256 of the canonical ASTs of ``sources`` plus the Python, torch and warmserve versions.

    ``sources`` are module objects or paths of ``.py`` files; their order does not matter. The
    versions default to the running interpreter (``major.minor``), the installed torch and the
    installed warmserve distribution; pass them to fingerprint for another environment.
    Returns :data:`UNKNOWN` when there are no sources, any source cannot be read, or a version
    cannot be found.
    """
    if isinstance(sources, str | Path | types.ModuleType):
        sources = [sources]
    try:
        digests = sorted(source_digest(_source_bytes(s)) for s in sources)
        if not digests:
            raise _Unknown("no sources")
        doc = {
            "schema": FINGERPRINT_SCHEMA,
            "python": python_version or f"{sys.version_info.major}.{sys.version_info.minor}",
            "torch": torch_version or _torch_version(),
            "warmserve": package_version or _package_version(),
            "sources": digests,
        }
    except (_Unknown, importlib.metadata.PackageNotFoundError):
        return UNKNOWN
    return _sha256_hex(json.dumps(doc, sort_keys=True).encode())


def _cpu_flags_digest() -> str | None:
    """First 16 hex chars of sha256 of the sorted CPU ``flags`` (Linux ``/proc/cpuinfo``), or None."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return _sha256_hex(" ".join(sorted(value.split())).encode())[:16]
    return None


def detect_platform() -> dict:
    """The platform part of a params fingerprint for this process.

    Keys: ``machine`` (``x86_64``), ``system`` (``Linux``), ``isa`` (torch's CPU capability:
    ``AVX512``, ``AVX2``, ``DEFAULT``...), ``device`` (``cpu``, ``cuda`` or ``npu``), ``cpu_flags``
    (digest, when readable) and, for accelerators, the device name and capability. Imports torch.
    """
    import torch

    info: dict = {
        "machine": _platform.machine(),
        "system": _platform.system(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "device": "cpu",
    }
    flags = _cpu_flags_digest()
    if flags is not None:
        info["cpu_flags"] = flags
    if torch.cuda.is_available():
        info["device"] = "cuda"
        info["device_name"] = torch.cuda.get_device_name(0)
        info["device_capability"] = list(torch.cuda.get_device_capability(0))
        info["cuda"] = torch.version.cuda
    elif getattr(torch, "npu", None) is not None and torch.npu.is_available():  # torch_npu loaded
        info["device"] = "npu"
        info["device_name"] = torch.npu.get_device_name(0)
    return info


def _canonical(value, where: str):
    """``value`` as plain JSON types, or raise ``_Unknown`` (``None``, NaN/inf, odd objects)."""
    if value is None:
        raise _Unknown(f"{where} is None")
    if isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _Unknown(f"{where} is {value}")
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise _Unknown(f"{where} has a non-string key {k!r}")
            out[k] = _canonical(v, f"{where}.{k}")
        return out
    if isinstance(value, list | tuple):
        return [_canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value).removeprefix("torch.")
    raise _Unknown(f"{where} has unsupported type {type(value).__name__}")


def params_fingerprint(
    *,
    name: str,
    platform: dict | None = None,
    layout: dict,
    arch: dict,
    dtype: str,
    compile_options: dict,
) -> str:
    """Hex sha256 of the canonical JSON of the program's parameters.

    ``name``: program name (``"llama.decode"``); ``platform``: see :func:`detect_platform`
    (detected when ``None``); ``layout``: dims such as ``{"batch_bucket": 8, "block_size": 16,
    "max_blocks_per_seq": 64}``; ``arch``: the model architecture config (hidden size, layers,
    heads, ...); ``dtype``: ``"bfloat16"`` (a ``torch.dtype`` is accepted and named without the
    ``torch.`` prefix); ``compile_options``: backend, mode and flags. Returns :data:`UNKNOWN` when
    any value, at any depth, is ``None``, a non-finite float or not JSON-representable.
    """
    try:
        if not isinstance(name, str) or not name:
            raise _Unknown("program name must be a non-empty string")
        doc = {
            "schema": FINGERPRINT_SCHEMA,
            "name": name,
            "platform": _canonical(detect_platform() if platform is None else platform, "platform"),
            "layout": _canonical(layout, "layout"),
            "arch": _canonical(arch, "arch"),
            "dtype": _canonical(dtype, "dtype"),
            "compile_options": _canonical(compile_options, "compile_options"),
        }
    except (_Unknown, ImportError):
        return UNKNOWN
    return _sha256_hex(json.dumps(doc, sort_keys=True, allow_nan=False).encode())


def combine(code_fp: str, params_fp: str) -> str:
    """The program fingerprint of a code and a params fingerprint; :data:`UNKNOWN` if either is."""
    if UNKNOWN in (code_fp, params_fp):
        return UNKNOWN
    return _sha256_hex(f"program\0{code_fp}\0{params_fp}".encode())


def program_fingerprint(
    name: str,
    *,
    sources: Iterable[Source] | Source,
    layout: dict,
    arch: dict,
    dtype: str,
    compile_options: dict,
    platform: dict | None = None,
    package_version: str | None = None,
    torch_version: str | None = None,
) -> str:
    """The full key for program ``name``: :func:`combine` of :func:`code_fingerprint` and
    :func:`params_fingerprint` (64 hex chars), or :data:`UNKNOWN` if either part is unknown."""
    code_fp = code_fingerprint(sources, package_version=package_version, torch_version=torch_version)
    params_fp = params_fingerprint(
        name=name, platform=platform, layout=layout, arch=arch, dtype=dtype, compile_options=compile_options
    )
    return combine(code_fp, params_fp)
