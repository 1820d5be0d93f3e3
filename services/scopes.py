"""Which credential scope each gRPC method needs: the one table every server's auth check and
``docs/security.md`` read.

Scopes (a credential holds one or more):

- ``read``: look at what is stored or served (cache lookups and fetches, sidecar fetches, model
  metadata, the runner table);
- ``publish``: add compiled programs to the kernel cache, and the build leases around it;
- ``prepare``: make the weight service pack a checkpoint;
- ``admin``: remove or stop things (evict, drain, repository and shared-memory control);
- ``register``: join the router's fleet as a runner (registration and heartbeats);
- ``generate``: send prompts (Generation, KServe inference, the OpenAI door).

Methods in :data:`OPEN_METHODS` (health, reflection, KServe liveness/readiness) need no token, so
probes work. A method in neither table is refused when auth is on (fail closed).
"""

from __future__ import annotations

READ, PUBLISH, PREPARE, ADMIN, REGISTER, GENERATE = "read", "publish", "prepare", "admin", "register", "generate"

#: Every scope, in the order ``docs/security.md`` lists them.
SCOPES = (READ, PUBLISH, PREPARE, ADMIN, REGISTER, GENERATE)

_KC = "/warmserve.v1.KernelCache/"
_W = "/warmserve.v1.Weights/"
_G = "/warmserve.v1.Generation/"
_RC = "/warmserve.v1.RouterControl/"
_KS = "/inference.GRPCInferenceService/"

#: Full gRPC method name -> the scope it needs.
METHOD_SCOPES: dict[str, str] = {
    _KC + "Lookup": READ, _KC + "Fetch": READ, _KC + "List": READ, _KC + "Stat": READ,
    _KC + "Publish": PUBLISH, _KC + "Claim": PUBLISH, _KC + "RenewLease": PUBLISH, _KC + "ReleaseLease": PUBLISH,
    _KC + "Evict": ADMIN,
    _W + "Prepare": PREPARE, _W + "Fetch": READ, _W + "List": READ,
    _G + "Generate": GENERATE, _G + "ModelInfo": READ,
    _RC + "RegisterRunner": REGISTER, _RC + "Heartbeat": REGISTER, _RC + "ListRunners": READ, _RC + "Drain": ADMIN,
    **{_KS + m: READ for m in ("ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig", "ModelStatistics",
                               "RepositoryIndex", "SystemSharedMemoryStatus", "CudaSharedMemoryStatus")},
    _KS + "ModelInfer": GENERATE, _KS + "ModelStreamInfer": GENERATE,
    **{_KS + m: ADMIN for m in ("RepositoryModelLoad", "RepositoryModelUnload", "SystemSharedMemoryRegister",
                                "SystemSharedMemoryUnregister", "CudaSharedMemoryRegister",
                                "CudaSharedMemoryUnregister", "TraceSetting", "LogSettings")},
}

#: Method-name prefixes and names that never need a token.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
OPEN_METHODS = frozenset({_KS + "ServerLive", _KS + "ServerReady"})


def scope_of(method: str) -> str | None:
    """The scope ``method`` (``/package.Service/Method``) needs; ``None`` when it is open.
    Raises ``KeyError`` for a method in no table (the auth check refuses it)."""
    if method in OPEN_METHODS or method.startswith(OPEN_PREFIXES):
        return None
    return METHOD_SCOPES[method]
