"""Inductor mode: ``torch.compile(fullgraph=True, dynamic=True)`` with the Inductor cache
directory (FX graph cache) as the kernel-cache artifact (``docs/architecture.md`` §9)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernel_cache_service.fingerprint import UNKNOWN
from runner_service.programs import cache as kc
from runner_service.programs.spec import ProgramSpec
from services.errors import Untrusted

if TYPE_CHECKING:
    from kernel_cache_service.client import KernelCacheClient


@contextlib.contextmanager
def _inductor_cache_dir(path: Path) -> Iterator[None]:
    """Point Inductor's on-disk caches at ``path`` for the duration (restores the old value)."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    path.mkdir(parents=True, exist_ok=True)
    with temporary_cache_dir(str(path)):
        yield


def compile_inductor(module: nn.Module, spec: ProgramSpec, cache_dir: Path) -> Callable:
    """``torch.compile`` ``module`` (fullgraph, dynamic) and build every graph now, inside
    ``cache_dir``, by calling it the way the runner will: on ``spec.decode_views`` (views of the
    runner's persistent buffers, the block table made contiguous as
    :meth:`~runner_service.model_runner.ModelRunner.decode` does) under ``inference_mode``
    (Dynamo guards on strides and on inference-tensor dispatch keys, so synthetic inputs would
    leave recompiles for the first requests). Dynamo specialises sizes 0 and 1, so ``(B, nb)``
    covers ``{1, >=2} x {1, >=2}``."""
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    widths = (1, 2) if spec.max_blocks_per_seq >= 2 else (1,)
    with _inductor_cache_dir(cache_dir), torch.inference_mode():
        for b in spec.buckets:
            for nb in widths:
                ids, pos, slots, tables, lens = spec.decode_views(b, nb)
                compiled(spec.pools, ids, pos, slots, tables.clone(memory_format=torch.contiguous_format), lens)
    return compiled


def load_inductor(spec: ProgramSpec, name: str, fp: str, cache: KernelCacheClient | None,
                  work: Path) -> kc.Loaded:
    """Fetch the decode program's Inductor cache ``name``/``fp`` (if any), compile the decode
    module into it (a HIT only saves the graphs' C++ builds: Dynamo re-traces) and publish it
    after a MISS. Uncoordinated: no single flight. Verifying (the client has trusted keys), a
    MISS or a refused entry starts from an empty directory."""
    if fp == UNKNOWN:
        cache_dir = Path(tempfile.mkdtemp(dir=work, prefix="inductor-"))
    else:
        cache_dir = work / f"{name}-{fp[:24]}"
    try:
        hit = kc.fetch(cache, name, fp, cache_dir)
    except Untrusted:
        hit = None
    if hit is None and cache is not None and cache.trusted_keys is not None:
        shutil.rmtree(cache_dir, ignore_errors=True)  # nothing unverified (an older fetch) is compiled from
    t = time.perf_counter()
    compiled = compile_inductor(spec.decode_module, spec, cache_dir)  # the graphs' .so files stay in cache_dir
    build_s = time.perf_counter() - t
    if hit:
        return compiled, "hit", "", f"kernel cache HIT {name}, graphs loaded in {build_s:.1f} s"
    published = kc.publish(cache, name, fp, cache_dir, kc.holder(spec))
    return compiled, "compiled", published, f"compiled {name} in {build_s:.1f} s ({kc.how_published(fp, cache, published)})"
