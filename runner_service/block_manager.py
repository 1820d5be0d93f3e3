"""KV block allocation (nano-vllm's ``BlockManager`` without prefix caching).

Blocks ``1 .. num_blocks - 1`` are handed out; block 0 is the scratch block
(:data:`runner_service.kv_cache.SCRATCH_BLOCK`) and is never allocated. A sequence's
``block_table`` lists its blocks in token order; block ``i`` holds tokens
``[i * block_size, (i + 1) * block_size)``.
"""

from __future__ import annotations

from collections import deque

from runner_service.kv_cache import SCRATCH_BLOCK
from runner_service.sequence import Sequence
from services.errors import InvalidArgument, ResourceExhausted


class BlockManager:
    """Free-list allocator over ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise InvalidArgument(f"need at least 2 KV blocks (scratch + 1), got {num_blocks}")
        if block_size < 1:
            raise InvalidArgument(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(b for b in range(num_blocks) if b != SCRATCH_BLOCK)
        self._used: set[int] = set()

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a sequence may ever hold (all but the scratch block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._used)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` still lacks to hold its first ``num_tokens`` tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to cover ``num_tokens`` tokens. Raises ``ResourceExhausted``
        (allocating nothing) when too few blocks are free."""
        need = self.extra_blocks(seq, num_tokens)
        if need > len(self._free):
            raise ResourceExhausted(f"{need} KV blocks needed, {len(self._free)} free")
        for _ in range(need):
            block = self._free.popleft()
            self._used.add(block)
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks; its table becomes empty (a second call is a no-op)."""
        for block in reversed(seq.block_table):
            self._used.remove(block)
            self._free.append(block)
        seq.block_table.clear()
