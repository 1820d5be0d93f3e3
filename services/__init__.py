"""services: the shared plumbing every warmserve package builds on, and that imports none of them.

- ``errors.py`` — :class:`WarmserveError` and its subclasses (gRPC status, CLI exit code);
- ``refusals.py`` — ``warmserve_refused_total{reason}``, the requests refused at a limit;
  ``utf8.py`` — invalid Unicode is ``INVALID_ARGUMENT`` (``str`` checks, the server interceptor);
- ``log.py`` — JSON-lines logging; ``paths.py`` — default locations under ``$WARMSERVE_HOME``;
- ``fsmode.py`` — file modes for atomically published files;
- ``address.py`` — ``host:port`` parsing and formatting; ``ports.py`` — every daemon's default
  port, the local stack's port plan and :func:`~services.ports.free_port`;
- ``channel.py`` — client channels; ``bootstrap.py`` — the one server bootstrap (health,
  reflection, auth, metrics, drain) and the daemons' common flags;
- ``proto/`` — the generated ``warmserve.v1`` stubs; ``protogen.py`` regenerates them;
- ``generation_client.py`` — the ``Generation`` client (a runner or the router);
- ``sampling_keys.py``, ``served_model.py`` — what both front doors share: vLLM sampling keys ->
  ``SamplingParams`` (and the wire's float32/int32 limits), the published model name and ``ModelInfo`` cache;
- ``healthcheck.py`` — ``python -m services.healthcheck HOST:PORT``, the gRPC health probe;
- ``s3.py`` — ``s3://BUCKET/PREFIX`` URLs and the object-store operations (conditional uploads,
  verified downloads) the kernel cache and the weight service share artifacts through;
- ``procs.py`` — child-process helpers for benchmarks and tests; ``table.py`` — plain-text tables.

The package layers are listed in :mod:`warmserve`.
"""
