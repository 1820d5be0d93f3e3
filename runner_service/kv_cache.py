"""The paged KV cache: one K and one V block pool per layer, stored as two tensors.

Layout: ``k``/``v`` are ``[L, num_blocks, block_size, nkv, hd]`` in the compute dtype. Token
``t`` of a sequence lives at slot ``block_table[t // block_size] * block_size + t % block_size``
(the slot mapping). Block 0 is the *scratch* block: never handed to a sequence, it absorbs the
writes of padding rows, and padding block-table entries point at it.

Size: one block costs ``2 * L * block_size * nkv * hd * itemsize`` bytes (K and V).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runner_service.config import ModelArgs
from services.errors import InvalidArgument

#: The block id reserved for padding rows and padding block-table entries.
SCRATCH_BLOCK = 0


def bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * itemsize


def num_blocks_for_bytes(args: ModelArgs, block_size: int, dtype: torch.dtype, kv_bytes: int) -> int:
    """Whole blocks (including the scratch block) that fit in ``kv_bytes``. Raises
    ``InvalidArgument`` when fewer than 2 fit (the scratch block plus one usable block)."""
    n = kv_bytes // bytes_per_block(args, block_size, dtype)
    if n < 2:
        raise InvalidArgument(
            f"a KV cache of {kv_bytes} bytes holds {n} blocks of {bytes_per_block(args, block_size, dtype)} "
            "bytes; at least 2 are needed")
    return int(n)


@dataclass
class KVCache:
    """K and V block pools ``[L, num_blocks, block_size, nkv, hd]`` (zero-initialised, so
    masked-out entries are finite and never poison attention)."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, args: ModelArgs, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> KVCache:
        shape = (args.num_layers, num_blocks, block_size, args.num_kv_heads, args.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
