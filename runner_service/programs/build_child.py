"""The build child: a runner's AOTI programs compiled in a process of their own
(``python -m runner_service.programs.build_child``), so that the trace, Inductor and the C++
compiler share no interpreter, GIL, export hooks or lock with the steps the runner serves
meanwhile (``docs/architecture.md`` §9).

The parent (:class:`BuildChild`, used by :class:`runner_service.program_installer.ProgramInstaller`)
keeps everything that talks to the kernel cache: it claims the key, renews the lease, publishes
the package the child wrote, loads it bound to its own tensors and installs it between two steps.
The child holds no credential (no token, no signing key): it maps the same sidecar (or, for an
engine built from weights in memory, makes random weights of the same shapes and dtypes: the
values never reach the program, whose constants are bound at load), builds the same
:class:`~runner_service.programs.spec.ProgramSpec` and refuses to compile when its program key
differs from the runner's (thread count, environment, code).

Protocol, JSON lines over pipes (nothing on argv): the parent writes one :class:`ChildSetup` on
the child's stdin, then one request per program, ``{"kind": "decode", "layers": "loop",
"package": PATH, "fingerprint": FP}`` (``layers``: :data:`~runner_service.programs.spec.PROGRAM_LAYERS`); the child answers each on its stdout, ``{"ok": true, "seconds": S}`` or
``{"ok": false, "error": "Type: why"}``, and exits at the end of its stdin. Its stderr is the
parent's (JSON log lines of service ``build-child``, warnings and errors only); it dies with the thread that started it
(``PR_SET_PDEATHSIG`` on Linux).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.errors import Cancelled, Internal

if TYPE_CHECKING:
    from runner_service.model_runner import ModelRunner
    from runner_service.programs.spec import ProgramSpec

log = logging.getLogger(__name__)

#: The module run as the child (``python -m``).
CHILD_MODULE = "runner_service.programs.build_child"
#: Seconds :meth:`BuildChild.close` waits for an idle child to exit before killing it.
CLOSE_WAIT_S = 5.0
#: Seconds one program's compile may take in the child before it is killed (a hung compiler
#: would otherwise hold the build lease, which the parent renews, and every waiting runner).
COMPILE_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class ChildSetup:
    """What a build child builds its :class:`ProgramSpec` from (JSON on its stdin).

    ``family`` (registered name) and ``config`` (its ``to_dict()``); ``engine``: the
    :class:`~runner_service.config.EngineConfig` fields; ``num_blocks``: the KV pools' block count
    (CPU pools are untouched zero pages, so the same count costs the child nothing; another
    device gets 2, the least the dynamic dim allows, rather than a second full KV cache);
    ``dtype`` (``float32``, ``bfloat16``) and ``device`` (``cpu``, ``cuda:0``); ``threads``: the
    torch thread count the runner serves with (in the key: the child compiles for it);
    ``sidecar``: the sidecar directory, or ``None`` (random weights in ``weights_dtype``:
    ``f32``, ``bf16``, ``int8``, ``int4``); ``nice``: added to the child's nice value;
    ``cpus``: the CPUs it may run on (``None``: the parent's).
    """

    family: str
    config: dict[str, Any]
    engine: dict[str, Any]
    num_blocks: int
    dtype: str
    device: str
    threads: int
    sidecar: str | None = None
    weights_dtype: str = "f32"
    nice: int = 0
    cpus: list[int] | None = None

    @classmethod
    def of(cls, runner: ModelRunner, spec: ProgramSpec, *, sidecar: str | Path | None, weights_dtype: str,
           nice: int, cpus: list[int] | None = None) -> ChildSetup:
        """The setup that rebuilds ``runner``'s ``spec`` (its thread count included)."""
        blocks = runner.kv.num_blocks if runner.device.type == "cpu" else 2
        return cls(family=runner.family.name, config=runner.args.to_dict(), engine=asdict(runner.config),
                   num_blocks=blocks, dtype=str(runner.dtype).removeprefix("torch."), device=str(runner.device),
                   threads=spec.threads, sidecar=None if sidecar is None else str(sidecar),
                   weights_dtype=weights_dtype, nice=nice, cpus=cpus)


class BuildChild:
    """The parent's handle on one build child, started on the first :meth:`compile` and reused
    for the next program. ``pid`` is the child's (``None`` before it starts); :meth:`stop` kills
    it from any thread (the :meth:`compile` in progress then raises)."""

    def __init__(self, setup: ChildSetup, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self.setup, self.timeout_s = setup, timeout_s
        self._proc: subprocess.Popen | None = None
        self._stopped = False
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def compile(self, spec: ProgramSpec, kind: str, package: Path) -> Path:
        """Have the child write the ``kind`` program of ``spec`` to ``package`` (an
        :data:`~runner_service.programs.aoti.Compiler`); blocks until it answers. Raises
        ``services.errors.Internal`` when the child refuses or fails (its reason), dies (how: a
        signal or an exit status) or takes longer than :attr:`timeout_s` (it is killed);
        ``services.errors.Cancelled`` when it was stopped (:meth:`stop`, :meth:`close`)."""
        from runner_service.programs.key import program_key

        name, want = program_key(spec, spec.mode, kind=kind)  # the runner's key: the child checks its own against it
        proc = self._start()
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            proc.kill()

        watchdog = threading.Timer(self.timeout_s, kill)
        watchdog.daemon = True
        watchdog.start()
        try:
            proc.stdin.write(json.dumps({"kind": kind, "layers": spec.layers, "package": str(package),
                                         "fingerprint": want}) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except (OSError, ValueError):  # a closed pipe: the child is gone
            line = ""
        finally:
            watchdog.cancel()
        if timed_out.is_set():
            proc.wait()
            raise Internal(f"the build child (pid {proc.pid}) took longer than {self.timeout_s:.0f} s to compile "
                           f"{name}: killed")
        if not line:
            gone = self._gone(name)
            raise Cancelled(gone) if self._stopped else Internal(gone)
        reply = json.loads(line)
        if not reply.get("ok"):
            raise Internal(f"the build child (pid {proc.pid}) failed to compile {name}: {reply.get('error')}")
        return package

    def _start(self) -> subprocess.Popen:
        with self._lock:
            if self._stopped:
                raise Cancelled("the build child was stopped (the runner is shutting down)")
            if self._proc is None:
                root = str(Path(__file__).resolve().parents[2])  # the tree this code runs from
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
                self._proc = subprocess.Popen([sys.executable, "-m", CHILD_MODULE], stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, env=env, text=True, close_fds=True)
                self._proc.stdin.write(json.dumps(asdict(self.setup)) + "\n")
                self._proc.stdin.flush()
            return self._proc

    def _gone(self, name: str) -> str:
        proc = self._proc
        rc = proc.wait()
        if self._stopped:
            return f"the build child (pid {proc.pid}) was stopped while compiling {name} (the runner is shutting down)"
        how = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with status {rc}"
        return f"the build child (pid {proc.pid}) {how} while compiling {name}"

    def stop(self) -> None:
        """Kill the child now (any thread); a :meth:`compile` in progress raises."""
        with self._lock:
            self._stopped = True
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def close(self) -> None:
        """End the child: close its stdin (it exits), kill it after :data:`CLOSE_WAIT_S`."""
        with self._lock:
            proc, self._stopped = self._proc, True
        if proc is None:
            return
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def child_spec(setup: ChildSetup) -> ProgramSpec:
    """The :class:`ProgramSpec` ``setup`` describes, on weights of the child's own: the sidecar
    mapped (zero-copy) or random ones; no prepacked matrices (the child only compiles). Call it
    after ``torch.set_num_threads(setup.threads)``: the spec takes the calling thread's count."""
    import torch

    from model_families import get_family
    from runner_service.config import EngineConfig
    from runner_service.kv_cache import KVCache
    from runner_service.model_runner import ModelRunner

    family = get_family(setup.family)
    if family is None:
        raise ValueError(f"unknown model family {setup.family!r}")
    args = family.config_from_dict(setup.config)
    config = EngineConfig(**setup.engine)
    dtype, device = getattr(torch, setup.dtype), torch.device(setup.device)
    if setup.sidecar is not None:
        from weight_service.loader import load_sidecar

        sidecar = load_sidecar(Path(setup.sidecar))  # verified by the runner; values do not reach the program
        weights = family.load_weights(args, sidecar.tensors, dtype, device, sidecar.weights_dtype)
    else:
        weights = family.random_weights(args, dtype, device=device, weights_dtype=setup.weights_dtype)
    kv = KVCache(family.cache_specs(args, config.block_size), setup.num_blocks, config.block_size, dtype, device)
    runner = ModelRunner(args, weights, kv, config, config.resolved_max_model_len(args), device, family,
                         prepack=False)
    return runner.program_spec()


def _follow_parent() -> None:
    """Die with the thread that started this process (Linux ``PR_SET_PDEATHSIG``), so that a
    runner killed mid-build leaves no compile behind; elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def _answer(out, **reply) -> None:
    out.write(json.dumps(reply) + "\n")
    out.flush()


def main() -> int:
    """The child: read the setup, lower its priority, build the spec, then compile each request
    (see the module docstring); a setup that fails (an unreadable sidecar, an unknown family) is
    the answer to every request. Returns 0 at the end of stdin."""
    out = os.fdopen(os.dup(1), "w")  # the answers; anything else written to stdout goes to stderr
    os.dup2(2, 1)
    _follow_parent()
    setup = ChildSetup(**json.loads(sys.stdin.readline()))
    os.nice(max(0, setup.nice))  # before the heavy imports; the C++ compiler it starts inherits it
    if setup.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, setup.cpus)
    from services.log import configure_logging

    configure_logging("build-child", "WARNING")

    import torch

    from runner_service.programs.aoti import compile_program
    from runner_service.programs.key import program_key

    torch.set_num_threads(setup.threads)  # the serving count: it is in the key and in the generated code
    try:
        spec, failed = child_spec(setup), ""
    except Exception as e:  # noqa: BLE001 - answered to each request
        log.exception("the build child could not build its program spec")
        spec, failed = None, f"setting up: {type(e).__name__}: {e}"
    for line in sys.stdin:
        request = json.loads(line)
        kind = request["kind"]
        if spec is None:
            _answer(out, ok=False, error=failed)
            continue
        try:
            form = dataclasses.replace(spec, layers=request.get("layers", "unrolled"))
            name, got = program_key(form, form.mode, kind=kind)
            if got != request["fingerprint"]:
                raise ValueError(f"the child's key of {name} ({got[:12]}) differs from the runner's "
                                 f"({request['fingerprint'][:12]}): not compiled")
            t = time.perf_counter()
            compile_program(form, kind, Path(request["package"]))
            _answer(out, ok=True, seconds=time.perf_counter() - t)
        except Exception as e:  # noqa: BLE001 - answered: the runner stays eager and says why
            log.exception("compiling %s failed", kind)
            _answer(out, ok=False, error=f"{type(e).__name__}: {e}")
    out.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter teardown: unwinding torch's and Inductor's modules costs seconds of CPU,
    # beside a runner that is about to step on that CPU again (nothing is left to flush)
    os._exit(code)
