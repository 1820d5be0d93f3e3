"""The entry point: fetch or compile a runner's programs and install them, never failing the
launch (a runner that serves eager beats one that does not start) (``docs/architecture.md`` §9)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kernel_cache_service.fingerprint import UNKNOWN
from runner_service.programs import aoti, inductor
from runner_service.programs.cache import miss_note, open_kernel_cache, record_wanted, trust_note
from runner_service.programs.key import program_key
from runner_service.programs.spec import MODES, ProgramSpec
from services.errors import Cancelled, Untrusted, WarmserveError

if TYPE_CHECKING:
    from kernel_cache_service.client import KernelCacheClient

log = logging.getLogger(__name__)

#: ``install(kind, program)``: makes ``program`` (``program(caches, *inputs) -> (logits, *rows)``,
#: see :mod:`runner_service.model_runner`) the runner's ``kind`` step.
Install = Callable[[str, Callable], None]


@dataclass(frozen=True)
class ProgramsReport:
    """What :func:`load_programs` did.

    ``mode``: ``aoti`` / ``inductor``; ``seconds``: wall time of the whole programs phase;
    ``source``: ``hit`` (loaded from the kernel cache), ``compiled`` (built here) or ``eager``
    (failed; the runner runs eager); ``fingerprint``: the key used (or ``UNKNOWN``);
    ``published``: the kernel cache's answer to the publish (``PUBLISHED``, ``ALREADY_PRESENT``,
    ``REJECTED``) or ``""`` when nothing was published (these three are the decode program's);
    ``prefill_source`` / ``verify_source``: ``hit`` / ``compiled`` / ``eager`` for the prefill and
    verify programs (``""`` when decode failed first, or for verify when not speculating);
    ``detail``: one human sentence.
    """

    mode: str
    seconds: float
    detail: str
    source: str = ""
    fingerprint: str = ""
    published: str = ""
    prefill_source: str = ""
    verify_source: str = ""

    def __str__(self) -> str:
        return self.detail


def _default_work_dir() -> Path:
    from services.paths import default_programs_dir

    return default_programs_dir()


def load_programs(spec: ProgramSpec, install: Install, *,
                  kernel_cache: KernelCacheClient | str | Path | None = None,
                  work_dir: str | Path | None = None, sources: list | None = None,
                  defer: Callable[[Callable[[], None]], None] | None = None,
                  progress: Callable[[str], None] | None = None,
                  compiler: aoti.Compiler | None = None) -> ProgramsReport:
    """Fetch or compile the decode program for ``spec.mode`` and ``install("decode", program)``;
    in ``aoti`` mode then the prefill program and, while speculating, the verify program likewise
    (:meth:`ProgramSpec.kinds`; a failure of one leaves only that step eager).

    ``kernel_cache``: a :class:`KernelCacheClient`, a daemon address ``host:port``, a store
    directory, or ``None`` (compile every launch). ``work_dir``: where fetched and compiled
    artifacts live (default ``$WARMSERVE_HOME/programs``). ``sources``: override of the traced
    sources in the key (tests). ``defer``: how each install is run: called with a no-argument
    function that installs; ``None`` calls it at once. A caller that runs this in a background
    thread passes one that hands the function to the thread stepping the runner
    (:meth:`LLMEngine.call_between_steps`), so nothing changes under a running step.
    ``progress``: called with a phrase at each step that can take long ("compiling
    llama.decode.aoti here", "waiting for runner-0 to build llama.decode.aoti"). ``compiler``:
    what builds an AOTI program on a MISS (:data:`~runner_service.programs.aoti.Compiler`;
    default in this process; the engine's background build passes one that compiles in a child
    process, :mod:`runner_service.programs.build_child`). Returns the
    report; on any failure nothing is installed for that program (the runner stays eager), and a
    compile ``compiler`` cancels (``services.errors.Cancelled``: shutting down) is raised. A
    client with trusted keys refuses a fetched program whose signature fails before writing it
    (the program is compiled here instead); the report's detail ends with
    :func:`~runner_service.programs.cache.trust_note` (``artifacts not verified``, or each refusal).
    """
    mode = spec.mode
    progress = progress or (lambda _what: None)
    defer = defer or (lambda fn: fn())
    t0 = time.perf_counter()
    if mode not in MODES:
        return ProgramsReport(mode, 0.0, f"compile {mode}: eager", source="eager")
    work = Path(work_dir) if work_dir is not None else _default_work_dir()
    try:
        cache = open_kernel_cache(kernel_cache)
    except WarmserveError as e:
        log.warning("kernel cache unusable, compiling locally: %s", e)
        cache = None
    refused_before = len(cache.refusals) if cache is not None else 0
    try:
        try:
            work.mkdir(parents=True, exist_ok=True)
            name, fp = program_key(spec, mode, sources=sources)
            record_wanted(work, name, fp)
            if mode == "aoti":
                program, source, published, detail = aoti.load_aoti(spec, "decode", name, fp, cache, work, progress,
                                                                    compiler)
            else:
                program, source, published, detail = inductor.load_inductor(spec, name, fp, cache, work)
            detail = _with_miss_note(detail, source, cache, name, fp)
        except Cancelled:  # the build was stopped (shutting down): no failure to report
            raise
        except Exception as e:  # noqa: BLE001 - any compile/load failure leaves the runner eager
            log.exception("compiled programs unavailable; running eager")
            return ProgramsReport(mode, time.perf_counter() - t0, f"{mode} failed ({type(e).__name__}: {e}); eager; "
                                  f"{trust_note(cache, refused_before)}", source="eager")
        defer(lambda: install("decode", program))
        prefill_source, prefill_detail = _load_step(spec, "prefill", cache, work, sources, install, defer,
                                                    progress, compiler)
        verify_source, verify_detail = "", ""
        if spec.verify_module is not None:
            verify_source, verify_detail = _load_step(spec, "verify", cache, work, sources, install, defer,
                                                      progress, compiler)
            verify_detail = f"; {verify_detail}"
        trust = trust_note(cache, refused_before)
    finally:
        if cache is not None and cache is not kernel_cache:
            cache.close()
    seconds = time.perf_counter() - t0
    return ProgramsReport(mode, seconds, f"{mode}: {detail}; {prefill_detail}{verify_detail}; {trust}",
                          source=source, fingerprint=fp, published=published, prefill_source=prefill_source,
                          verify_source=verify_source)


def _with_miss_note(detail: str, source: str, cache: KernelCacheClient | None, name: str, fp: str) -> str:
    """``detail``, and for a program built here (``source`` ``compiled``) the parts in which its
    key differs from the nearest stored entry of its name (:func:`cache.miss_note`)."""
    note = miss_note(cache, name, fp) if source == "compiled" else ""
    return f"{detail}; {note}" if note else detail


def programs_cached(spec: ProgramSpec, mode: str, kernel_cache: KernelCacheClient | str | Path | None) -> bool:
    """Whether every program ``load_programs`` would install in ``mode`` is already in
    ``kernel_cache`` (a lookup per key, no download) and, when it has trusted keys, signed by one:
    then loading them is quick. ``False`` for no cache, an unusable one or an ``UNKNOWN`` key."""
    if mode not in MODES or kernel_cache is None:
        return False
    kinds = spec.kinds() if mode == "aoti" else ("decode",)
    try:
        cache = open_kernel_cache(kernel_cache)
    except WarmserveError:
        return False
    try:
        keys = [program_key(spec, mode, kind=k) for k in kinds]
        return all(fp != UNKNOWN and _trusted_hit(cache, name, fp) for name, fp in keys)
    except (WarmserveError, OSError):
        return False
    finally:
        if cache is not kernel_cache:
            cache.close()


def _trusted_hit(cache: KernelCacheClient, name: str, fp: str) -> bool:
    """A HIT whose signature the client's trusted keys accept (any HIT without trusted keys)."""
    entry = cache.lookup(name, fp)
    if entry is None or cache.trusted_keys is None:
        return entry is not None
    try:
        cache.trusted_keys.verify(entry.signed_payload(), entry.signature, f"program {name}")
    except Untrusted:
        return False
    return True


def _load_step(spec: ProgramSpec, kind: str, cache: KernelCacheClient | None, work: Path, sources: list | None,
               install: Install, defer: Callable[[Callable[[], None]], None],
               progress: Callable[[str], None], compiler: aoti.Compiler | None) -> tuple[str, str]:
    """Fetch or compile and install the ``kind`` program, ``prefill`` or ``verify`` (AOTI only:
    ``inductor`` mode keeps them eager, their dynamic token count would recompile graphs at run
    time; and only a kind :meth:`ProgramSpec.kinds` lists). Returns
    its source (``hit``, ``compiled``, ``eager``) and a phrase for the report; a failure leaves
    that step eager."""
    if spec.mode != "aoti":
        return "eager", f"{kind} eager"
    if kind not in spec.kinds():
        return "eager", f"{kind} eager (the {spec.family.name} family does not compile its {kind} step)"
    try:
        name, fp = program_key(spec, spec.mode, sources=sources, kind=kind)
        record_wanted(work, name, fp)
        program, source, _published, detail = aoti.load_aoti(spec, kind, name, fp, cache, work, progress, compiler)
        detail = _with_miss_note(detail, source, cache, name, fp)
    except Cancelled:
        raise
    except Exception as e:  # noqa: BLE001 - the step then runs eager; decode is compiled
        log.exception("compiled %s unavailable; %s runs eager", kind, kind)
        return "eager", f"{kind} eager ({type(e).__name__}: {e})"
    defer(lambda: install(kind, program))
    return source, detail
