"""``warmserve runner serve``: wire the sidecar, the engine, the gRPC server and the router
registration together.

Order matters: the sidecar is prepared (or fetched from a weight service), the engine is built
(weights, KV cache, programs, warm-up) in the thread that then runs its loop
(:meth:`LLMEngine.launch`), and only then is the gRPC server
started, so health answers ``SERVING`` only when a request can actually be served. On SIGTERM
the router registration stops first, in-flight streams get the drain grace, then the engine
closes.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

from runner_service.config import EngineConfig
from runner_service.engine import LLMEngine, StartupPhase
from runner_service.options import engine_fields
from services.channel import ClientSecurity
from services.paths import default_sidecar_root

log = logging.getLogger(__name__)


def engine_config_from_args(args) -> EngineConfig:
    """The :class:`EngineConfig` of ``runner serve`` flags (raises ``InvalidArgument``)."""
    return EngineConfig(**engine_fields(args), runner_id=args.runner_id or "runner")


def obtain_sidecar(model: str, weights_dtype: str, *, weights: str | None, sidecar_dir: str | None,
                   security: ClientSecurity | None = None) -> tuple[Path, StartupPhase]:
    """Prepare the ``weights_dtype`` sidecar (``auto`` is resolved by whoever prepares it)
    locally (``weight_service.prepare``) or, with ``weights``, have the weight service prepare it
    and fetch it into ``sidecar_dir``. Returns its directory and the timed ``sidecar`` phase
    (state, weights dtype and residency as the detail)."""
    t0 = time.perf_counter()
    root = Path(sidecar_dir) if sidecar_dir else default_sidecar_root()
    if weights:
        from weight_service.client import WeightsClient

        client = WeightsClient(weights, security=security)
        handle = client.prepare(model, dtype=weights_dtype)
        path = client.fetch(handle, root)
        where = f"from {weights}"
    else:
        from weight_service.prepare import prepare

        handle = prepare(model, dtype=weights_dtype, root=root)
        path = handle.path
        where = "local"
    resident = "" if handle.residency is None else f", {handle.residency * 100:.0f}% resident"
    detail = f"sidecar {handle.state} {where}{resident}, {handle.dtype}, {handle.size_bytes / 2**20:.0f} MiB"
    return Path(path), StartupPhase("sidecar", time.perf_counter() - t0, detail)


def kernel_cache_from_args(args, security: ClientSecurity | None = None):
    """What the engine's programs use as their kernel cache (see
    :func:`runner_service.programs.open_kernel_cache`): ``--kernel-cache ADDR`` (a client
    presenting ``security``, the runner's own token and TLS files), else ``--kernel-cache-dir``,
    else ``None``."""
    if not args.kernel_cache:
        return args.kernel_cache_dir
    from kernel_cache_service.client import KernelCacheClient

    return KernelCacheClient(args.kernel_cache, security=security)


def serve_from_args(args) -> int:
    """Run the runner daemon until SIGTERM/SIGINT; returns the exit code."""
    from services.bootstrap import ServiceServer, config_from_args, ensure_bindable
    from services.channel import client_security_from_args
    from services.generation_client import GENERATION_SERVICE
    from services.log import configure_logging
    from services.proto import generation_pb2_grpc
    from services.stream_slots import StreamSlots

    configure_logging("runner", args.log_level)
    config = engine_config_from_args(args)
    server_config = config_from_args(args, "runner")
    security = client_security_from_args(args)  # what the runner presents to the cache, weights and router
    ensure_bindable(server_config)  # a busy port fails now, not after the model is loaded
    kernel_cache = kernel_cache_from_args(args, security)

    def build() -> LLMEngine:
        # one line per slow phase: a launcher waiting on this runner shows the latest (warmserve up)
        log.info("preparing the weight sidecar %s (packed once, on a first launch)",
                 f"through the weight service at {args.weights}" if args.weights else "locally")
        path, phase = obtain_sidecar(args.model, args.weights_dtype, weights=args.weights,
                                     sidecar_dir=args.sidecar_dir, security=security)
        log.info("loading the model from the sidecar (%s)", phase.detail)
        return LLMEngine.from_sidecar(path, config, model=args.model, startup=[phase], kernel_cache=kernel_cache)

    engine = LLMEngine.launch(build)  # packs, loads, warms up and steps in one thread
    registration = None
    try:
        from runner_service.servicer import GenerationServicer, RunnerCollector

        servicer = GenerationServicer(engine, config.runner_id,
                                      StreamSlots(server_config.max_streams, f"runner {config.runner_id}"))
        server = ServiceServer(server_config, [(generation_pb2_grpc.add_GenerationServicer_to_server, servicer,
                                                GENERATION_SERVICE)], servicer.refusals)
        server.registry.register(RunnerCollector(engine))
        port = server.start()
        servicer.runner_id = args.runner_id or f"{socket.gethostname()}:{port}"
        log.info("ready", extra={"address": server.address, "runner_id": servicer.runner_id,
                                 "startup": engine.startup_report.line()})
        if args.router:
            from runner_service.registration import RunnerRegistration

            registration = RunnerRegistration(
                args.router, runner_id=servicer.runner_id, address=server.address, model=args.model,
                max_num_seqs=config.max_num_seqs, load_fn=engine.stats, security=security)
            registration.start()
            server.on_drain.append(registration.stop)
        server.serve_forever()
    finally:
        if registration is not None:
            registration.stop()
        engine.close()
    if engine.programs.in_flight:
        # The compile cannot be interrupted, and letting the interpreter tear down under it aborts
        # the process (C++ "terminate called without an active exception", exit 134): leave now.
        # Its build lease is no longer renewed, so another runner takes the build over after the TTL.
        log.warning("stopped with the background compile still running: abandoned")
        logging.shutdown()
        os._exit(0)
    return 0
