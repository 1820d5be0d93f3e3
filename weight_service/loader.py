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
from collections.abc import Iterable
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

    def release_unused(self, keep: Iterable[torch.Tensor]) -> int:
        """Drop from this process's resident set every whole page of the mapping that no tensor
        of ``keep`` lies on (``madvise(MADV_DONTNEED)``): the bytes a runner read once to
        convert (int4 codes into the kernel's layout, f32 into bf16) stop counting in its RSS.
        The file and the page cache are untouched, so a page read again faults back in with the
        same bytes. Returns the bytes released (0 when nothing is mapped or the platform has no
        ``madvise``)."""
        if self._mapping is None or not hasattr(self._mapping, "madvise"):
            return 0
        size = len(self._mapping)
        base = torch.frombuffer(self._mapping, dtype=torch.uint8, count=1).data_ptr()
        spans = sorted((max(st.data_ptr() - base, 0), min(st.data_ptr() - base + st.nbytes(), size))
                       for st in (t.untyped_storage() for t in keep)
                       if st.data_ptr() - base < size and st.data_ptr() - base + st.nbytes() > 0)
        released, pos = 0, 0
        for begin, end in [*spans, (size, size)]:
            released += self._drop_pages(pos, begin)  # whole pages strictly between kept spans
            pos = max(pos, end)
        return released

    def _drop_pages(self, begin: int, end: int) -> int:
        """``madvise(MADV_DONTNEED)`` the whole pages within mapping offsets ``[begin, end)``;
        returns their bytes."""
        page = mmap.PAGESIZE
        lo, hi = -(-begin // page) * page, end // page * page
        if hi <= lo:
            return 0
        self._mapping.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        return hi - lo

    def release(self, tensors: Iterable[torch.Tensor]) -> int:
        """Drop from this process's resident set every whole page of the mapping that lies inside
        the storage of one of ``tensors`` (``madvise(MADV_DONTNEED)``): for a mapped tensor the
        runner keeps but reads only a few rows of at a time (an embedding table whose head is
        multiplied from another copy). The tensors stay valid: a page read again faults back in
        from the page cache with the same bytes. Pages a storage shares with its neighbours stay;
        a storage outside the mapping is skipped. Returns the bytes of the ranges advised,
        resident or not (0 when nothing is mapped or the platform has no ``madvise``)."""
        if self._mapping is None or not hasattr(self._mapping, "madvise"):
            return 0
        size = len(self._mapping)
        base = torch.frombuffer(self._mapping, dtype=torch.uint8, count=1).data_ptr()
        spans = {(st.data_ptr() - base, st.data_ptr() - base + st.nbytes())
                 for st in (t.untyped_storage() for t in tensors)}
        return sum(self._drop_pages(begin, end) for begin, end in spans if 0 <= begin and end <= size)

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
