"""KV block allocation with automatic prefix caching (nano-vllm's ``BlockManager``; the prefix
cache follows the ideas of vLLM's ``KVCacheManager`` / ``BlockPool``).

Blocks ``1 .. num_blocks - 1`` are handed out; block 0 is the scratch block
(:data:`runner_service.kv_cache.SCRATCH_BLOCK`) and is never allocated nor cached. A sequence's
``block_table`` lists its blocks in token order; block ``i`` holds tokens
``[i * block_size, (i + 1) * block_size)`` (the paged layout; a family may lay its table out
otherwise, :mod:`model_families.block_layout`, and then has no prefix caching).

Prefix caching (``enable_prefix_caching``; the engine turns it on only for a model family that
declares :attr:`~model_families.family.ModelFamily.supports_prefix_caching`):

- **Key.** Full block ``i`` of a token history is keyed by a hash chain,
  ``key_i = hash_block(key_{i-1}, token_ids[i*bs:(i+1)*bs])`` with ``key_{-1}`` the UTF-8 bytes of
  :attr:`BlockManager.computed_by` (``b""`` for the default ``""``) and :func:`hash_block` =
  SHA-256 over the parent key and the block's token ids (little-endian int64). A block's K/V
  depend only on the tokens up to its end and their positions, and on the code that computed
  them, so equal histories computed by the same programs may share it. Only full blocks are keyed.
- **Programs.** :attr:`BlockManager.computed_by` names the code that computes K/V now (the
  engine sets it before each step: eager or which compiled program, batch-invariant or not,
  :meth:`runner_service.model_runner.ModelRunner.computed_by`). Entries remember it and a lookup
  accepts only entries of the current one, so blocks an eager start computed are never reused
  by the compiled programs installed later (their bits differ). A sequence registers blocks only
  while the code it started under (its first chunk's) still runs: a block partly computed by
  each is never cached.
- **Identity (collisions never share).** A cache entry keeps its block's token ids, its parent
  entry (the entry of block ``i - 1``; ``None`` for block 0) and its ``computed_by``. A lookup
  accepts an entry only when the key, the token ids, the parent entry (object identity) and
  ``computed_by`` all match, so by induction an
  entry stands for exactly one whole token history: a hash collision costs a miss, never a
  wrong block.
- **Registration.** After a step, the blocks a sequence has completely filled and computed are
  registered (:meth:`BlockManager.cache_full_blocks`, called by the scheduler when computed
  tokens advance). A block whose history is already cached in another block (two sequences
  computed the same prefix in one step) stays uncached; so do the blocks after a collision or
  after a parent entry that has been evicted. An entry whose parent was evicted can never be hit
  again; the next registration under its key replaces it.
- **Lookup.** :meth:`BlockManager.allocate_cached_prefix`, for a sequence holding no blocks (new
  or preempted): the longest run of leading full blocks found in the cache is taken (ref count
  +1) and ``num_computed_tokens`` jumps past it. At least one token is always left to compute
  (the last token's logits are needed), so the hit covers at most the full blocks within the
  first ``num_tokens - 1`` tokens: when a block-aligned prompt hits entirely, its last block is
  recomputed into a fresh block.
- **Sharing is read-only.** A step writes K/V only at positions ``>= num_computed_tokens``, and
  every shared or cached block lies below that (it is full and computed), so a cached block is
  never written again until it is evicted and handed out fresh.
- **Free and eviction.** Freeing decrements each block's ref count. A block at 0 is *truly free*
  (uncached) or *evictable* (cached, kept in LRU order; a sequence's blocks are released tail
  first, so a prefix outlives its continuations). A fresh block comes from the truly free blocks
  first, else the least recently used evictable block is evicted (its entry dropped). A lookup
  that hits an evictable block takes it back.

Accounting invariants (checked by the tests under random alloc/free/preempt sequences):
``num_used_blocks`` (distinct blocks with ref count > 0) + truly free + evictable ==
``num_usable_blocks``; ``num_free_blocks`` = truly free + evictable (both can be handed out);
a block's ref count is the number of sequences whose table holds it.

Threads: the engine's stepping thread only, except :attr:`BlockManager.num_usable_blocks` and
:meth:`BlockManager.blocks_needed`, which read constants.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence as Seq

from model_families.block_layout import BlockLayout
from runner_service.kv_cache import SCRATCH_BLOCK
from runner_service.sequence import Sequence
from services.errors import InvalidArgument, ResourceExhausted


def hash_block(parent: bytes, token_ids: Seq[int]) -> bytes:
    """The hash-chain key of a full block: SHA-256 of the parent block's key (``b""`` for the
    first block) followed by the block's token ids as little-endian int64."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


class _CachedBlock:
    """A prefix-cache entry: ``block`` holds the K/V of ``token_ids`` after the history of
    ``parent`` (``None``: the first block). ``block`` is ``None`` once the entry is dropped."""

    __slots__ = ("key", "token_ids", "parent", "block", "computed_by")

    def __init__(self, key: bytes, token_ids: tuple[int, ...], parent: _CachedBlock | None, block: int,
                 computed_by: str = "") -> None:
        self.key = key
        self.token_ids = token_ids
        self.parent = parent
        self.block: int | None = block
        self.computed_by = computed_by

    @property
    def alive(self) -> bool:
        return self.block is not None

    def matches(self, token_ids: tuple[int, ...], parent: _CachedBlock | None, computed_by: str) -> bool:
        """Same block tokens after the same (identical) history, computed by the same code."""
        return self.parent is parent and self.token_ids == token_ids and self.computed_by == computed_by


class BlockManager:
    """Ref-counted allocator over ``num_blocks`` blocks of ``block_size`` tokens, with an
    optional prefix cache (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 layout: BlockLayout | None = None) -> None:
        if num_blocks < 2:
            raise InvalidArgument(f"need at least 2 KV blocks (scratch + 1), got {num_blocks}")
        if block_size < 1:
            raise InvalidArgument(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        #: How many blocks ``n`` tokens hold (the family's :meth:`~model_families.family.ModelFamily.block_layout`).
        self.layout = layout or BlockLayout(block_size)
        if self.layout.block_size != block_size:
            raise InvalidArgument(f"block layout is for blocks of {self.layout.block_size} tokens, not {block_size}")
        self.enable_prefix_caching = enable_prefix_caching
        #: The code computing K/V now (module docstring, "Programs"); set by the engine between steps.
        self.computed_by = ""
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(b for b in range(num_blocks) if b != SCRATCH_BLOCK)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0; LRU first
        self._num_used = 0
        self._cache: dict[bytes, _CachedBlock] = {}
        self._entry_of: dict[int, _CachedBlock] = {}
        #: Prefix-cache counters: tokens looked up, tokens found (prefill saved), blocks evicted.
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_evictions = 0

    # -- counts ------------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a sequence may ever hold (all but the scratch block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out: truly free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Distinct blocks held by at least one sequence."""
        return self._num_used

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content is in the prefix cache (held or evictable)."""
        return len(self._entry_of)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def prefix_hit_rate(self) -> float:
        """Hit tokens / queried tokens since start (0.0 before any lookup)."""
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    def ref_count(self, block: int) -> int:
        """Sequences holding ``block``."""
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        """Whether ``block`` holds prefix-cache content (never to be written while cached)."""
        return block in self._entry_of

    # -- plain allocation --------------------------------------------------------------------

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens (the layout's; paged: ``ceil(num_tokens /
        block_size)``)."""
        return self.layout.blocks_needed(num_tokens)

    def tokens_that_fit(self, seq: Sequence) -> int:
        """The most tokens ``seq`` could hold with its blocks and every free one."""
        return self.layout.max_tokens(len(seq.block_table) + self.num_free_blocks)

    def extra_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` still lacks to hold its first ``num_tokens`` tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.extra_blocks(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` with fresh blocks to cover ``num_tokens`` tokens (evicting
        least recently used cached blocks when no block is truly free). Raises
        ``ResourceExhausted`` (allocating nothing) when too few blocks are free."""
        need = self.extra_blocks(seq, num_tokens)
        if need > self.num_free_blocks:
            raise ResourceExhausted(f"{need} KV blocks needed, {self.num_free_blocks} free")
        for _ in range(need):
            seq.block_table.append(self._fresh_block())

    def free(self, seq: Sequence) -> None:
        """Release all of ``seq``'s blocks (tail first); its table becomes empty and its
        prefix-cache progress resets (a second call is a no-op). Cached blocks whose ref count
        drops to 0 stay cached, evictable."""
        for block in reversed(seq.block_table):
            ref = self._ref[block]
            if ref <= 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self._ref[block] = ref - 1
            if ref == 1:
                self._num_used -= 1
                if block in self._entry_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table.clear()
        seq.cache_resolved_blocks = 0
        seq.cache_parent = None
        seq.cache_broken = False

    # -- prefix cache ------------------------------------------------------------------------

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Give a sequence that holds no blocks the longest cached prefix of its full blocks
        (leaving at least its last token to compute) and advance its ``num_computed_tokens``
        past it. Returns the hit tokens (0 when caching is off or nothing matches). Counters are
        left to :meth:`record_lookup`, once the sequence is actually scheduled."""
        if not self.enable_prefix_caching or seq.block_table or seq.num_computed_tokens:
            return 0
        if seq.cache_computed_by != self.computed_by:  # its memoised keys are another program's
            seq.cache_computed_by = self.computed_by
            seq.block_hashes = []
        bs = self.block_size
        limit = (seq.num_tokens - 1) // bs
        keys = self._block_keys(seq, limit)
        parent: _CachedBlock | None = None
        hits: list[_CachedBlock] = []
        for i in range(limit):
            entry = self._cache.get(keys[i])
            if entry is None or not entry.matches(tuple(seq.token_ids[i * bs:(i + 1) * bs]), parent,
                                                  self.computed_by):
                break
            hits.append(entry)
            parent = entry
        for entry in hits:
            block = entry.block
            if self._ref[block] == 0:
                del self._evictable[block]
                self._num_used += 1
            self._ref[block] += 1
            seq.block_table.append(block)
        seq.num_computed_tokens = len(hits) * bs
        seq.cache_resolved_blocks = len(hits)
        seq.cache_parent = parent
        seq.cache_broken = False
        return len(hits) * bs

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        """Count one prefix lookup (a sequence scheduled for prefill with ``queried_tokens``
        tokens, ``hit_tokens`` of them found in the cache)."""
        self.prefix_queried_tokens += queried_tokens
        self.prefix_hit_tokens += hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s blocks that are full and computed (after a step advanced its
        ``num_computed_tokens``) in the prefix cache. Idempotent; no-op when caching is off."""
        if not self.enable_prefix_caching or seq.cache_broken:
            return
        if seq.cache_computed_by != self.computed_by:  # other code computed part of it: never cache
            seq.cache_broken = True
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        if seq.cache_resolved_blocks >= full:
            return
        keys = self._block_keys(seq, full)
        parent = seq.cache_parent
        for i in range(seq.cache_resolved_blocks, full):
            if parent is not None and not parent.alive:
                seq.cache_broken = True  # the history's cached prefix was evicted: stop here
                break
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            entry = self._cache.get(keys[i])
            if entry is not None and not entry.matches(tokens, parent, self.computed_by):
                if entry.parent is not None and not entry.parent.alive:
                    self._drop(entry)  # unreachable (its history was evicted): replace it
                    entry = None
                else:
                    seq.cache_broken = True  # a different history owns this key: a collision
                    break
            if entry is None:
                block = seq.block_table[i]
                entry = _CachedBlock(keys[i], tokens, parent, block, self.computed_by)
                self._cache[entry.key] = entry
                self._entry_of[block] = entry
            # else: the same history is cached in another block; ours stays uncached
            parent = entry
            seq.cache_resolved_blocks = i + 1
        seq.cache_parent = parent

    def reset_prefix_cache(self) -> int:
        """Drop every prefix-cache entry (held blocks become plain blocks of their sequences,
        evictable ones truly free). Returns the entries dropped."""
        entries = list(self._entry_of.values())
        for entry in entries:
            self._drop(entry)
        return len(entries)

    # -- internals ---------------------------------------------------------------------------

    def _block_keys(self, seq: Sequence, n: int) -> list[bytes]:
        """The hash-chain keys of ``seq``'s first ``n`` full blocks (memoised on the sequence:
        a sequence's tokens only ever grow)."""
        keys, bs = seq.block_hashes, self.block_size
        while len(keys) < n:
            i = len(keys)
            keys.append(hash_block(keys[-1] if keys else seq.cache_computed_by.encode(),
                                   seq.token_ids[i * bs:(i + 1) * bs]))
        return keys

    def _fresh_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            entry = self._entry_of.pop(block)
            if self._cache.get(entry.key) is entry:
                del self._cache[entry.key]
            entry.block = None
            self.num_evictions += 1
        self._ref[block] = 1
        self._num_used += 1
        return block

    def _drop(self, entry: _CachedBlock) -> None:
        """Remove ``entry`` from the cache; an evictable block becomes truly free."""
        block = entry.block
        if block is None:
            return
        if self._cache.get(entry.key) is entry:
            del self._cache[entry.key]
        del self._entry_of[block]
        entry.block = None
        if block in self._evictable:
            del self._evictable[block]
            self._free.append(block)
