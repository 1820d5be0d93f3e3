"""warmserve: the tools on top of the services: the ``warmserve`` command line and the local stack.

- ``cli.py`` — the ``warmserve`` dispatcher (each package's ``cli`` module adds its commands);
- ``stack_config.py`` — what a local stack launches, on which ports, with which command lines;
- ``stack.py`` — :class:`~warmserve.stack.LocalStack`, the supervisor of every service as a child process;
- ``stack_tls.py`` — ``warmserve up --tls``: the stack's throw-away PKI and what its clients present;
- ``stack_state.py`` — ``HOME/stack.json``; ``stack_report.py`` — start-up reports and status tables;
- ``up.py`` — ``warmserve up``'s foreground loop;
- ``stack_cli.py`` — ``warmserve up | generate | chat | status | demo``;
- ``chat.py`` — the ``warmserve chat`` loop (history, ``/reset``, ``/help``);
- ``demo.py`` — ``warmserve demo`` (``make run``), the main job end to end.

Packages depend on each other in one direction only, downward in this list (a package may import
itself and the packages below it, never one above it or beside it; lazy, function-level imports
included). ``tests/test_imports.py`` checks it against :data:`LAYERS`::

    warmserve             the tools: CLI dispatcher, local stack, demo
    kserve_service        the KServe v2 / Triton door, served in the router's process
      openai_service      beside it: the OpenAI-compatible HTTP door, a gRPC client of the router
    router_service        the router: one Generation endpoint in front of many runners (routing only)
    runner_service        the runner: engine, model, KV cache, Generation servicer, registration
    kernel_cache_service  compiled-program store     weight_service  weight sidecars
    model_families        per-family model code (config, pack layout, forward) for weights and runner
    services              shared plumbing: errors, logging, paths, addresses, channels, the
                          server bootstrap, proto stubs, the Generation client, health probe

So ``services`` imports no other package of the project; ``model_families`` only ``services``;
``kernel_cache_service`` and ``weight_service`` only those two; ``runner_service`` uses everything
below it (and registers itself with a router through the RouterControl stubs, not through
``router_service``); ``router_service`` relays to runners through the Generation stubs and serves, on its port, the
front doors handed to it (``RouterServer(..., doors)``, :data:`router_service.servicer.Door`);
the doors sit one layer above it: ``kserve_service`` calls the router's core as its
``Generation`` servicer does, and composes the router process (``kserve_service.door``, wired
into ``warmserve router serve`` by ``kserve_service.cli``); ``openai_service``, beside it (neither
imports the other), calls the router over gRPC and imports only ``services``. What both doors
share (the served-model cache, the vLLM sampling keys) lives in ``services``. ``warmserve``
launches them all. (A layer whose package is absent constrains nothing.)
"""

#: The package layers, lowest first; a package may import only its own layer's package and lower layers.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("services",),
    ("model_families",),
    ("kernel_cache_service", "weight_service"),
    ("runner_service",),
    ("router_service",),
    ("kserve_service", "openai_service"),
    ("warmserve",),
)
