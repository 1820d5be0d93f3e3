"""The KV cache's pools: zero-filled, reserved without being touched (runner_service/kv_cache.py)."""

from __future__ import annotations

import mmap

import torch

from model_families.family import CacheSpec
from runner_service.kv_cache import KVCache, resident_bytes

SPECS = [CacheSpec("k", 30, (16, 3, 64)), CacheSpec("v", 30, (16, 3, 64))]  # SmolLM2's pools


def test_a_large_cache_is_reserved_not_touched_and_reads_as_zeros():
    kv = KVCache(SPECS, 2048, 16, torch.float32, torch.device("cpu"))
    assert kv.nbytes == 2 * 30 * 2048 * 16 * 3 * 64 * 4  # 1440 MiB
    assert kv.touched_bytes() == 0
    block = kv.pools["k"][3, 7]  # one block of one layer: 16 * 3 * 64 * 4 = 12 KiB = 3 pages
    assert torch.count_nonzero(block) == 0
    block.fill_(2.0)
    touched = kv.touched_bytes()
    assert block.numel() * 4 <= touched <= block.numel() * 4 + 2 * mmap.PAGESIZE
    assert kv.pools["k"].sum().item() == 2.0 * block.numel()  # everything else still zero
    assert torch.count_nonzero(kv.pools["v"]) == 0


def test_pools_are_writable_contiguous_tensors_of_the_compute_dtype():
    kv = KVCache(SPECS[:1], 4, 16, torch.bfloat16, torch.device("cpu"))
    k = kv.pools["k"]
    assert k.shape == (30, 4, 16, 3, 64) and k.dtype == torch.bfloat16 and k.is_contiguous()
    k.view(30, -1, 3, 64).index_copy_(1, torch.tensor([17]), torch.ones(30, 1, 3, 64, dtype=torch.bfloat16))
    assert k[:, 1, 1].float().sum().item() == 30 * 3 * 64
    assert resident_bytes(torch.empty(0)) is None
