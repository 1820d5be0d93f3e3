"""Compiled programs: the decode and prefill steps built once, kept in the kernel cache, loaded warm.

Entry point (the engine calls it once per launch, after the KV cache is allocated, when
``--compile`` is not ``off``)::

    report = load_programs(runner, config, kernel_cache=ADDR_OR_DIR_OR_CLIENT, work_dir=None)

It installs the decode program with :meth:`ModelRunner.install_decode_program` (so
``runner.decode_fn(b)`` uses it for every batch bucket) and, in ``aoti`` mode, the prefill
program with :meth:`ModelRunner.install_prefill_program`, and returns a :class:`ProgramsReport`
whose ``str()`` is the start-up phase detail, e.g. ``"aoti: kernel cache HIT llama.decode.aoti
(3.6 MiB); kernel cache HIT llama.prefill.aoti (4.1 MiB)"`` (the phase itself carries the
seconds). It never raises for a compile or cache failure: the runner then runs that step eager
and the report says why (a runner that serves slowly beats one that does not start).

The prefill program is the family model's ``forward`` (writes K/V in place through
:func:`model_families.kv_write.kv_write_`) exported with the batch, the tokens per row (2 ..
the step's token budget; a one-token chunk is padded to two) and the block-table width dynamic:
``program(caches, input_ids[B, S], positions[B, S], slot_mapping[B, S], block_tables[B, nb],
seq_lens[B], last_index[B]) -> (logits[B, V] float32,)``. Its key is
``<family>.prefill.<mode>``, fingerprinted like decode's with the token bound in the layout.

The program
-----------
:attr:`ModelRunner.decode_module` — the family's decode module
(:meth:`model_families.family.ModelFamily.decode_module`), the very module eager decode calls —
is exported: weights and derived tables (RoPE) are its buffers, the KV pools are *inputs*, so
the same program serves any KV-cache size::

    program(caches (pools[layers, NB, *block_shape], ...), input_ids[B], positions[B],
            slot_mapping[B], block_tables[B, nb], seq_lens[B]) -> (logits[B, V] float32, *rows)

with ``B`` (batch, 1..max_num_seqs), ``nb`` (block-table width, 1..max_blocks_per_seq) and ``NB``
(pool blocks) all dynamic, so ONE program covers every batch bucket and block-table width. A family whose
decode returns its cache rows (Llama) compiles to a program that only reads the pools; the
runner writes the rows after it (:meth:`ModelRunner.finish_decode`). A family that writes in
place does so through :func:`model_families.kv_write.kv_write_`, an in-place custom op (see that
module for why an inline ``index_copy_`` makes compiled code copy the whole pool every step).

Modes (``--compile``)
---------------------
- ``aoti`` (the default choice): ``torch.export`` + ``torch._inductor.aoti_compile_and_package``
  with ``aot_inductor.package_constants_in_so=False``: the ``.pt2`` package holds the generated
  code and the shared library, not the weights. At load the model's own tensors are handed
  over by reference (``load_constants(user_managed=True)``), so a warm launch maps one copy of
  the weights and compiles nothing: the package's ``.so`` is dlopened, and the vector-ISA probe
  that ``aoti_load_package`` would build with g++ is skipped (see :class:`AotiProgram`; the ISA and
  CPU flags are part of the fingerprint instead). Inductor may create small constants of its
  own that are no buffer of the module (its lowering of the int4 matmul turns the group size
  into an int64 scalar tensor); without packaged constants those would be missing at load, so
  :func:`compile_aoti` records them (at most :data:`MAX_OWN_CONSTANT_NUMEL` elements each) into
  the package as ``warmserve/inductor_constants.json`` and :class:`AotiProgram` hands them over
  with the module's.
- ``inductor``: ``torch.compile(fullgraph=True, dynamic=True)`` with the Inductor cache
  directory (FX graph cache: generated C++ and built ``.so`` files) as the artifact. A warm
  launch still re-traces with Dynamo (every graph) and does not rebuild the graphs' C++ code,
  but Inductor still runs a small ``g++`` probe (with no working compiler the runner goes eager).
  New shapes met after start-up (e.g. batch 1 with a wider block table) may compile at run time.
- ``off``: nothing installed; :meth:`ModelRunner.decode_step` runs eager.

Measured cold/warm launch times and steady-state step times per mode are in
``docs/benchmarks.md``; AOTI is the mode to use.

Key and cache
-------------
The artifact key is ``(name, fingerprint)``: ``name`` = ``"<family>.decode.<mode>"``
(``llama.decode.aoti``), fingerprint = :func:`kernel_cache_service.fingerprint.program_fingerprint`
over the traced sources (the family's :meth:`~model_families.family.ModelFamily.program_sources`
and this file), the layout (block size, max model length, max batch, max blocks per sequence,
which dims are dynamic, the KV pools, the weights' buffer names and dtypes: float and int4 /
int8 weights trace different kernels), the family, its pack version and config, dtype, device
and compile options. An ``UNKNOWN`` fingerprint is compiled locally and never fetched or published.
A MISS compiles and publishes; a HIT whose bytes fail to load (corrupt entry that passed the
sha256 check, e.g. published broken) is evicted, recompiled and republished. A corrupt entry the
store detects is quarantined there and reads as a MISS.

Single flight: in ``aoti`` mode a MISS does not compile at once; the runner claims the key
(:meth:`KernelCacheClient.claim`, see :mod:`kernel_cache_service.leases`). OWNER compiles
holding a build lease it renews every third of ``EngineConfig.build_lease_s`` and publishes
(which ends the lease); WAIT blocks until the builder publishes (then fetches: "fetched
llama.decode.aoti from runner-2's publish after waiting 41.3 s") or its lease ends (a builder
that died: claim again, one waiter takes over). So N runners starting together on an empty
cache compile each program once. ``inductor`` mode stays uncoordinated (its warm start
re-traces anyway).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from model_families import kv_write as _kv_write  # noqa: F401  (registers torch.ops.warmserve.kv_write_)
from runner_service.options import COMPILE_MODES
from services.address import parse_address
from services.errors import InvalidArgument, WarmserveError

if TYPE_CHECKING:
    from kernel_cache_service.client import KernelCacheClient
    from kernel_cache_service.entry import EntryInfo
    from runner_service.config import EngineConfig
    from runner_service.model_runner import ModelRunner

log = logging.getLogger(__name__)

#: The compiling modes of :data:`runner_service.options.COMPILE_MODES` (all but ``off``).
MODES = tuple(m for m in COMPILE_MODES if m != "off")

#: Inductor options the AOTI package is built with (part of the fingerprint).
AOTI_INDUCTOR_CONFIGS: dict[str, Any] = {"aot_inductor.package_constants_in_so": False}
#: Where in a package :func:`compile_aoti` stores the constants Inductor created itself.
OWN_CONSTANTS_ENTRY = "warmserve/inductor_constants.json"
#: The largest Inductor-created constant (elements) recorded; a larger one fails the compile.
MAX_OWN_CONSTANT_NUMEL = 64


# ------------------------------------------------------------------------------------- report


@dataclass(frozen=True)
class ProgramsReport:
    """What :func:`load_programs` did.

    ``mode``: ``aoti`` / ``inductor``; ``seconds``: wall time of the whole programs phase;
    ``source``: ``hit`` (loaded from the kernel cache), ``compiled`` (built here) or ``eager``
    (failed; the runner runs eager); ``fingerprint``: the key used (or ``UNKNOWN``);
    ``published``: the kernel cache's answer to the publish (``PUBLISHED``, ``ALREADY_PRESENT``,
    ``REJECTED``) or ``""`` when nothing was published (these three are the decode program's);
    ``prefill_source``: ``hit`` / ``compiled`` / ``eager`` for the prefill program (``""`` when
    decode failed first); ``detail``: one human sentence.
    """

    mode: str
    seconds: float
    detail: str
    source: str = ""
    fingerprint: str = ""
    published: str = ""
    prefill_source: str = ""

    def __str__(self) -> str:
        return self.detail


# ------------------------------------------------------------------------------------- module


def _constants(module: nn.Module) -> dict[str, torch.Tensor]:
    """Buffer name -> tensor of the decode module, duplicates (a tied head) included: what
    AOTInductor asks for. The buffers *are* the runner's tensors (no copy)."""
    return dict(module.named_buffers(remove_duplicate=False))


def example_inputs(runner: ModelRunner, batch: int, blocks: int) -> tuple:
    """Decode inputs for ``batch`` padding rows over ``blocks`` block-table entries: every slot
    and block id is the scratch block 0, ``seq_lens`` 1; the KV pools are the runner's."""
    dev = runner.device
    zeros = torch.zeros(batch, dtype=torch.int64, device=dev)
    return (runner.kv.tensors, zeros, zeros.clone(), zeros.clone(),
            torch.zeros((batch, blocks), dtype=torch.int64, device=dev), torch.ones_like(zeros))


def _dims(runner: ModelRunner) -> tuple[int, int]:
    """Example sizes (batch, blocks): 2 where the dim is dynamic (export specialises 0 and 1)."""
    return (2 if runner.config.max_num_seqs >= 2 else 1, 2 if runner.max_blocks_per_seq >= 2 else 1)


def _shared_dims(runner: ModelRunner) -> tuple[tuple, object, object]:
    """The dims both programs share: the pools' spec (every pool's block count, one dim), the
    batch (``None`` when ``max_num_seqs`` is 1) and the block-table width (``None`` when
    ``max_blocks_per_seq`` is 1)."""
    Dim = torch.export.Dim
    pool = {1: Dim("num_blocks", min=2)}
    batch = Dim("batch", min=1, max=runner.config.max_num_seqs) if runner.config.max_num_seqs >= 2 else None
    blocks = Dim("blocks", min=1, max=runner.max_blocks_per_seq) if runner.max_blocks_per_seq >= 2 else None
    return tuple(pool for _ in runner.kv.tensors), batch, blocks


def _spec(*dims: tuple[int, object]) -> dict | None:
    """A tensor's dynamic-shape spec from ``(axis, dim)`` pairs, leaving out ``None`` dims."""
    return {axis: d for axis, d in dims if d is not None} or None


def dynamic_shapes(runner: ModelRunner) -> tuple:
    """``torch.export`` dynamic-shape spec for the decode module: every pool's block count (one
    shared dim), the batch (when ``max_num_seqs`` >= 2) and the block-table width (when
    ``max_blocks_per_seq`` >= 2)."""
    pools, batch, blocks = _shared_dims(runner)
    row = _spec((0, batch))
    return (pools, row, row, row, _spec((0, batch), (1, blocks)), row)


def prefill_tokens_max(runner: ModelRunner) -> int:
    """The most tokens per row a prefill step can have: the per-step token budget, at most the
    context length."""
    return min(runner.config.resolved_max_num_batched_tokens(runner.max_model_len), runner.max_model_len)


def prefill_example_inputs(runner: ModelRunner) -> tuple:
    """Prefill inputs (:meth:`FamilyModel.forward`) of 2 padding rows of 2 tokens over 2
    block-table entries (export specialises sizes 0 and 1): every slot and block id is the
    scratch block 0; the KV pools are the runner's."""
    dev = runner.device
    B, S, nb = min(2, runner.config.max_num_seqs), 2, min(2, runner.max_blocks_per_seq)
    tokens = torch.zeros((B, S), dtype=torch.int64, device=dev)
    rows = torch.zeros(B, dtype=torch.int64, device=dev)
    return (runner.kv.tensors, tokens, tokens.clone(), tokens.clone(),
            torch.zeros((B, nb), dtype=torch.int64, device=dev), rows + 1, rows)


def prefill_dynamic_shapes(runner: ModelRunner) -> tuple:
    """``torch.export`` dynamic-shape spec for the prefill forward: the pools' block count, the
    batch (when ``max_num_seqs`` >= 2), the tokens per row (2 .. :func:`prefill_tokens_max`; a
    one-token chunk is padded to 2, see :meth:`ModelRunner.run_prefill`) and the block-table
    width (when ``max_blocks_per_seq`` >= 2)."""
    pools, batch, blocks = _shared_dims(runner)
    tokens = torch.export.Dim("tokens", min=2, max=max(2, prefill_tokens_max(runner)))
    grid, row = _spec((0, batch), (1, tokens)), _spec((0, batch))
    return (pools, grid, grid, grid, _spec((0, batch), (1, blocks)), row, row)


# ------------------------------------------------------------------------------------- keys


def program_sources(runner: ModelRunner) -> list:
    """Modules whose code is traced into the program (their canonical AST is in the key): the
    family's :meth:`~model_families.family.ModelFamily.program_sources` and this module."""
    import sys

    return [*runner.family.program_sources(), sys.modules[__name__]]


def _without_none(value: Any) -> Any:
    """``value`` with ``None`` entries of dicts dropped at every depth and tuples as lists: a
    config field or a ``rope_scaling`` key set to null means the same as one left out (and a
    ``None`` would make the fingerprint ``UNKNOWN``)."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_without_none(v) for v in value]
    return value


def _arch(runner: ModelRunner) -> dict:
    """The family, its pack version and its config as JSON-able values (:func:`_without_none`)."""
    return {"family": runner.family.name, "pack_version": runner.family.pack_version,
            "config": _without_none(runner.args.to_dict())}


#: The programs a runner can install: ``decode`` (every mode) and ``prefill`` (AOTI only).
PROGRAM_KINDS = ("decode", "prefill")


def program_module(runner: ModelRunner, kind: str) -> nn.Module:
    """The module compiled for ``kind``: the decode module, or the family model (prefill)."""
    return runner.decode_module if kind == "decode" else runner.model


#: Name prefixes of the environment variables Inductor reads into its config (``TORCHINDUCTOR_MAX_AUTOTUNE``,
#: ``AOT_INDUCTOR_ENABLE_LTO``, ...), and single names that reach code generation (``CXX``: the compiler).
CODEGEN_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_INDUCTOR_", "AOT_INDUCTOR_", "AOTINDUCTOR_", "INDUCTOR_")
CODEGEN_ENV_NAMES = ("CXX",)
#: Those of them that name caches, logs, timeouts or worker pools only: the code is the same.
NOT_CODEGEN_ENV = frozenset({
    "TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_FX_GRAPH_CACHE_DEFAULT",
    "TORCHINDUCTOR_AUTOGRAD_CACHE", "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE",
    "TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TORCHINDUCTOR_COMPILE_THREADS", "TORCHINDUCTOR_WORKER_START",
    "TORCHINDUCTOR_FILE_LOCK_TIMEOUT", "TORCHINDUCTOR_COMPILE_WORKER_WAIT_TIMEOUT", "TORCHINDUCTOR_WORKER_SUPPRESS_LOGGING",
    "TORCHINDUCTOR_WORKER_LOGPATH", "TORCHINDUCTOR_DEBUG_FUSION", "TORCHINDUCTOR_ENABLED_METRIC_TABLES",
})


def codegen_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables (of ``environ``, default ``os.environ``) that can change the code
    Inductor generates: every one named by :data:`CODEGEN_ENV_PREFIXES` / :data:`CODEGEN_ENV_NAMES`
    except :data:`NOT_CODEGEN_ENV`, sorted. Part of the program key; reading the environment
    instead of Inductor's config keeps ``torch._inductor`` out of a warm start. Over-inclusion
    only costs a cache miss; a missing variable would let a differently built program be fetched."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env) if (k.startswith(CODEGEN_ENV_PREFIXES) or k in CODEGEN_ENV_NAMES)
            and k not in NOT_CODEGEN_ENV}


def program_key(runner: ModelRunner, mode: str, *, sources: list | None = None,
                kind: str = "decode") -> tuple[str, str]:
    """``(name, fingerprint)`` of the ``kind`` program (:data:`PROGRAM_KINDS`) of ``runner``
    compiled in ``mode``; ``name`` is ``<family>.<kind>.<mode>``.

    The fingerprint covers ``sources`` (default :func:`program_sources`), the layout (block size,
    max model length, max batch, max blocks per sequence, dynamic dims, KV pools, the block-table
    layout (:meth:`~model_families.block_layout.BlockLayout.describe`); for prefill the
    most tokens per row), the family and its config, the dtype, the device type, the torch thread
    count, the compile options and :func:`codegen_environment`; ``UNKNOWN`` when any part is
    unknown.
    """
    from kernel_cache_service.fingerprint import program_fingerprint

    if kind not in PROGRAM_KINDS:
        raise ValueError(f"program kind must be one of {PROGRAM_KINDS}, got {kind!r}")
    name = f"{runner.family.name}.{kind}.{mode}"
    weights = _constants(program_module(runner, kind))
    layout = {
        "block_size": runner.block_size,
        "max_model_len": runner.max_model_len,
        "max_num_seqs": runner.config.max_num_seqs,
        "max_blocks_per_seq": runner.max_blocks_per_seq,
        "dynamic": ["num_blocks", "batch", "blocks"],
        "kv_pools": [[s.name, s.layers, list(s.block_shape)] for s in runner.kv.specs],
        "block_layout": runner.layout.describe(),
        "weights": {n: str(t.dtype).removeprefix("torch.") for n, t in sorted(weights.items())},
    }
    if kind == "prefill":
        layout.update(dynamic=["num_blocks", "batch", "tokens", "blocks"], max_tokens=prefill_tokens_max(runner))
    # Inductor writes the thread count into CPU code (``num_threads(N)`` on its OpenMP loops when
    # it differs from the core count), so a program built under N threads is another program.
    options = {"mode": mode, "device": runner.device.type, "threads": torch.get_num_threads(),
               "environment": codegen_environment()}
    if mode == "aoti":
        options["inductor_configs"] = AOTI_INDUCTOR_CONFIGS
    else:
        options.update(fullgraph=True, dynamic=True)
    fp = program_fingerprint(name, sources=program_sources(runner) if sources is None else sources,
                             layout=layout, arch=_arch(runner), dtype=str(runner.dtype).removeprefix("torch."),
                             compile_options=options)
    return name, fp


# ------------------------------------------------------------------------------------- AOTI


class AotiProgram:
    """A loaded AOTInductor package bound to a decode module's tensors.

    Called like the module (``caches`` tuple, then the five decode inputs), it returns what the
    module returns: ``(logits [B, V] float32, *rows)``. The module is kept alive: the program holds
    raw pointers to its buffers.
    """

    def __init__(self, package: Path, module: nn.Module, device: torch.device) -> None:
        # torch._inductor.aoti_load_package does this plus a device-information check that probes
        # the CPU's vector ISA by *building* small programs with g++ (a C++ compiler on the warm
        # path; the ISA and CPU flags are in the fingerprint instead). Using the loader directly
        # also avoids importing torch._dynamo/_inductor on a warm start.
        loader_cls = torch._C._aoti.AOTIModelPackageLoader
        meta = loader_cls.load_metadata_from_package(str(package), "model")
        if meta.get("AOTI_DEVICE_KEY") != device.type:
            raise RuntimeError(f"the package was built for {meta.get('AOTI_DEVICE_KEY')!r}, not {device.type!r}")
        self._loader = loader_cls(str(package), "model", False, 1, -1 if device.index is None else device.index)
        # kept alive: the program holds their pointers, so they must live on its device (a host
        # pointer handed to a CUDA program by reference is a segfault, not an error)
        self._own = read_own_constants(package, device)
        constants = {**self._own, **_constants(module)}
        elsewhere = sorted(n for n, t in constants.items() if t.device.type != device.type)
        if elsewhere:
            raise RuntimeError(f"constants not on {device}: {elsewhere[:5]}")
        wanted = self._loader.get_constant_fqns()
        missing = sorted(set(wanted) - set(constants))
        if missing:
            raise RuntimeError(f"the package wants constants this model lacks: {missing[:5]}")
        # (constants, use_inactive, check_full_update, user_managed, allow_h2d_copy): by reference
        self._loader.load_constants({n: constants[n] for n in wanted}, False, True, True, False)
        self.module = module

    def __call__(self, caches: tuple[torch.Tensor, ...], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self._loader.boxed_run([*caches, *inputs]))  # the exported inputs, flattened


def compile_aoti(module: nn.Module, example: tuple, dynamic: tuple, package: Path,
                 export_lock: contextlib.AbstractContextManager | None = None) -> Path:
    """Export ``module`` at ``example`` with ``dynamic`` shapes and AOTI-compile it to the
    ``.pt2`` file ``package`` (weights not included; the small constants Inductor creates itself
    are, see the module docstring). Invokes the C++ compiler (slow; see ``docs/benchmarks.md``).
    ``export_lock`` is held while tracing only: ``torch.export`` records module calls through
    process-wide hooks, so a forward of the same modules in another thread (a runner serving
    eager while this compiles in the background) must wait for it (a few seconds)."""
    with export_lock or contextlib.nullcontext(), torch.no_grad():
        exported = torch.export.export(module, example, dynamic_shapes=dynamic, strict=False)
    own: dict[str, torch.Tensor] = {}
    with _recording_own_constants(own):
        torch._inductor.aoti_compile_and_package(exported, package_path=str(package),
                                                 inductor_configs=dict(AOTI_INDUCTOR_CONFIGS))
    if own:
        with zipfile.ZipFile(package, "a") as z:
            root = z.namelist()[0].split("/", 1)[0]  # a .pt2 archive keeps everything under one folder
            z.writestr(f"{root}/{OWN_CONSTANTS_ENTRY}", json.dumps(
                {n: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "values": t.flatten().tolist()}
                 for n, t in own.items()}))
    return package


@contextlib.contextmanager
def _recording_own_constants(out: dict[str, torch.Tensor]) -> Iterator[None]:
    """Record into ``out`` the tensor constants Inductor's lowerings add by value (no name given:
    not a module buffer) while compiling. Raises ``RuntimeError`` for one larger than
    :data:`MAX_OWN_CONSTANT_NUMEL` elements (the package would need real weight storage)."""
    from torch._inductor.graph import GraphLowering

    original = GraphLowering.add_tensor_constant

    def add_tensor_constant(self, data, name=None):
        box = original(self, data, name)
        if name is None:
            if data.numel() > MAX_OWN_CONSTANT_NUMEL:
                raise RuntimeError(f"Inductor created a {tuple(data.shape)} constant; only small ones can be "
                                   "recorded in a package without weights")
            out[box.get_name()] = data.detach().cpu().clone()
        return box

    GraphLowering.add_tensor_constant = add_tensor_constant
    try:
        yield
    finally:
        GraphLowering.add_tensor_constant = original


def read_own_constants(package: Path, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The Inductor-created constants :func:`compile_aoti` recorded in ``package`` (empty when
    none), on ``device`` (default the CPU)."""
    with zipfile.ZipFile(package) as z:
        entry = next((n for n in z.namelist() if n.endswith("/" + OWN_CONSTANTS_ENTRY)), None)
        if entry is None:
            return {}
        data = json.loads(z.read(entry))
    return {n: torch.tensor(v["values"], dtype=getattr(torch, v["dtype"]), device=device).reshape(v["shape"])
            for n, v in data.items()}


# ------------------------------------------------------------------------------------- Inductor


@contextlib.contextmanager
def _inductor_cache_dir(path: Path) -> Iterator[None]:
    """Point Inductor's on-disk caches at ``path`` for the duration (restores the old value)."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    path.mkdir(parents=True, exist_ok=True)
    with temporary_cache_dir(str(path)):
        yield


def compile_inductor(module: nn.Module, runner: ModelRunner, cache_dir: Path) -> Callable:
    """``torch.compile`` ``module`` (fullgraph, dynamic) and build every graph now, inside
    ``cache_dir``, by calling it the way the runner will: through :func:`_bind_kv` on views of
    the runner's persistent buffers, under ``inference_mode`` (Dynamo guards on strides and on
    inference-tensor dispatch keys, so synthetic inputs would leave recompiles for the first
    requests). Dynamo specialises sizes 0 and 1, so ``(B, nb)`` covers ``{1, >=2} x {1, >=2}``."""
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    decode = _bind_kv(compiled, runner)
    widths = (1, 2) if runner.max_blocks_per_seq >= 2 else (1,)
    with _inductor_cache_dir(cache_dir), torch.inference_mode():
        for b in runner.buckets:
            for nb in widths:
                decode(*runner.decode_views(b, nb))
    return compiled


# ------------------------------------------------------------------------------------- cache


def open_kernel_cache(spec: KernelCacheClient | str | Path | None) -> KernelCacheClient | None:
    """A client for ``spec``: a client as is; a ``"host:port"`` string
    (:func:`services.address.parse_address`, no ``/`` in the host, not an existing directory) a
    daemon; any other string or path an embedded store rooted there; ``None`` no cache."""
    from kernel_cache_service.client import KernelCacheClient

    if spec is None or isinstance(spec, KernelCacheClient):
        return spec
    text = str(spec)
    if isinstance(spec, str) and _is_address(text):
        return KernelCacheClient(text)
    return KernelCacheClient(root=text)


def _is_address(text: str) -> bool:
    try:
        host, _port = parse_address(text)
    except InvalidArgument:
        return False
    return "/" not in host and not os.path.isdir(text)


def _default_work_dir() -> Path:
    from services.paths import warmserve_home

    return warmserve_home() / "programs"


# ------------------------------------------------------------------------------------- entry


def load_programs(runner: ModelRunner, config: EngineConfig | None = None, *,
                  kernel_cache: KernelCacheClient | str | Path | None = None,
                  work_dir: str | Path | None = None, sources: list | None = None,
                  install: Callable[[Callable[[], None]], None] | None = None,
                  progress: Callable[[str], None] | None = None) -> ProgramsReport:
    """Fetch or compile the decode program for ``config.compile`` (default
    ``runner.config.compile``) and install it with :meth:`ModelRunner.install_decode_program`;
    in ``aoti`` mode then the prefill program likewise (:meth:`ModelRunner.install_prefill_program`;
    its failure leaves only prefill eager).

    ``kernel_cache``: a :class:`KernelCacheClient`, a daemon address ``host:port``, a store
    directory, or ``None`` (compile every launch). ``work_dir``: where fetched and compiled
    artifacts live (default ``$WARMSERVE_HOME/programs``). ``sources``: override of the traced
    sources in the key (tests). ``install``: how each ready program is installed: called with a
    no-argument function that installs it; ``None`` calls it at once. A caller that runs this in
    a background thread passes one that hands the function to the thread stepping the runner
    (:meth:`LLMEngine.call_between_steps`), so nothing changes under a running step.
    ``progress``: called with a phrase at each step that can take long ("compiling
    llama.decode.aoti here", "waiting for runner-0 to build llama.decode.aoti"). Returns the
    report; on any failure the runner is left eager.
    """
    mode = (config or runner.config).compile
    progress = progress or (lambda _what: None)
    t0 = time.perf_counter()
    if mode not in MODES:
        return ProgramsReport(mode, 0.0, f"compile {mode}: eager", source="eager")
    work = Path(work_dir) if work_dir is not None else _default_work_dir()
    try:
        cache = open_kernel_cache(kernel_cache)
    except WarmserveError as e:
        log.warning("kernel cache unusable, compiling locally: %s", e)
        cache = None
    if install is None:
        runner.install_decode_program(None)
        runner.install_prefill_program(None)

        def install(fn: Callable[[], None]) -> None:
            fn()
    try:
        try:
            work.mkdir(parents=True, exist_ok=True)
            name, fp = program_key(runner, mode, sources=sources)
            module = runner.decode_module
            if mode == "aoti":
                program, source, published, detail = _load_aoti(
                    runner, module, name, fp, cache, work, lambda: example_inputs(runner, *_dims(runner)),
                    dynamic_shapes(runner), progress)
            else:
                program, source, published, detail = _load_inductor(runner, module, name, fp, cache, work)
        except Exception as e:  # noqa: BLE001 - any compile/load failure leaves the runner eager
            log.exception("compiled programs unavailable; running eager")
            return ProgramsReport(mode, time.perf_counter() - t0,
                                  f"{mode} failed ({type(e).__name__}: {e}); eager", source="eager")
        decode = _bind_kv(program, runner)
        install(lambda: runner.install_decode_program(decode))
        prefill_source, prefill_detail = _load_prefill(runner, mode, cache, work, sources, install, progress)
    finally:
        if cache is not None and cache is not kernel_cache:
            cache.close()
    seconds = time.perf_counter() - t0
    return ProgramsReport(mode, seconds, f"{mode}: {detail}; {prefill_detail}", source=source,
                          fingerprint=fp, published=published, prefill_source=prefill_source)


def programs_cached(runner: ModelRunner, mode: str,
                    kernel_cache: KernelCacheClient | str | Path | None) -> bool:
    """Whether every program ``load_programs`` would install in ``mode`` is already in
    ``kernel_cache`` (a lookup per key, no download): then loading them is quick. ``False`` for
    no cache, an unusable one or an ``UNKNOWN`` key."""
    from kernel_cache_service.fingerprint import UNKNOWN

    if mode not in MODES or kernel_cache is None:
        return False
    kinds = PROGRAM_KINDS if mode == "aoti" else ("decode",)
    try:
        cache = open_kernel_cache(kernel_cache)
    except WarmserveError:
        return False
    try:
        keys = [program_key(runner, mode, kind=k) for k in kinds]
        return all(fp != UNKNOWN and cache.lookup(name, fp) is not None for name, fp in keys)
    except (WarmserveError, OSError):
        return False
    finally:
        if cache is not kernel_cache:
            cache.close()


def _load_prefill(runner: ModelRunner, mode: str, cache: KernelCacheClient | None, work: Path,
                  sources: list | None, install: Callable[[Callable[[], None]], None],
                  progress: Callable[[str], None]) -> tuple[str, str]:
    """Fetch or compile and install the prefill program (AOTI only: ``inductor`` mode keeps
    prefill eager, its dynamic token count would recompile graphs at run time). Returns its
    source (``hit``, ``compiled``, ``eager``) and a phrase for the report; a failure leaves
    prefill eager."""
    if mode != "aoti":
        return "eager", "prefill eager"
    if not runner.family.compiled_prefill:
        return "eager", f"prefill eager (the {runner.family.name} family compiles decode only)"
    try:
        name, fp = program_key(runner, mode, sources=sources, kind="prefill")
        program, source, _published, detail = _load_aoti(
            runner, runner.model, name, fp, cache, work, lambda: prefill_example_inputs(runner),
            prefill_dynamic_shapes(runner), progress)
    except Exception as e:  # noqa: BLE001 - prefill then runs eager; decode is compiled
        log.exception("compiled prefill unavailable; prefill runs eager")
        return "eager", f"prefill eager ({type(e).__name__}: {e})"
    install(lambda: runner.install_prefill_program(program))
    return source, detail


def _bind_kv(program: Callable, runner: ModelRunner) -> Callable:
    """The runner-facing decode callable: binds the KV pools, makes the block table
    contiguous and writes the cache rows the program returns (:meth:`ModelRunner.finish_decode`). The runner passes ``block_tables`` as a ``[:B, :nb]`` view of its persistent
    ``[max_num_seqs, max_blocks_per_seq]`` buffer (row stride ``max_blocks_per_seq``); a compiled
    program was built for contiguous inputs (AOTI does not check strides and would read the
    wrong entries; Dynamo would recompile), so it gets a copy (B * nb int64, a few KiB at most).
    The 1-D inputs are ``[:B]`` prefixes, contiguous already. The copy is made on every call
    (not only when strided) so a compiled graph always sees the same kind of tensor: ``[1, nb]``
    views count as contiguous yet keep their row stride, and a copy made under
    ``inference_mode`` is an inference tensor; Dynamo guards on both."""
    caches = runner.kv.tensors

    def decode(input_ids, positions, slot_mapping, block_tables, seq_lens):
        tables = block_tables.clone(memory_format=torch.contiguous_format)
        return runner.finish_decode(program(caches, input_ids, positions, slot_mapping, tables, seq_lens),
                                    slot_mapping)

    return decode


def _publish(cache: KernelCacheClient | None, name: str, fp: str, path: Path, holder: str) -> str:
    from kernel_cache_service.fingerprint import UNKNOWN

    if cache is None or fp == UNKNOWN:
        return ""
    try:
        return cache.publish(name, fp, path, producer=holder)
    except (WarmserveError, OSError) as e:  # the compiled program is still used
        log.warning("publishing %s/%s failed (the program compiled here is used): %s", name, fp[:12], e)
        return "FAILED"


def _fetch(cache: KernelCacheClient | None, name: str, fp: str, dest: Path) -> EntryInfo | None:
    from kernel_cache_service.fingerprint import UNKNOWN

    if cache is None or fp == UNKNOWN:
        return None
    try:
        return cache.fetch(name, fp, dest)
    except (WarmserveError, OSError) as e:
        log.warning("fetching %s/%s failed, compiling locally: %s", name, fp[:12], e)
        return None


def _evict_broken(cache: KernelCacheClient, name: str, fp: str, error: Exception) -> None:
    log.warning("kernel cache entry %s/%s does not load (%s); evicting and recompiling", name, fp[:12], error)
    try:
        cache.evict(name, fp)
    except WarmserveError as e:
        log.warning("evicting %s/%s failed: %s", name, fp[:12], e)


def _how(fp: str, cache: KernelCacheClient | None, published: str) -> str:
    from kernel_cache_service.fingerprint import UNKNOWN

    if fp == UNKNOWN:
        return "fingerprint UNKNOWN, not published"
    if cache is None:
        return "no kernel cache"
    return published or "not published"


def holder_name(runner: ModelRunner) -> str:
    """Who builds or publishes, as the kernel cache records it (lease holder, entry producer):
    ``<runner id>@<host>:<pid>``."""
    return f"{runner.config.runner_id}@{socket.gethostname()}:{os.getpid()}"


def _who(holder: str) -> str:
    """The runner id part of a :func:`holder_name` (the whole text for other producers)."""
    return holder.split("@", 1)[0] or holder


class _LeaseKeeper:
    """While its ``with`` block runs (a build), renews ``lease`` every third of its TTL in a
    daemon thread; on exit releases it if a publish did not end it already, so waiters learn
    at once that a failed build will not publish. A lost lease (renewal refused: the kernel
    cache restarted, or the lease expired and was taken over) is logged; the build goes on and
    its publish then finds the key taken (``ALREADY_PRESENT``) or stores it."""

    def __init__(self, cache: KernelCacheClient, lease) -> None:
        self.cache, self.lease = cache, lease
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="build-lease", daemon=True)

    def _renew(self) -> None:
        while not self._stop.wait(self.lease.ttl_s / 3):
            try:
                renewed = self.cache.renew(self.lease)
            except WarmserveError as e:
                log.warning("renewing the build lease on %s failed: %s", self.lease.name, e)
                continue
            if renewed is None:
                log.warning("the build lease on %s/%s was lost; building on", self.lease.name,
                            self.lease.fingerprint[:12])
                return
            self.lease = renewed

    def __enter__(self) -> _LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.cache.release(self.lease)
        except WarmserveError as e:  # it expires by itself after its TTL
            log.warning("releasing the build lease on %s failed: %s", self.lease.name, e)


#: Claim rounds before a runner stops coordinating and builds anyway (each round ends with a
#: publish it fetches, or a builder that died: this bounds a chain of failing builders).
MAX_CLAIM_ROUNDS = 5


def _single_flight(runner: ModelRunner, cache: KernelCacheClient | None, name: str, fp: str,
                   fetch: Callable[[], tuple[Callable, EntryInfo] | None],
                   build: Callable[[str], tuple[Callable, str, float]],
                   progress: Callable[[str], None]) -> tuple[Callable, str, str, str]:
    """Get program ``name``/``fp``: ``fetch()`` it from the kernel cache, or, on a miss, claim
    the key (:meth:`KernelCacheClient.claim`) and either ``build(holder)`` it holding the lease
    (renewed by :class:`_LeaseKeeper`) or wait for whoever builds it and fetch their publish.
    ``fetch`` returns ``(program, entry)`` or ``None``; ``build`` returns ``(program, published,
    seconds)``. Without a cache, for an ``UNKNOWN`` key, or when claiming fails (an old daemon, no
    token) it builds uncoordinated. ``progress`` hears what it is doing. Returns ``(program,
    source, published, detail)``."""
    from kernel_cache_service.fingerprint import UNKNOWN

    holder = holder_name(runner)

    def built(note: str = "") -> tuple[Callable, str, str, str]:
        progress(f"compiling {name} here")
        program, published, seconds = build(holder)
        return program, "compiled", published, \
            f"compiled {name} in {seconds:.1f} s here ({_how(fp, cache, published)}{note})"

    if cache is None or fp == UNKNOWN:
        return built()
    got = fetch()
    if got is not None:
        return got[0], "hit", "", f"kernel cache HIT {name} ({got[1].size_bytes / 2**20:.1f} MiB)"
    t0 = time.perf_counter()
    for _ in range(MAX_CLAIM_ROUNDS):
        try:
            handle = cache.claim(name, fp, holder=holder, ttl_s=runner.config.build_lease_s)
        except WarmserveError as e:
            log.warning("cannot claim the build of %s (%s); compiling without coordination", name, e)
            return built()
        with handle:
            claim = handle.claim
            if claim.status == "OWNER":
                with _LeaseKeeper(cache, claim.lease):
                    return built("; took over an expired build lease" if claim.takeover else "")
            if claim.status == "WAIT":
                progress(f"waiting for {_who(claim.lease.holder)} to build {name}")
                try:
                    event = handle.wait()
                except WarmserveError as e:
                    log.warning("waiting for the build of %s failed (%s); compiling here", name, e)
                    return built()
                if event.status != "PUBLISHED":
                    continue  # the builder is gone: claim again
        got = fetch()
        if got is not None:
            program, entry = got
            return program, "hit", "", (f"fetched {name} from {_who(entry.producer)}'s publish after waiting "
                                        f"{time.perf_counter() - t0:.1f} s ({entry.size_bytes / 2**20:.1f} MiB)")
    log.warning("no build of %s finished after %d claims; compiling here", name, MAX_CLAIM_ROUNDS)
    return built()


def _load_aoti(runner: ModelRunner, module: nn.Module, name: str, fp: str, cache: KernelCacheClient | None,
               work: Path, example: Callable[[], tuple], dynamic: tuple,
               progress: Callable[[str], None]) -> tuple[Callable, str, str, str]:
    """Fetch program ``name``/``fp`` or (single-flight, :func:`_single_flight`) export ``module``
    at ``example()`` with ``dynamic`` shapes, compile and publish it; returns ``(program,
    source, published, detail)``."""
    package = work / f"{name}-{fp[:24]}.pt2"

    def fetch() -> tuple[Callable, EntryInfo] | None:
        entry = _fetch(cache, name, fp, package)
        if entry is None:
            return None
        try:
            return AotiProgram(package, module, runner.device), entry
        except Exception as e:  # noqa: BLE001 - a broken package is recompiled, not fatal
            _evict_broken(cache, name, fp, e)
            return None

    def build(holder: str) -> tuple[Callable, str, float]:
        with tempfile.TemporaryDirectory(dir=work, prefix="compile-") as tmp:
            t = time.perf_counter()
            built = compile_aoti(module, example(), dynamic, Path(tmp) / "program.pt2", runner.forward_lock)
            seconds = time.perf_counter() - t
            published = _publish(cache, name, fp, built, holder)
            return AotiProgram(built, module, runner.device), published, seconds  # the loader keeps its own copy

    return _single_flight(runner, cache, name, fp, fetch, build, progress)


def _load_inductor(runner: ModelRunner, module: nn.Module, name: str, fp: str,
                   cache: KernelCacheClient | None, work: Path) -> tuple[Callable, str, str, str]:
    from kernel_cache_service.fingerprint import UNKNOWN

    if fp == UNKNOWN:
        cache_dir = Path(tempfile.mkdtemp(dir=work, prefix="inductor-"))
    else:
        cache_dir = work / f"{name}-{fp[:24]}"
    hit = _fetch(cache, name, fp, cache_dir)
    t = time.perf_counter()
    compiled = compile_inductor(module, runner, cache_dir)  # the graphs' .so files stay in cache_dir
    build_s = time.perf_counter() - t
    if hit:
        return compiled, "hit", "", f"kernel cache HIT {name}, graphs loaded in {build_s:.1f} s"
    published = _publish(cache, name, fp, cache_dir, holder_name(runner))
    return compiled, "compiled", published, f"compiled {name} in {build_s:.1f} s ({_how(fp, cache, published)})"
