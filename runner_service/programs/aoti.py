"""AOTInductor mode: export, compile to a ``.pt2`` package without the weights, load it bound to
the model's own tensors, fetch-or-build it through the kernel cache (``docs/architecture.md`` §9)."""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from model_families import kv_write as _kv_write  # noqa: F401  (registers torch.ops.warmserve.kv_write_)
from model_families.linear import opaque_quantized_kernels
from runner_service.programs import cache as kc
from runner_service.programs import export_specs
from runner_service.programs.spec import ProgramSpec, module_constants

if TYPE_CHECKING:
    from kernel_cache_service.client import KernelCacheClient
    from kernel_cache_service.entry import EntryInfo

#: Inductor options the AOTI package is built with (part of the fingerprint). Not
#: ``cpp.dynamic_threads`` (code that reads the thread count at run time): measured slower on one
#: thread (``docs/benchmarks.md``), so the code keeps the building process's thread count.
AOTI_INDUCTOR_CONFIGS: dict[str, Any] = {"aot_inductor.package_constants_in_so": False}
#: Where in a package :func:`compile_aoti` stores the constants Inductor created itself.
OWN_CONSTANTS_ENTRY = "warmserve/inductor_constants.json"
#: The largest Inductor-created constant (elements) recorded; a larger one fails the compile.
MAX_OWN_CONSTANT_NUMEL = 64


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
        constants = {**self._own, **module_constants(module)}
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
    are, see :func:`read_own_constants`). Invokes the C++ compiler (slow; see ``docs/benchmarks.md``).
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
    none), on ``device`` (default the CPU). Inductor may create small constants that are no buffer
    of the module (its int4 matmul lowering makes the group size an int64 scalar tensor); a package
    without its weights would lack them at load, so they travel in it as
    :data:`OWN_CONSTANTS_ENTRY` (JSON: name -> dtype, shape, values)."""
    with zipfile.ZipFile(package) as z:
        entry = next((n for n in z.namelist() if n.endswith("/" + OWN_CONSTANTS_ENTRY)), None)
        if entry is None:
            return {}
        data = json.loads(z.read(entry))
    return {n: torch.tensor(v["values"], dtype=getattr(torch, v["dtype"]), device=device).reshape(v["shape"])
            for n, v in data.items()}


#: ``compile(spec, kind, package) -> package``: writes the ``kind`` program of ``spec`` to the
#: ``.pt2`` path ``package`` (:func:`compile_program` here, or in a build child).
Compiler = Callable[[ProgramSpec, str, Path], Path]


def compile_program(spec: ProgramSpec, kind: str, package: Path) -> Path:
    """Export the ``kind`` module of ``spec`` at its example inputs with its dynamic shapes
    (:mod:`runner_service.programs.export_specs`), its layers in ``spec.layers``' form, and
    AOTI-compile it to ``package`` (:func:`compile_aoti`). Prefill and verify run their int4
    matrices as ``warmserve::int4_linear`` (:func:`~model_families.linear.opaque_quantized_kernels`:
    int4 kernel or dense matmul by the row count at run time); decode calls the int4 kernel."""
    if kind == "decode":
        example, dynamic = export_specs.example_inputs(spec), export_specs.dynamic_shapes(spec)
    elif kind == "verify":
        example, dynamic = export_specs.verify_example_inputs(spec), export_specs.verify_dynamic_shapes(spec)
    else:
        example, dynamic = export_specs.prefill_example_inputs(spec), export_specs.prefill_dynamic_shapes(spec)
    spec.model.loop_layers(spec.layers == "loop")  # read by the export only: eager steps never loop
    try:
        with contextlib.nullcontext() if kind == "decode" else opaque_quantized_kernels():
            return compile_aoti(spec.module(kind), example, dynamic, package, spec.forward_lock)
    finally:
        spec.model.loop_layers(False)


def load_aoti(spec: ProgramSpec, kind: str, name: str, fp: str, cache: KernelCacheClient | None, work: Path,
              progress: Callable[[str], None], compiler: Compiler | None = None) -> kc.Loaded:
    """Fetch the ``kind`` program ``name``/``fp`` or (single flight, :func:`cache.get_or_build`)
    build it with ``compiler`` (default :func:`compile_program`, in this process), publish it and
    load it bound to ``spec``'s tensors. A fetched package that does not load is evicted and rebuilt."""
    module = spec.module(kind)
    package = work / f"{name}-{fp[:24]}.pt2"

    def fetch() -> tuple[Callable, EntryInfo] | None:
        entry = kc.fetch(cache, name, fp, package)
        if entry is None:
            return None
        try:
            return AotiProgram(package, module, spec.device), entry
        except Exception as e:  # noqa: BLE001 - a broken package is recompiled, not fatal
            kc.evict_broken(cache, name, fp, e)
            return None

    def build(holder: str) -> tuple[Callable, str, float]:
        with tempfile.TemporaryDirectory(dir=work, prefix="compile-") as tmp:
            t = time.perf_counter()
            built = (compiler or compile_program)(spec, kind, Path(tmp) / "program.pt2")
            seconds = time.perf_counter() - t
            published = kc.publish(cache, name, fp, built, holder)
            return AotiProgram(built, module, spec.device), published, seconds  # the loader keeps its own copy

    return kc.get_or_build(spec, cache, name, fp, fetch, build, progress)
