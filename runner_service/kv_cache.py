"""The paged KV cache: the block pools a model family declares
(:meth:`model_families.family.ModelFamily.cache_specs`), allocated once.

Each pool is ``[layers, num_blocks, *block_shape]`` in the compute dtype (Llama: K and V, each
``[L, num_blocks, block_size, nkv, hd]``). Token ``t`` of a sequence lives at slot
``block_table[t // block_size] * block_size + t % block_size`` (the slot mapping). Block 0 is the
*scratch* block: never handed to a sequence, it absorbs the writes of padding rows, and padding
block-table entries point at it.

Size: one block costs the sum of :meth:`CacheSpec.bytes_per_block` over the pools (Llama:
``2 * L * block_size * nkv * hd * itemsize`` bytes).
"""

from __future__ import annotations

import ctypes
import math
import mmap
from collections.abc import Sequence

import torch

from model_families.family import CacheSpec
from services.errors import InvalidArgument

#: The block id reserved for padding rows and padding block-table entries.
SCRATCH_BLOCK = 0


def bytes_per_block(specs: Sequence[CacheSpec], dtype: torch.dtype) -> int:
    """Bytes of one block across every pool and layer (0 for a family without pools)."""
    return sum(s.bytes_per_block(dtype) for s in specs)


def num_blocks_for_bytes(specs: Sequence[CacheSpec], dtype: torch.dtype, kv_bytes: int) -> int:
    """Whole blocks (including the scratch block) that fit in ``kv_bytes``. Raises
    ``InvalidArgument`` when fewer than 2 fit (the scratch block plus one usable block)."""
    per_block = bytes_per_block(specs, dtype)
    if per_block == 0:
        raise InvalidArgument("this model keeps no KV cache, so a KV-cache size in bytes means nothing")
    n = kv_bytes // per_block
    if n < 2:
        raise InvalidArgument(
            f"a KV cache of {kv_bytes} bytes holds {n} blocks of {per_block} bytes; at least 2 are needed")
    return int(n)


def _zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    """A CPU tensor of zeros backed by an anonymous private mapping: the kernel maps a page on
    first touch, so reserving costs neither time nor memory until blocks are used."""
    numel = math.prod(shape)
    buf = mmap.mmap(-1, max(numel * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape), buf


def resident_bytes(t: torch.Tensor) -> int | None:
    """Bytes of ``t``'s pages that are in memory (``mincore(2)``), or ``None`` where that cannot
    be asked (not a CPU tensor, not Linux/glibc)."""
    if t.device.type != "cpu" or t.numel() == 0:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    start = t.data_ptr() - t.data_ptr() % page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    if mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        return None
    flags = bytes(vec)
    return (pages - flags.count(0)) * page


class KVCache:
    """The pools of :class:`CacheSpec` s over ``num_blocks`` blocks of ``block_size`` tokens,
    zero-initialised (so masked-out entries are finite and never poison attention).

    On the CPU the pools are reserved, not touched: each is an anonymous memory mapping whose
    pages the kernel supplies (zeroed) on first use, so a large default cache costs no start-up
    time and no memory beyond the blocks sequences write (:meth:`touched_bytes`). Elsewhere they
    are ``torch.zeros``.

    ``pools`` maps pool name to tensor; :attr:`tensors` is the tuple in spec order, the
    ``caches`` argument of a family model's forward.
    """

    def __init__(self, specs: Sequence[CacheSpec], num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if num_blocks < 2:
            raise InvalidArgument(f"a KV cache needs at least 2 blocks (one is scratch), got {num_blocks}")
        self.specs = tuple(specs)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._maps: list[mmap.mmap] = []  # kept alive with the pools they back
        self.pools: dict[str, torch.Tensor] = {}
        for s in self.specs:
            shape = (s.layers, num_blocks, *s.block_shape)
            if device.type == "cpu":
                self.pools[s.name], buf = _zero_pages(shape, dtype)
                self._maps.append(buf)
            else:
                self.pools[s.name] = torch.zeros(shape, dtype=dtype, device=device)
        self.tensors: tuple[torch.Tensor, ...] = tuple(self.pools.values())

    @property
    def nbytes(self) -> int:
        """Bytes of all pools (reserved)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def touched_bytes(self) -> int | None:
        """Bytes of the pools in memory now (pages written or read at least once), or ``None``
        when the platform cannot tell (see :func:`resident_bytes`)."""
        sizes = [resident_bytes(t) for t in self.tensors]
        return None if any(n is None for n in sizes) else sum(sizes)
