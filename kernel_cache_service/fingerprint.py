"""Program fingerprints: the key half that says *which* compiled program an artifact is.

A program fingerprint (``docs/architecture.md`` §5) is the sha256 of the program's **parts
record** (:func:`program_parts`), a JSON object of plain values, one key per part
(:data:`PARTS`):

- code: ``sources`` (for every source module/file, the sha256 of its canonical AST: ``ast.dump``
  without line/column attributes and docstrings, so formatting and comments do not matter; a
  file that does not parse falls back to its raw bytes), ``python`` (``major.minor``), ``torch``
  and ``warmserve`` versions;
- params: ``name``, ``platform`` (machine, OS, vector ISA, device type and, on Linux, a digest of
  the CPU flags, since Inductor builds with ``-march=native``), ``layout`` (batch bucket, block
  size, max blocks per sequence, ...), ``arch`` (model architecture config), ``dtype`` and
  ``compile_options``; and ``schema`` (:data:`FINGERPRINT_SCHEMA`).

The digest is computed from the record alone (:func:`fingerprint_of`: sha256 of its canonical
JSON), so a store can keep the record beside the entry, check it against the key, and
``warmserve cache explain`` can say which part of two keys differs.

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
import threading
import types
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path

UNKNOWN = "UNKNOWN"

#: Bumped when the way fingerprints are computed changes, so old entries stop matching.
FINGERPRINT_SCHEMA = 2
#: The parts of a program's parts record, in order: what :func:`program_parts` returns and a
#: store accepts (:func:`parse_parts`); ``sources`` maps each module to its :func:`source_digest`.
PARTS = ("schema", "name", "python", "torch", "warmserve", "sources", "platform", "layout", "arch", "dtype",
         "compile_options")
#: A dict or list value of a params part whose canonical JSON is longer (bytes) is kept as its
#: digest in the record (:func:`params_parts`), which keeps records far below a store's limit.
MAX_VALUE_BYTES = 2048
#: Parts records :func:`program_fingerprint` remembers (by fingerprint) for :func:`known_parts`.
_KNOWN_MAX = 64
_KNOWN: OrderedDict[str, str] = OrderedDict()
_KNOWN_LOCK = threading.Lock()
_HEX = frozenset("0123456789abcdef")
#: sha256 of a source file's bytes -> its :func:`source_digest`, for this process: the canonical
#: form is pure Python (tens of ms a key), and a key computed in a background thread would hold
#: the GIL that long against the stepping thread. A changed file has other bytes, so another entry.
_DIGESTS: dict[str, str] = {}
_DIGESTS_MAX = 4096

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
    bytes (tagged so it cannot collide with an AST). Remembered per content in this process.
    """
    raw = _sha256_hex(data)
    digest = _DIGESTS.get(raw)
    if digest is None:
        digest = _canonical_digest(data)
        if len(_DIGESTS) < _DIGESTS_MAX:
            _DIGESTS[raw] = digest
    return digest


def _canonical_digest(data: bytes) -> str:
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


def source_labels(sources: Iterable[Source]) -> dict[str, str]:
    """Each source's name in a parts record -> its :func:`source_digest`: a module's
    ``__name__``, a file's name (``a.py``), never a directory, so a relocated checkout or home
    gives the same record; names shared by several sources get ``#2``, ``#3``... in the order of
    their digests, so the order of ``sources`` does not matter. Raises ``_Unknown`` (internal)
    for a source that cannot be read."""
    named = []
    for s in sources:
        digest = source_digest(_source_bytes(s))  # raises for anything but a module or a path
        named.append((s.__name__ if isinstance(s, types.ModuleType) else Path(s).name, digest))
    named.sort()
    out: dict[str, str] = {}
    for base, digest in named:
        label, n = base, 1
        while label in out:
            n += 1
            label = f"{base}#{n}"
        out[label] = digest
    return out


def code_parts(
    sources: Iterable[Source] | Source,
    *,
    package_version: str | None = None,
    torch_version: str | None = None,
    python_version: str | None = None,
) -> dict:
    """The code half of a parts record: ``python`` (``major.minor``), ``torch``, ``warmserve``
    (versions, default this interpreter's and the installed ones) and ``sources``
    (:func:`source_labels`: name -> digest of each module or ``.py`` file). Raises
    ``_Unknown`` (internal) when there are no sources, one cannot be read, or a version cannot
    be found."""
    if isinstance(sources, str | Path | types.ModuleType):
        sources = [sources]
    digests = source_labels(sources)
    if not digests:
        raise _Unknown("no sources")
    try:
        return {
            "python": python_version or f"{sys.version_info.major}.{sys.version_info.minor}",
            "torch": torch_version or _torch_version(),
            "warmserve": package_version or _package_version(),
            "sources": dict(sorted(digests.items())),
        }
    except importlib.metadata.PackageNotFoundError as e:
        raise _Unknown(f"no version of {e}") from e


def code_fingerprint(
    sources: Iterable[Source] | Source,
    *,
    package_version: str | None = None,
    torch_version: str | None = None,
    python_version: str | None = None,
) -> str:
    """Hex sha256 of :func:`code_parts` (the code half of a program's parts: sources and versions),
    for comparing code alone; :data:`UNKNOWN` when it cannot be computed. The program key is
    :func:`program_fingerprint`, the digest of the whole parts record."""
    try:
        parts = code_parts(sources, package_version=package_version, torch_version=torch_version,
                           python_version=python_version)
    except _Unknown:
        return UNKNOWN
    return _digest({"schema": FINGERPRINT_SCHEMA, **parts})


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


def _bounded(value, limit: int):
    """``value`` (canonical JSON types) with every dict or list whose canonical JSON is over
    ``limit`` bytes, deepest first, replaced by ``{"sha256": hex, "bytes": n}`` of that JSON:
    the record stays small (a map of hundreds of weight names becomes one digest) and still
    changes whenever the value does."""
    if isinstance(value, dict):
        value = {k: _bounded(v, limit) for k, v in value.items()}
    elif isinstance(value, list):
        value = [_bounded(v, limit) for v in value]
    else:
        return value
    text = canonical_json(value)
    if len(text) > limit:
        return {"sha256": _sha256_hex(text.encode()), "bytes": len(text)}
    return value


def params_parts(
    *,
    name: str,
    platform: dict | None = None,
    layout: dict,
    arch: dict,
    dtype: str,
    compile_options: dict,
) -> dict:
    """The params half of a parts record: ``name``, ``platform`` (:func:`detect_platform` when
    ``None``), ``layout``, ``arch``, ``dtype`` (a ``torch.dtype`` is named without ``torch.``),
    ``compile_options``, as canonical JSON values, each container over
    :data:`MAX_VALUE_BYTES` bytes of JSON replaced by its digest. Raises ``_Unknown`` (internal)
    for an empty name or any value, at any depth, that is ``None``, non-finite or not
    JSON-representable."""
    if not isinstance(name, str) or not name:
        raise _Unknown("program name must be a non-empty string")
    try:
        detected = detect_platform() if platform is None else platform
    except ImportError as e:
        raise _Unknown(f"cannot detect the platform: {e}") from e
    values = {"platform": detected, "layout": layout, "arch": arch, "dtype": dtype,
              "compile_options": compile_options}
    return {"name": name, **{k: _bounded(_canonical(v, k), MAX_VALUE_BYTES) for k, v in values.items()}}


def params_fingerprint(
    *,
    name: str,
    platform: dict | None = None,
    layout: dict,
    arch: dict,
    dtype: str,
    compile_options: dict,
) -> str:
    """Hex sha256 of :func:`params_parts` (the params half of a program's parts), for comparing
    parameters alone; :data:`UNKNOWN` when any value, at any depth, is ``None``, a non-finite
    float or not JSON-representable.

    ``name``: program name (``"llama.decode"``); ``platform``: see :func:`detect_platform`
    (detected when ``None``); ``layout``: dims such as ``{"batch_bucket": 8, "block_size": 16,
    "max_blocks_per_seq": 64}``; ``arch``: the model architecture config (hidden size, layers,
    heads, ...); ``dtype``: ``"bfloat16"``; ``compile_options``: backend, mode and flags."""
    try:
        parts = params_parts(name=name, platform=platform, layout=layout, arch=arch, dtype=dtype,
                             compile_options=compile_options)
    except _Unknown:
        return UNKNOWN
    return _digest({"schema": FINGERPRINT_SCHEMA, **parts})


def program_parts(
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
    python_version: str | None = None,
) -> dict | None:
    """The parts record of program ``name``: ``{"schema": FINGERPRINT_SCHEMA}`` with
    :func:`code_parts` and :func:`params_parts` (the keys are :data:`PARTS`), or ``None`` when any
    part cannot be computed. Its :func:`fingerprint_of` is the program's key."""
    try:
        code = code_parts(sources, package_version=package_version, torch_version=torch_version,
                          python_version=python_version)
        params = params_parts(name=name, platform=platform, layout=layout, arch=arch, dtype=dtype,
                              compile_options=compile_options)
    except _Unknown:
        return None
    return {"schema": FINGERPRINT_SCHEMA, **code, **params}


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
    """The key of program ``name``: :func:`fingerprint_of` its :func:`program_parts` (64 hex
    chars), or :data:`UNKNOWN` when a part is unknown. The record is remembered
    (:func:`known_parts`), so a publish of this key in this process carries it."""
    parts = program_parts(name, sources=sources, layout=layout, arch=arch, dtype=dtype,
                          compile_options=compile_options, platform=platform,
                          package_version=package_version, torch_version=torch_version)
    if parts is None:
        return UNKNOWN
    fp = fingerprint_of(parts)
    with _KNOWN_LOCK:
        _KNOWN[fp] = canonical_json(parts)
        _KNOWN.move_to_end(fp)
        while len(_KNOWN) > _KNOWN_MAX:
            _KNOWN.popitem(last=False)
    return fp


# ---------------------------------------------------------------- parts records

def canonical_json(value) -> str:
    """Compact JSON with sorted keys, ASCII only, no NaN/inf: the one text of a value."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _digest(doc: dict) -> str:
    return _sha256_hex(canonical_json(doc).encode())


def fingerprint_of(parts: Mapping) -> str:
    """The fingerprint of a parts record: hex sha256 of its :func:`canonical_json`. Every byte of
    the record counts, so a record and its fingerprint cannot disagree, and a signature over
    the fingerprint covers the record."""
    return _digest(dict(parts))


def known_parts(fingerprint: str) -> str:
    """The canonical parts record (JSON text) of ``fingerprint`` if :func:`program_fingerprint`
    computed it in this process (the last :data:`_KNOWN_MAX` keys), else ``""``."""
    with _KNOWN_LOCK:
        return _KNOWN.get(fingerprint, "")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number a fingerprint part can hold")


def parse_parts(text: str | bytes, *, strict: bool = True) -> dict:
    """A parts record from its JSON ``text``. Raises ``ValueError`` (one sentence) unless it is a
    JSON object of plain values (no ``null``, NaN or infinity) with an integer ``schema``, a
    non-empty string ``name`` and a ``sources`` object of label -> 64 lowercase hex digits.
    ``strict`` (what a store accepts): a record of schema :data:`FINGERPRINT_SCHEMA` must have
    exactly the keys :data:`PARTS`, with non-empty string versions and ``dtype`` (a record of
    another schema, from another warmserve version, is checked for the shape above only: its
    digest still binds it to its key); not strict (what an explanation reads): any keys.
    """
    try:
        doc = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("the parts record is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise ValueError(f"the parts record is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError("the parts record must be a JSON object")
    try:
        _canonical(doc, "parts")
    except RecursionError:
        raise ValueError("the parts record is nested too deeply") from None
    except _Unknown as e:
        raise ValueError(f"the parts record cannot be a fingerprint's: {e}") from None
    schema, name, sources = doc.get("schema"), doc.get("name"), doc.get("sources")
    if not isinstance(schema, int) or isinstance(schema, bool):
        raise ValueError("the parts record needs an integer schema")
    if not isinstance(name, str) or not name:
        raise ValueError("the parts record needs a non-empty string name")
    if not isinstance(sources, dict) or not sources or not all(
            isinstance(v, str) and len(v) == 64 and _HEX.issuperset(v) for v in sources.values()):
        raise ValueError("the parts record's sources must map each module to 64 lowercase hex digits")
    if strict and schema == FINGERPRINT_SCHEMA:
        if set(doc) != set(PARTS):
            missing, extra = sorted(set(PARTS) - set(doc)), sorted(set(doc) - set(PARTS))
            raise ValueError(f"the parts record must have exactly the parts {', '.join(PARTS)} "
                             f"(missing {missing or 'none'}, unknown {extra or 'none'})")
        bad = [k for k in ("python", "torch", "warmserve", "dtype") if not isinstance(doc[k], str) or not doc[k]]
        if bad:
            raise ValueError(f"the parts record's {', '.join(bad)} must be non-empty strings")
    return doc
