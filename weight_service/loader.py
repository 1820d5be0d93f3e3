"""Map a sidecar for a runner: read-only, shared, zero-copy.

The weights file is mapped once with ``mmap(PROT_READ, MAP_SHARED)`` (Python's
``mmap.ACCESS_READ``) and every tensor is a ``torch.frombuffer`` view into that mapping: no byte
is copied or read until used, and N runner processes on one host share one copy in the page
cache. The views are read-only: writing to one faults (SIGSEGV), so runners must treat them as
constants (copy first, or upload to the accelerator and drop the host references).
"""

from __future__ import annotations

import mmap
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.signing import TrustedKeys
from weight_service.manifest import verify_sidecar
from weight_service.sidecar import ST_DTYPES, TORCH_DTYPES, WEIGHTS_FILE, validate_sidecar


@dataclass
class LoadedSidecar:
    """A mapped sidecar.

    ``tensors``: packed name -> CPU tensor view (dtype and shape per the family's layout for the
    sidecar's weights dtype, e.g. ``layers.qkv_proj`` float32 ``[L, (nh + 2*nkv)*hd, H]``, or
    ``layers.qkv_proj.qweight`` uint8 ``[L, (nh + 2*nkv)*hd, H/2]`` in an int4 sidecar);
    ``weights_dtype``: the sidecar's (``f32``, ``bf16``, ``int8``, ``int4``); ``config``: the architecture
    config dict; ``metadata``: the safetensors ``__metadata__`` (all ``str``); ``path``: the
    sidecar directory; ``trust``: what was verified (a phrase for the start-up report).
    """

    tensors: dict[str, torch.Tensor]
    config: dict
    metadata: dict[str, str]
    path: Path
    weights_dtype: str = "f32"
    trust: str = "artifacts not verified"
    _mapping: mmap.mmap | None = field(default=None, repr=False)

    def close(self) -> None:
        """Drop the tensor views and unmap. If the caller still holds a view, the mapping stays
        alive until that view is garbage-collected (unmapping under it would crash)."""
        self.tensors = {}
        if self._mapping is not None:
            try:
                self._mapping.close()
            except BufferError:
                pass  # views still exported; the mapping is released with the last one
            self._mapping = None

    def __enter__(self) -> LoadedSidecar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_sidecar(path: Path, trusted: TrustedKeys | None = None) -> LoadedSidecar:
    """Validate the sidecar directory ``path`` (header, fingerprint consistency, names, dtypes,
    shapes, size; see :func:`weight_service.sidecar.validate_sidecar`), with ``trusted`` check
    its signed manifest (:func:`weight_service.manifest.verify_sidecar`), and only then map it.

    Raises ``services.errors.FailedPrecondition`` (:class:`~weight_service.sidecar.InvalidSidecar`)
    with the reason when it is invalid, ``services.errors.Untrusted`` when its manifest, signature
    or bytes fail the check (nothing is mapped).
    """
    info = validate_sidecar(Path(path))
    trust = "artifacts not verified" if trusted is None else verify_sidecar(info, trusted)
    with open(Path(path) / WEIGHTS_FILE, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    tensors: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable: that is the point of a read-only mapping.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        for name, e in info.tensors.items():
            dtype = TORCH_DTYPES[e.dtype]
            count = (e.end - e.begin) // ST_DTYPES[dtype][1]
            t = torch.frombuffer(mapping, dtype=dtype, count=count, offset=info.data_start + e.begin)
            tensors[name] = t.view(e.shape)
    return LoadedSidecar(tensors=tensors, config=info.config.to_dict(), metadata=info.metadata,
                         path=Path(path), weights_dtype=info.dtype, trust=trust, _mapping=mapping)
