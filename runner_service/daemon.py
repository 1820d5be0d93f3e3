"""``warmserve runner serve``: wire the sidecar, the engine, the gRPC server and the router
registration together.

Signing: ``--signing-key`` signs what this runner publishes (programs) and packs (sidecars);
``--trusted-keys`` makes it verify fetched programs and sidecars before loading or mapping them
(``docs/architecture.md`` §9, "Signed artifacts").

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
from runner_service.options import GIVEN, check_model_method, check_options, engine_fields
from services.channel import ClientSecurity
from services.errors import Untrusted
from services.paths import default_sidecar_root
from services.signing import SigningKey, TrustedKeys, signing_key_from, trusted_keys_from

log = logging.getLogger(__name__)


def engine_config_from_args(args) -> EngineConfig:
    """The :class:`EngineConfig` of ``runner serve`` flags (raises ``InvalidArgument``)."""
    return EngineConfig(**engine_fields(args), runner_id=args.runner_id or "runner")


def obtain_sidecar(model: str, weights_dtype: str, *, weights: str | None, sidecar_dir: str | None,
                   security: ClientSecurity | None = None, signing_key: SigningKey | None = None,
                   again: bool = False) -> tuple[Path, StartupPhase]:
    """Prepare the ``weights_dtype`` sidecar (``auto`` is resolved by whoever prepares it)
    locally (``weight_service.prepare``, signed with ``signing_key`` when given) or, with
    ``weights``, have the weight service prepare it and fetch it into ``sidecar_dir``. ``again``
    (after the copy found was refused): repack it here, or download it again. Returns its
    directory and the timed ``sidecar`` phase (state, weights dtype and residency as the detail)."""
    t0 = time.perf_counter()
    root = Path(sidecar_dir) if sidecar_dir else default_sidecar_root()
    if weights:
        from weight_service.client import WeightsClient

        client = WeightsClient(weights, security=security)
        handle = client.prepare(model, dtype=weights_dtype)
        path = client.fetch(handle, root, refresh=again)
        where = f"from {weights}"
    else:
        from weight_service.prepare import prepare

        handle = prepare(model, dtype=weights_dtype, root=root, force=again, signing_key=signing_key)
        path = handle.path
        where = "local"
    resident = "" if handle.residency is None else f", {handle.residency * 100:.0f}% resident"
    detail = f"sidecar {handle.state} {where}{resident}, {handle.dtype}, {handle.size_bytes / 2**20:.0f} MiB"
    return Path(path), StartupPhase("sidecar", time.perf_counter() - t0, detail)


def kernel_cache_from_args(args, security: ClientSecurity | None = None, *, signing_key: SigningKey | None = None,
                           trusted_keys: TrustedKeys | None = None):
    """What the engine's programs use as their kernel cache (see
    :func:`runner_service.programs.open_kernel_cache`): ``--kernel-cache ADDR`` (a client
    presenting ``security``, the runner's own token and TLS files), else ``--kernel-cache-dir``,
    else ``None``. The client signs publishes with ``signing_key`` and verifies fetches against
    ``trusted_keys`` (a ``--kernel-cache-dir`` with either becomes an embedded client)."""
    from kernel_cache_service.client import KernelCacheClient

    keys = {"signing_key": signing_key, "trusted_keys": trusted_keys}
    if not args.kernel_cache:
        if args.kernel_cache_dir and (signing_key or trusted_keys):
            return KernelCacheClient(root=args.kernel_cache_dir, **keys)
        return args.kernel_cache_dir
    return KernelCacheClient(args.kernel_cache, security=security, **keys)


def load_engine(args, config: EngineConfig, kernel_cache, security: ClientSecurity | None,
                signing_key: SigningKey | None, trusted_keys: TrustedKeys | None) -> LLMEngine:
    """Obtain the sidecar and build the engine from it. With ``trusted_keys`` a sidecar whose
    signed manifest fails is never mapped: it is repacked here (then trusted as packed here from
    the checkpoint) or downloaded again from the weight service (then verified again)."""
    # one line per slow phase: a launcher waiting on this runner shows the latest (warmserve up)
    log.info("preparing the weight sidecar %s (packed once, on a first launch)",
             f"through the weight service at {args.weights}" if args.weights else "locally")
    common = dict(weights=args.weights, sidecar_dir=args.sidecar_dir, security=security, signing_key=signing_key)
    path, phase = obtain_sidecar(args.model, args.weights_dtype, **common)
    log.info("loading the model from the sidecar (%s)", phase.detail)
    try:
        return LLMEngine.from_sidecar(path, config, model=args.model, startup=[phase], kernel_cache=kernel_cache,
                                      trusted_keys=trusted_keys)
    except Untrusted as e:
        log.warning("refused the sidecar %s (%s); %s", path.name, e,
                    "downloading it again" if args.weights else "repacking it here")
        refused = str(e)
    path, phase = obtain_sidecar(args.model, args.weights_dtype, again=True, **common)
    phase = StartupPhase(phase.name, phase.seconds, f"{phase.detail} (refused the one found: {refused})")
    return LLMEngine.from_sidecar(path, config, model=args.model, startup=[phase], kernel_cache=kernel_cache,
                                  trusted_keys=trusted_keys if args.weights else None)


def serve_from_args(args) -> int:
    """Run the runner daemon until SIGTERM/SIGINT; returns the exit code."""
    from services.bootstrap import ServiceServer, config_from_args, ensure_bindable
    from services.channel import client_security_from_args
    from services.generation_client import GENERATION_SERVICE
    from services.log import configure_logging
    from services.proto import generation_pb2_grpc
    from services.stream_slots import StreamSlots

    configure_logging("runner", args.log_level)
    check_options(vars(args), getattr(args, GIVEN, ()))
    config = engine_config_from_args(args)
    check_model_method(args.model, config.speculative)  # before the sidecar is packed or loaded
    server_config = config_from_args(args, "runner")
    security = client_security_from_args(args)  # what the runner presents to the cache, weights and router
    ensure_bindable(server_config)  # a busy port fails now, not after the model is loaded
    signing_key, trusted_keys = signing_key_from(args.signing_key), trusted_keys_from(args.trusted_keys)
    kernel_cache = kernel_cache_from_args(args, security, signing_key=signing_key, trusted_keys=trusted_keys)
    engine = LLMEngine.launch(lambda: load_engine(args, config, kernel_cache, security, signing_key, trusted_keys))  # packs, loads, warms up and steps in one thread
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
                                 "startup": engine.startup_line()})
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
