"""Compiled programs: the decode step built once, kept in the kernel cache, loaded warm.

Entry point (the engine calls it once per launch, after the KV cache is allocated, when
``--compile`` is not ``off``)::

    report = load_programs(runner, config, kernel_cache=ADDR_OR_DIR_OR_CLIENT, work_dir=None)

It installs one callable per decode batch bucket in ``runner.decode_programs`` (so
``runner.decode_fn(b)`` uses it) and returns a :class:`ProgramsReport` whose ``str()`` is the
start-up phase detail, e.g. ``"aoti: kernel cache HIT llama.decode.aoti (3.6 MiB)"`` (the phase itself carries the seconds).
It never raises for a compile or cache failure: the runner then runs eager and the report says
why (a runner that serves slowly beats one that does not start).

The program
-----------
:class:`DecodeModule` is the runner's decode step (:func:`runner_service.model.forward` with one
token per row) as an ``nn.Module``: weights and RoPE tables are its buffers, the KV pools are
*inputs*, so the same program serves any KV-cache size::

    program(k_cache[L, NB, bs, nkv, hd], v_cache[...], input_ids[B], positions[B],
            slot_mapping[B], block_tables[B, nb], seq_lens[B]) -> logits[B, V] float32

with ``B`` (batch, 1..max_num_seqs), ``nb`` (block-table width, 1..max_blocks_per_seq) and ``NB``
(pool blocks) all dynamic, so ONE program covers every batch bucket and block bucket (measured:
about the cold compile time of one static program, and faster than eager at every shape tried). The KV write
inside is :func:`runner_service.kv_write.kv_write_`, an in-place custom op (see that module for
why an inline ``index_copy_`` makes compiled code copy the whole pool every step).

Modes (``--compile``)
---------------------
- ``aoti`` (the default choice): ``torch.export`` + ``torch._inductor.aoti_compile_and_package``
  with ``aot_inductor.package_constants_in_so=False``: the ``.pt2`` package holds the generated
  code and the shared library, not the weights (3.7 MiB for SmolLM2 instead of 540 MiB). At load
  the model's own tensors are handed over by reference (``load_constants(user_managed=True)``),
  so a warm launch maps one copy of the weights and loads the program in well under a second;
  nothing is compiled: the package's ``.so`` is dlopened, and the vector-ISA probe that
  ``aoti_load_package`` would build with g++ is skipped (see :class:`AotiProgram`; the ISA and
  CPU flags are part of the fingerprint instead).
- ``inductor``: ``torch.compile(fullgraph=True, dynamic=True)`` with the Inductor cache
  directory (FX graph cache: generated C++ and built ``.so`` files) as the artifact. A warm
  launch still re-traces with Dynamo (seconds per graph) but does not run the C++ compiler.
  New shapes met after start-up (e.g. batch 1 with a wider block table) may compile at run time.
- ``off``: nothing installed; :meth:`ModelRunner.decode_step` runs eager.

Measured on this 2-core CPU (SmolLM2-135M, f32, max 8 sequences, ``bench/startup.py``, machine
shared with other jobs): AOTI cold compile 93-127 s, warm programs phase 0.04-0.09 s, launch to
SERVING cold 101-139 s vs warm 3.4-15.5 s (ratio 9.0x-29.7x over 4 runs, 23.1x on a quiet
machine: the warm launch is then dominated by the first decode steps, which contention from other
processes slows down). Inductor: cold 530 s (four graphs, see :func:`compile_inductor`), warm
programs phase 41.9 s (Dynamo re-trace + cache load), SERVING in 44.5 s, and a warm launch still
runs ``g++`` (a compiler probe; with no working compiler it fails and the runner goes eager).
Steady state, decode step, AOTI vs eager: B=1/256-token context 39.8 vs 51.3 ms, B=8/256 83.5 vs
109.4 ms, B=8/512 96.5 vs 130.9 ms. AOTI is the mode to use.

Key and cache
-------------
The artifact key is ``(name, fingerprint)``: ``name`` = ``"llama.decode.<mode>"``, fingerprint =
:func:`kernel_cache_service.fingerprint.program_fingerprint` over the traced sources
(``model.py``, ``kv_write.py``, this file), the layout (block size, max model length, max
batch, max blocks per sequence, which dims are dynamic), the architecture, dtype, device and
compile options. An ``UNKNOWN`` fingerprint is compiled locally and never fetched or published.
A MISS compiles and publishes; a HIT whose bytes fail to load (corrupt entry that passed the
sha256 check, e.g. published broken) is evicted, recompiled and republished. A corrupt entry the
store detects is quarantined there and reads as a MISS.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from runner_service import kv_write as _kv_write  # registers torch.ops.warmserve.kv_write_
from runner_service import model as _model
from runner_service.model import LlamaWeights
from services.errors import WarmserveError

if TYPE_CHECKING:
    from kernel_cache_service.client import KernelCacheClient
    from runner_service.config import EngineConfig
    from runner_service.model_runner import ModelRunner

log = logging.getLogger(__name__)

MODES = ("aoti", "inductor")
PROGRAM_NAME = "llama.decode"

#: Inductor options the AOTI package is built with (part of the fingerprint).
AOTI_INDUCTOR_CONFIGS: dict[str, Any] = {"aot_inductor.package_constants_in_so": False}

#: Weight fields of :class:`LlamaWeights`, registered as buffers of :class:`DecodeModule`.
_WEIGHT_FIELDS = tuple(f.name for f in dataclasses.fields(LlamaWeights))


# ------------------------------------------------------------------------------------- report


@dataclass(frozen=True)
class ProgramsReport:
    """What :func:`load_programs` did.

    ``mode``: ``aoti`` / ``inductor``; ``seconds``: wall time of the whole programs phase;
    ``source``: ``hit`` (loaded from the kernel cache), ``compiled`` (built here) or ``eager``
    (failed; the runner runs eager); ``fingerprint``: the key used (or ``UNKNOWN``);
    ``published``: the kernel cache's answer to the publish (``PUBLISHED``, ``ALREADY_PRESENT``,
    ``REJECTED``) or ``""`` when nothing was published; ``detail``: one human sentence.
    """

    mode: str
    seconds: float
    detail: str
    source: str = ""
    fingerprint: str = ""
    published: str = ""

    def __str__(self) -> str:
        return self.detail


# ------------------------------------------------------------------------------------- module


class DecodeModule(nn.Module):
    """The decode step of a :class:`ModelRunner` as an exportable module (see the module
    docstring for the signature). Buffers: every :class:`LlamaWeights` field (``qkv_bias`` only
    when present; a tied ``lm_head`` is the same tensor as ``embed_tokens``), ``cos_table`` and
    ``sin_table`` [max_model_len, hd] float32. The buffers *are* the runner's tensors (no copy).
    """

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__()
        self.args = runner.args
        for name in _WEIGHT_FIELDS:
            tensor = getattr(runner.weights, name)
            if tensor is not None:
                self.register_buffer(name, tensor, persistent=False)
        self.register_buffer("cos_table", runner.cos, persistent=False)
        self.register_buffer("sin_table", runner.sin, persistent=False)

    def weights(self) -> LlamaWeights:
        return LlamaWeights(**{n: getattr(self, n, None) for n in _WEIGHT_FIELDS})

    def forward(self, k_cache: torch.Tensor, v_cache: torch.Tensor, input_ids: torch.Tensor,
                positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor) -> torch.Tensor:
        return _model.forward(self.weights(), self.args, k_cache, v_cache, self.cos_table, self.sin_table,
                              input_ids[:, None], positions[:, None], slot_mapping[:, None], block_tables,
                              seq_lens, torch.zeros_like(input_ids))

    def constants(self) -> dict[str, torch.Tensor]:
        """Buffer name -> tensor, duplicates (a tied head) included: what AOTI asks for."""
        return dict(self.named_buffers(remove_duplicate=False))


def example_inputs(runner: ModelRunner, batch: int, blocks: int) -> tuple[torch.Tensor, ...]:
    """Decode inputs for ``batch`` padding rows over ``blocks`` block-table entries: every slot
    and block id is the scratch block 0, ``seq_lens`` 1; K/V pools are the runner's."""
    dev = runner.device
    zeros = torch.zeros(batch, dtype=torch.int64, device=dev)
    return (runner.kv.k, runner.kv.v, zeros, zeros.clone(), zeros.clone(),
            torch.zeros((batch, blocks), dtype=torch.int64, device=dev), torch.ones_like(zeros))


def _dims(runner: ModelRunner) -> tuple[int, int]:
    """Example sizes (batch, blocks): 2 where the dim is dynamic (export specialises 0 and 1)."""
    return (2 if runner.config.max_num_seqs >= 2 else 1, 2 if runner.max_blocks_per_seq >= 2 else 1)


def dynamic_shapes(runner: ModelRunner) -> tuple:
    """``torch.export`` dynamic-shape spec for :class:`DecodeModule`: the pool block count,
    the batch (when ``max_num_seqs`` >= 2) and the block-table width (when
    ``max_blocks_per_seq`` >= 2)."""
    Dim = torch.export.Dim
    pool = {1: Dim("num_blocks", min=2)}
    batch = Dim("batch", min=1, max=runner.config.max_num_seqs) if runner.config.max_num_seqs >= 2 else None
    blocks = Dim("blocks", min=1, max=runner.max_blocks_per_seq) if runner.max_blocks_per_seq >= 2 else None
    row = {0: batch} if batch is not None else None
    table = {k: v for k, v in ((0, batch), (1, blocks)) if v is not None} or None
    return (pool, pool, row, row, row, table, row)


# ------------------------------------------------------------------------------------- keys


def program_sources() -> list:
    """Modules whose code is traced into the program (their canonical AST is in the key)."""
    import sys

    return [_model, _kv_write, sys.modules[__name__]]


def _arch(runner: ModelRunner) -> dict:
    """The architecture as JSON-able values; ``None`` fields are left out (absent is a value)."""
    return {k: (list(v) if isinstance(v, tuple) else v)
            for k, v in dataclasses.asdict(runner.args).items() if v is not None}


def program_key(runner: ModelRunner, mode: str, *, sources: list | None = None) -> tuple[str, str]:
    """``(name, fingerprint)`` of the decode program of ``runner`` compiled in ``mode``.

    The fingerprint covers ``sources`` (default :func:`program_sources`), the layout (block size,
    max model length, max batch, max blocks per sequence, dynamic dims), the architecture, the
    dtype, the device type and the compile options; ``UNKNOWN`` when any part is unknown.
    """
    from kernel_cache_service.fingerprint import program_fingerprint

    name = f"{PROGRAM_NAME}.{mode}"
    layout = {
        "block_size": runner.block_size,
        "max_model_len": runner.max_model_len,
        "max_num_seqs": runner.config.max_num_seqs,
        "max_blocks_per_seq": runner.max_blocks_per_seq,
        "dynamic": ["num_blocks", "batch", "blocks"],
        "kv_layout": "L,num_blocks,block_size,nkv,hd",
    }
    options = {"mode": mode, "device": runner.device.type}
    if mode == "aoti":
        options["inductor_configs"] = AOTI_INDUCTOR_CONFIGS
    else:
        options.update(fullgraph=True, dynamic=True)
    fp = program_fingerprint(name, sources=program_sources() if sources is None else sources, layout=layout,
                             arch=_arch(runner), dtype=str(runner.weights.embed_tokens.dtype).removeprefix("torch."),
                             compile_options=options)
    return name, fp


# ------------------------------------------------------------------------------------- AOTI


class AotiProgram:
    """A loaded AOTInductor package bound to a :class:`DecodeModule`'s tensors.

    Calling it with the seven decode inputs returns logits [B, V] float32 and writes K/V in
    place. The module is kept alive: the program holds raw pointers to its buffers.
    """

    def __init__(self, package: Path, module: DecodeModule, device: torch.device) -> None:
        # torch._inductor.aoti_load_package does this plus a device-information check that probes
        # the CPU's vector ISA by *building* small programs with g++ (seconds, and a C++ compiler
        # on the warm path; the ISA and CPU flags are in the fingerprint instead). Using the
        # loader directly also avoids importing torch._dynamo/_inductor (~1 s) on a warm start.
        loader_cls = torch._C._aoti.AOTIModelPackageLoader
        meta = loader_cls.load_metadata_from_package(str(package), "model")
        if meta.get("AOTI_DEVICE_KEY") != device.type:
            raise RuntimeError(f"the package was built for {meta.get('AOTI_DEVICE_KEY')!r}, not {device.type!r}")
        self._loader = loader_cls(str(package), "model", False, 1, -1 if device.index is None else device.index)
        constants = module.constants()
        wanted = self._loader.get_constant_fqns()
        missing = sorted(set(wanted) - set(constants))
        if missing:
            raise RuntimeError(f"the package wants constants this model lacks: {missing[:5]}")
        # (constants, use_inactive, check_full_update, user_managed, allow_h2d_copy): by reference
        self._loader.load_constants({n: constants[n] for n in wanted}, False, True, True, False)
        self.module = module

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        (logits,) = self._loader.boxed_run(list(inputs))
        return logits


def compile_aoti(module: DecodeModule, example: tuple[torch.Tensor, ...], dynamic: tuple, package: Path) -> Path:
    """Export ``module`` at ``example`` with ``dynamic`` shapes and AOTI-compile it to the
    ``.pt2`` file ``package`` (weights not included). Invokes the C++ compiler (tens of seconds)."""
    with torch.no_grad():
        exported = torch.export.export(module, example, dynamic_shapes=dynamic, strict=False)
    torch._inductor.aoti_compile_and_package(exported, package_path=str(package),
                                             inductor_configs=dict(AOTI_INDUCTOR_CONFIGS))
    return package


# ------------------------------------------------------------------------------------- Inductor


@contextlib.contextmanager
def _inductor_cache_dir(path: Path) -> Iterator[None]:
    """Point Inductor's on-disk caches at ``path`` for the duration (restores the old value)."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    path.mkdir(parents=True, exist_ok=True)
    with temporary_cache_dir(str(path)):
        yield


def compile_inductor(module: DecodeModule, runner: ModelRunner, cache_dir: Path) -> Callable:
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
                decode(*runner.buffers.views(b, nb))
    return compiled


# ------------------------------------------------------------------------------------- cache


_ADDRESS = re.compile(r"^[A-Za-z0-9.\-]+:\d{1,5}$|^\[[0-9A-Fa-f:]+\]:\d{1,5}$")


def open_kernel_cache(spec: KernelCacheClient | str | Path | None) -> KernelCacheClient | None:
    """A client for ``spec``: a client as is; ``"host:port"`` a daemon; any other string or path
    an embedded store rooted there; ``None`` no cache."""
    from kernel_cache_service.client import KernelCacheClient

    if spec is None or isinstance(spec, KernelCacheClient):
        return spec
    text = str(spec)
    if isinstance(spec, str) and _ADDRESS.match(text) and not os.path.isdir(text):
        return KernelCacheClient(text)
    return KernelCacheClient(root=text)


def _default_work_dir() -> Path:
    from services.paths import warmserve_home

    return warmserve_home() / "programs"


# ------------------------------------------------------------------------------------- entry


def load_programs(runner: ModelRunner, config: EngineConfig | None = None, *,
                  kernel_cache: KernelCacheClient | str | Path | None = None,
                  work_dir: str | Path | None = None, sources: list | None = None) -> ProgramsReport:
    """Fetch or compile the decode program for ``config.compile`` (default
    ``runner.config.compile``) and install it for every bucket in ``runner.decode_programs``.

    ``kernel_cache``: a :class:`KernelCacheClient`, a daemon address ``host:port``, a store
    directory, or ``None`` (compile every launch). ``work_dir``: where fetched and compiled
    artifacts live (default ``$WARMSERVE_HOME/programs``). ``sources``: override of the traced
    sources in the key (tests). Returns the report; on any failure the runner is left eager.
    """
    mode = (config or runner.config).compile
    t0 = time.perf_counter()
    if mode not in MODES:
        return ProgramsReport(mode, 0.0, f"compile {mode}: eager", source="eager")
    work = Path(work_dir) if work_dir is not None else _default_work_dir()
    try:
        cache = open_kernel_cache(kernel_cache)
    except WarmserveError as e:
        log.warning("kernel cache unusable, compiling locally: %s", e)
        cache = None
    runner.decode_programs.clear()
    try:
        work.mkdir(parents=True, exist_ok=True)
        name, fp = program_key(runner, mode, sources=sources)
        module = DecodeModule(runner).eval()
        build = _load_aoti if mode == "aoti" else _load_inductor
        program, source, published, detail = build(runner, module, name, fp, cache, work)
    except Exception as e:  # noqa: BLE001 - any compile/load failure leaves the runner eager
        log.exception("compiled programs unavailable; running eager")
        return ProgramsReport(mode, time.perf_counter() - t0, f"{mode} failed ({type(e).__name__}: {e}); eager",
                              source="eager")
    finally:
        if cache is not None and cache is not kernel_cache:
            cache.close()
    bound = _bind_kv(program, runner)
    for b in runner.buckets:
        runner.decode_programs[b] = bound
    seconds = time.perf_counter() - t0
    return ProgramsReport(mode, seconds, f"{mode}: {detail}", source=source,
                          fingerprint=fp, published=published)


def _bind_kv(program: Callable, runner: ModelRunner) -> Callable:
    """The runner-facing decode callable: binds the KV pools and makes the block table
    contiguous. The runner passes ``block_tables`` as a ``[:B, :nb]`` view of its persistent
    ``[max_num_seqs, max_blocks_per_seq]`` buffer (row stride ``max_blocks_per_seq``); a compiled
    program was built for contiguous inputs (AOTI does not check strides and would read the
    wrong entries; Dynamo would recompile), so it gets a copy (B * nb int64, a few KiB at most).
    The 1-D inputs are ``[:B]`` prefixes, contiguous already. The copy is made on every call
    (not only when strided) so a compiled graph always sees the same kind of tensor: ``[1, nb]``
    views count as contiguous yet keep their row stride, and a copy made under
    ``inference_mode`` is an inference tensor; Dynamo guards on both."""
    k, v = runner.kv.k, runner.kv.v

    def decode(input_ids, positions, slot_mapping, block_tables, seq_lens):
        tables = block_tables.clone(memory_format=torch.contiguous_format)
        return program(k, v, input_ids, positions, slot_mapping, tables, seq_lens)

    return decode


def _publish(cache: KernelCacheClient | None, name: str, fp: str, path: Path) -> str:
    from kernel_cache_service.fingerprint import UNKNOWN

    if cache is None or fp == UNKNOWN:
        return ""
    try:
        return cache.publish(name, fp, path, producer=f"warmserve-runner:{os.getpid()}")
    except WarmserveError as e:
        log.warning("publishing %s/%s failed: %s", name, fp[:12], e)
        return "FAILED"


def _fetch(cache: KernelCacheClient | None, name: str, fp: str, dest: Path) -> bool:
    from kernel_cache_service.fingerprint import UNKNOWN

    if cache is None or fp == UNKNOWN:
        return False
    try:
        return cache.fetch(name, fp, dest) is not None
    except WarmserveError as e:
        log.warning("fetching %s/%s failed, compiling locally: %s", name, fp[:12], e)
        return False


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


def _load_aoti(runner: ModelRunner, module: DecodeModule, name: str, fp: str,
               cache: KernelCacheClient | None, work: Path) -> tuple[Callable, str, str, str]:
    package = work / f"{name}-{fp[:24]}.pt2"
    if _fetch(cache, name, fp, package):
        try:
            program = AotiProgram(package, module, runner.device)
            return program, "hit", "", f"kernel cache HIT {name} ({package.stat().st_size / 2**20:.1f} MiB)"
        except Exception as e:  # noqa: BLE001 - a broken package is recompiled, not fatal
            _evict_broken(cache, name, fp, e)
    with tempfile.TemporaryDirectory(dir=work, prefix="compile-") as tmp:
        t = time.perf_counter()
        built = compile_aoti(module, example_inputs(runner, *_dims(runner)), dynamic_shapes(runner),
                             Path(tmp) / "program.pt2")
        compile_s = time.perf_counter() - t
        published = _publish(cache, name, fp, built)
        program = AotiProgram(built, module, runner.device)  # the loader keeps its own extracted copy
    return program, "compiled", published, f"compiled {name} in {compile_s:.1f} s ({_how(fp, cache, published)})"


def _load_inductor(runner: ModelRunner, module: DecodeModule, name: str, fp: str,
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
    published = _publish(cache, name, fp, cache_dir)
    return compiled, "compiled", published, f"compiled {name} in {build_s:.1f} s ({_how(fp, cache, published)})"
