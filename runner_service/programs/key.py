"""The kernel-cache key of a compiled program: ``(name, fingerprint)`` over the traced sources,
the layout, the family, the dtype, the device and the compile options (``docs/architecture.md`` §9)."""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

from model_families import native
from runner_service.options import MAX_PROGRAM_BATCH
from runner_service.programs.aoti import AOTI_INDUCTOR_CONFIGS
from runner_service.programs.spec import PROGRAM_KINDS, ProgramSpec

#: This package's modules: their code decides what is exported and how it is compiled, so their
#: canonical AST is in every program's fingerprint (with the family's sources).
PROGRAM_MODULES = ("spec", "key", "export_specs", "aoti", "inductor", "cache", "load")
#: Modules of this package left out of the key: the build child's process plumbing (stdin/stdout
#: protocol, CPU share) runs :mod:`aoti`'s compile on the same spec and decides no code; the child
#: refuses to build when its key differs from the runner's.
NOT_IN_KEY = ("build_child",)

#: Name prefixes of the environment variables Inductor reads into its config (``TORCHINDUCTOR_MAX_AUTOTUNE``,
#: ``AOT_INDUCTOR_ENABLE_LTO``, ...), and single names that reach code generation (``CXX``: the compiler;
#: ``WARMSERVE_NATIVE_KERNELS``: warmserve's own kernels or torch ops in the traced step).
CODEGEN_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_INDUCTOR_", "AOT_INDUCTOR_", "AOTINDUCTOR_", "INDUCTOR_")
CODEGEN_ENV_NAMES = ("CXX", native.DISABLE_ENV)
#: Those of them that name caches, logs, timeouts or worker pools only: the code is the same.
NOT_CODEGEN_ENV = frozenset({
    "TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_FX_GRAPH_CACHE_DEFAULT",
    "TORCHINDUCTOR_AUTOGRAD_CACHE", "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE",
    "TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TORCHINDUCTOR_COMPILE_THREADS", "TORCHINDUCTOR_WORKER_START",
    "TORCHINDUCTOR_FILE_LOCK_TIMEOUT", "TORCHINDUCTOR_COMPILE_WORKER_WAIT_TIMEOUT", "TORCHINDUCTOR_WORKER_SUPPRESS_LOGGING",
    "TORCHINDUCTOR_WORKER_LOGPATH", "TORCHINDUCTOR_DEBUG_FUSION", "TORCHINDUCTOR_ENABLED_METRIC_TABLES",
})


def program_sources(spec: ProgramSpec) -> list[ModuleType]:
    """Modules whose code is traced into the program or decides how (their canonical AST is in
    the key): the family's :meth:`~model_families.family.ModelFamily.program_sources` and
    :data:`PROGRAM_MODULES`."""
    own = [importlib.import_module(f"{__package__}.{name}") for name in PROGRAM_MODULES]
    return [*spec.family.program_sources(), *own]


def _without_none(value: Any) -> Any:
    """``value`` with ``None`` entries of dicts dropped at every depth and tuples as lists: a
    config field or a ``rope_scaling`` key set to null means the same as one left out (and a
    ``None`` would make the fingerprint ``UNKNOWN``)."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_without_none(v) for v in value]
    return value


def codegen_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables (of ``environ``, default ``os.environ``) that can change the code
    Inductor generates: every one named by :data:`CODEGEN_ENV_PREFIXES` / :data:`CODEGEN_ENV_NAMES`
    except :data:`NOT_CODEGEN_ENV`, sorted. Part of the program key; reading the environment
    instead of Inductor's config keeps ``torch._inductor`` out of a warm start. Over-inclusion
    only costs a cache miss; a missing variable would let a differently built program be fetched."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env) if (k.startswith(CODEGEN_ENV_PREFIXES) or k in CODEGEN_ENV_NAMES)
            and k not in NOT_CODEGEN_ENV}


def program_key(spec: ProgramSpec, mode: str, *, sources: list | None = None,
                kind: str = "decode") -> tuple[str, str]:
    """``(name, fingerprint)`` of the ``kind`` program (:data:`PROGRAM_KINDS`) of ``spec``
    compiled in ``mode``; ``name`` is ``<family>.<kind>.<mode>``.

    The fingerprint covers ``sources`` (default :func:`program_sources`), the layout (block size,
    max model length, the batch the program takes, max blocks per sequence, dynamic dims, KV pools,
    the block-table layout, the weights' buffer names and dtypes, the layers' form; for prefill the most tokens per
    row; for verify the speculative method and ``K``, ``1 + K`` tokens per row), the family, its pack version and config, the dtype, the device type, the compile options
    and :func:`codegen_environment`, which of warmserve's C++ kernels load here (and whether int8
    activations are on), the torch thread
    count among them (Inductor writes it into
    the code); ``UNKNOWN`` when any part is unknown. The runner's ``max_num_seqs`` is no part: an
    ``aoti`` program takes any batch up to :data:`~runner_service.options.MAX_PROGRAM_BATCH`, so
    ``make run``'s runners and ``warmserve up``'s share their programs; ``inductor`` keys the batch
    sizes Dynamo specialises (1, and 2 for any larger bucket). It is
    the digest of the parts record of those (:func:`kernel_cache_service.fingerprint.program_parts`),
    remembered in this process (``fingerprint.known_parts``), so a publish of the key carries it and
    ``warmserve cache explain`` can name the parts two keys differ in. Nothing of where the runner
    runs (port, runner id, home, cache paths) is a part. Raises ``ValueError`` for an unknown ``kind``
    (or ``verify`` for a spec that does not speculate).
    """
    from kernel_cache_service.fingerprint import program_fingerprint

    if kind not in PROGRAM_KINDS:
        raise ValueError(f"program kind must be one of {PROGRAM_KINDS}, got {kind!r}")
    name = f"{spec.family.name}.{kind}.{mode}"
    weights = spec.constants(kind)  # ValueError for verify when not speculating
    layout = {
        "block_size": spec.block_size,
        "max_model_len": spec.max_model_len,
        # aoti: the export's batch bound; inductor: the batch sizes its graphs are traced at
        # (the runner's buckets, which Dynamo specialises to a batch of 1 vs >= 2)
        **({"max_batch": MAX_PROGRAM_BATCH} if mode == "aoti" else
           {"traced_batches": sorted({min(b, 2) for b in spec.buckets})}),
        "max_blocks_per_seq": spec.max_blocks_per_seq,
        "dynamic": ["num_blocks", "batch", "blocks"],
        "kv_pools": [[s.name, s.layers, list(s.block_shape)] for s in spec.pool_specs],
        "block_layout": spec.block_layout,
        "weights": {n: str(t.dtype).removeprefix("torch.") for n, t in sorted(weights.items())},
        "layers": spec.layers,
    }
    if kind == "prefill":
        layout.update(dynamic=["num_blocks", "batch", "tokens", "blocks"], max_tokens=spec.max_prefill_tokens)
    elif kind == "verify":  # its token dim is bounded by K: a K=2 program never serves K=3
        layout.update(dynamic=["num_blocks", "batch", "tokens", "blocks"], max_tokens=1 + spec.num_draft_tokens,
                      speculative={"method": spec.speculative, "num_speculative_tokens": spec.num_draft_tokens})
    # Inductor writes the thread count into CPU code (``num_threads(N)`` on its OpenMP loops when
    # it differs from the core count), so a program built under N threads is another program.
    # warmserve's C++ ops (model_families.native) are traced in where they load on this host: a
    # program that calls them must not be fetched where they do not (another CPU, no build).
    options = {"mode": mode, "device": spec.device.type, "threads": spec.threads,
               "environment": codegen_environment(),
               "native_kernels": {"int4_tiles": native.int4_tiles_enabled(),
                                  "decode_attention": native.decode_attention_enabled(),
                                  "int8_activations": spec.int8_activations,
                                  "sources": native.source_digests()}}
    if mode == "aoti":
        options["inductor_configs"] = AOTI_INDUCTOR_CONFIGS
    else:
        options.update(fullgraph=True, dynamic=True)
    arch = {"family": spec.family.name, "pack_version": spec.family.pack_version,
            "config": _without_none(spec.config)}
    fp = program_fingerprint(name, sources=program_sources(spec) if sources is None else sources,
                             layout=layout, arch=arch, dtype=str(spec.dtype).removeprefix("torch."),
                             compile_options=options)
    return name, fp
