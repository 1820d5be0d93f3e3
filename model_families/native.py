"""warmserve's own C++ kernels (``model_families/kernels/*.cpp``), built once with the host's C++
compiler against torch's headers and loaded as op libraries: ``torch.ops.warmserve.int4_mm_tiles``
(the int4 weight-only matmul of :mod:`model_families.quantized_weights`, ``docs/quantization.md``)
and ``torch.ops.warmserve.decode_attention`` (:mod:`model_families.attention`).

A build is keyed by its :func:`fingerprint` (the source, the compile command, torch's version) and
published whole: compiled to a private temporary name, then one
``os.replace`` under a lock file, so concurrent processes (test workers, a fleet's runners) build it
once and never load a partial file. It lives in ``model_families/kernels/build/`` (what ``make
install`` fills, and a container image ships) or, where the package is read-only, in
``~/.cache/warmserve/native/``. Where nothing can be built or loaded (no compiler, a CPU without
AVX512-BF16, resp. AVX-512) :func:`int4_tiles_enabled` (:func:`decode_attention_enabled`) is false
and the runner uses PyTorch's int4 kernel (the attention written in torch ops).

Run ``python -m model_families.native`` to build (and print where), as ``make install`` does.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from filelock import FileLock

_log = logging.getLogger(__name__)

#: The kernel sources, next to this module.
SOURCE_DIR = Path(__file__).resolve().parent / "kernels"
INT4_TILES_SOURCE = SOURCE_DIR / "int4_tiles.cpp"
DECODE_ATTENTION_SOURCE = SOURCE_DIR / "decode_attention.cpp"
SOURCES = (INT4_TILES_SOURCE, DECODE_ATTENTION_SOURCE)
#: Set to ``0`` to leave the native kernels unused (the runner then runs PyTorch's int4 kernel and
#: the attention written in torch ops); read when weights load and when a step is traced, so A/B
#: runs and tests can switch per process. Part of the program key (it changes the traced code).
DISABLE_ENV = "WARMSERVE_NATIVE_KERNELS"
#: Seconds one build may take before it is given up (a first build takes about 10 s), and how long
#: a process waits for another's build of the same source (longer: that build may just be ending).
BUILD_TIMEOUT_S = 300.0
LOCK_TIMEOUT_S = 2 * BUILD_TIMEOUT_S


def _compiler() -> str:
    """The C++ compiler: ``$CXX`` (as Inductor reads it) or ``g++``."""
    return os.environ.get("CXX") or "g++"


def compile_command(source: Path, output: Path) -> list[str]:
    """The command that builds ``source`` into the shared library ``output``: optimised, OpenMP
    (torch's ``at::parallel_for`` is inline OpenMP; the library resolves ``libgomp.so.1`` to the
    copy torch loaded), torch's include paths and C++ ABI, linked against ``c10`` and
    ``torch_cpu`` with torch's ``lib`` directory as its run path."""
    from torch.utils import cpp_extension

    lib = Path(torch.__file__).resolve().parent / "lib"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    return [_compiler(), "-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *includes, str(source),
            "-o", str(output), f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]


def fingerprint(source: Path) -> str:
    """16 hex digits over the source bytes, :func:`compile_command` (output path aside: the
    compiler's name, the flags, torch's include paths and ABI) and torch's version. The compiler's
    own binary is not in it: a launch that finds a build never looks for a compiler."""
    h = hashlib.sha256(source.read_bytes())
    for part in (*compile_command(source, Path("out.so")), torch.__version__):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


@functools.cache
def source_digests() -> dict[str, str]:
    """``{file name: sha256 of its bytes}`` of :data:`SOURCES` (part of a program's key: a program
    calls the ops by name, and what an op computes is its source)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in SOURCES}


def build_dirs() -> list[Path]:
    """Where a built library is looked for and put, in order: the package's ``kernels/build/``,
    then ``~/.cache/warmserve/native/`` (a read-only install)."""
    return [SOURCE_DIR / "build", Path.home() / ".cache" / "warmserve" / "native"]


def _writable(d: Path) -> bool:
    """Whether builds can be put in ``d`` (made if missing: readable by all in the package, where a
    container's other user loads what its image built; private to this user elsewhere)."""
    try:
        d.mkdir(mode=0o755 if d == SOURCE_DIR / "build" else 0o700, parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(d, os.W_OK | os.X_OK) and _trusted(d)


def _trusted(path: Path) -> bool:
    """Whether ``path`` (a build or its directory) may be loaded from: not a symbolic link, owned by
    this user or root, writable by no one else. A library found elsewhere is not loaded (another
    user could have put it there) and is built again where it can be trusted."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (not stat.S_ISLNK(st.st_mode) and st.st_uid in (0, os.geteuid())
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def build(source: Path = INT4_TILES_SOURCE) -> Path:
    """The built library of ``source`` (built now unless a build with its :func:`fingerprint` is
    there). Raises ``RuntimeError`` naming the reason when there is no compiler, no writable build
    directory, or the compile fails (with the compiler's last output lines)."""
    name = f"{source.stem}-{fingerprint(source)}.so"
    for d in build_dirs():
        if (d / name).is_file() and _trusted(d) and _trusted(d / name):
            return d / name
    if shutil.which(_compiler()) is None:
        raise RuntimeError(f"no C++ compiler ({_compiler()}) on PATH")
    d = next((d for d in build_dirs() if _writable(d)), None)
    if d is None:
        raise RuntimeError(f"no writable directory among {', '.join(map(str, build_dirs()))}")
    target = d / name
    with FileLock(str(d / f"{source.stem}.lock"), timeout=LOCK_TIMEOUT_S):
        if target.is_file() and _trusted(target):  # another process built it while this one waited
            return target
        fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{source.stem}-", suffix=".so")
        os.close(fd)
        try:
            done = subprocess.run(compile_command(source, Path(tmp)), capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
                raise RuntimeError(f"{_compiler()} failed to build {source.name} (exit {done.returncode}):\n{tail}")
            os.chmod(tmp, 0o755)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


@functools.cache
def load() -> bool:
    """Build (if needed) and load the kernel libraries of :data:`SOURCES` once per process:
    whether their ops are registered. A failure is logged once as a warning and leaves PyTorch's
    kernels in use."""
    try:
        for source in SOURCES:
            torch.ops.load_library(str(build(source)))
    except Exception as e:  # noqa: BLE001 - any failure means: serve with PyTorch's kernels
        _log.warning("warmserve's native kernels are unavailable, using PyTorch's: %s", e)
        return False
    return True


@functools.cache
def _supported(op: str) -> bool:
    return load() and bool(getattr(torch.ops.warmserve, op)())


def _enabled(op: str) -> bool:
    return os.environ.get(DISABLE_ENV, "1") != "0" and _supported(op)


def int4_tiles_enabled() -> bool:
    """Whether int4 matrices for bf16 compute use ``warmserve::int4_mm_tiles``: the libraries
    load, this CPU has AVX512-BF16, and :data:`DISABLE_ENV` is not ``0``."""
    return _enabled("int4_tiles_supported")


def int8_activations_enabled() -> bool:
    """Whether ``warmserve::int4_mm_tiles_a8`` / ``int8_mm_tiles_a8`` (int8 activations,
    ``--quantized-activations int8``) run here: as :func:`int4_tiles_enabled`, and the CPU has
    AVX512-VNNI."""
    return _enabled("int8_activations_supported")


def decode_attention_enabled() -> bool:
    """Whether decode steps run ``warmserve::decode_attention``: the libraries load, this CPU has
    AVX-512 (F, BW, VL, DQ), and :data:`DISABLE_ENV` is not ``0``."""
    return _enabled("decode_attention_supported")


def main() -> int:
    """``python -m model_families.native``: build the kernels and print where (exit 1 on failure)."""
    try:
        for source in SOURCES:
            print(build(source))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(f"native kernels not built: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
