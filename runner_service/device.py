"""Device selection: ``cpu``, ``cuda`` or ``npu`` (Ascend, via ``torch_npu``).

``torch_npu`` is imported only when it is installed (``importlib.util.find_spec``), so a CPU or
CUDA host never pays for it; CUDA is probed through ``torch.cuda`` which needs no extra import.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

from services.errors import InvalidArgument

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """``"f32"`` -> ``torch.float32``, ``"bf16"`` -> ``torch.bfloat16``; else ``InvalidArgument``."""
    try:
        return DTYPES[name]
    except KeyError as e:
        raise InvalidArgument(f"dtype must be one of {tuple(DTYPES)}, got {name!r}") from e


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively: AVX512-BF16 or AMX-BF16 (as PyTorch's CPU
    capability probe reports them)."""
    try:
        caps = torch._C._cpu._get_cpu_capability()
    except (AttributeError, RuntimeError):  # an older or non-x86 build: be conservative
        return False
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def resolve_dtype(name: str, device: torch.device) -> str:
    """The compute dtype for ``--dtype name`` on ``device``: ``f32``/``bf16`` as given; ``auto``
    is bf16 on a CPU with AVX512-BF16 or AMX (:func:`cpu_has_fast_bf16`) and on a CUDA device
    that supports it, f32 elsewhere. Raises ``InvalidArgument`` for any other name."""
    if name != "auto":
        torch_dtype(name)
        return name
    if device.type == "cpu":
        return "bf16" if cpu_has_fast_bf16() else "f32"
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "f32"
    return "f32"


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    importlib.import_module("torch_npu")  # registers the "npu" device with torch
    return bool(getattr(torch, "npu", None)) and torch.npu.is_available()


def select_device(name: str = "auto") -> torch.device:
    """Resolve ``name`` (``auto``, ``cpu``, ``cuda[:N]``, ``npu[:N]``) to a ``torch.device``.

    ``auto`` prefers CUDA, then NPU, then CPU. Raises ``InvalidArgument`` for an unknown name or
    a device that is not present.
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if _npu_available():
            return torch.device("npu", 0)
        return torch.device("cpu")
    kind = name.split(":", 1)[0]
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgument("device cuda was asked for but CUDA is not available")
        return torch.device(name)
    if kind == "npu":
        if not _npu_available():
            raise InvalidArgument("device npu was asked for but torch_npu is not installed or has no device")
        return torch.device(name)
    raise InvalidArgument(f"unknown device {name!r} (expected auto, cpu, cuda[:N] or npu[:N])")


def free_memory_bytes(device: torch.device) -> int:
    """Free memory on ``device`` in bytes: the accelerator's free memory, or the host's
    ``MemAvailable`` (``/proc/meminfo``; physical pages times page size elsewhere)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "npu":
        free, _total = torch.npu.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (no-op on CPU); used around timings."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)
