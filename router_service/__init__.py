"""router_service: one ``Generation`` endpoint in front of many runners.

Files, one concept each:

- ``config.py`` — :class:`RouterConfig` and :data:`POLICY_NAMES`, the routing policies;
- ``registry.py`` — the runner table: static and leased runners, health state, load;
- ``policy.py`` — least-outstanding, round-robin and prefix-affinity choosers;
- ``channels.py`` — one client channel per runner address;
- ``health_checker.py`` — periodic ``grpc.health.v1`` checks and lease expiry;
- ``relay.py`` — one request's trip: pick a runner, relay its stream, retry before the first token;
- ``router.py`` — :class:`Router`, the core that ties them together (no server);
- ``convert.py`` — runner table entries <-> ``warmserve.v1`` router messages;
- ``servicer.py`` — the ``Generation`` and ``RouterControl`` servicers and :class:`RouterServer`;
- ``daemon.py`` — ``warmserve router serve``: a :class:`RouterServer` from the flags;
- ``client.py`` — ``RouterControl`` for operators and tools: list runners, drain one;
- ``cli.py`` — ``warmserve router serve|drain``.

Runners register themselves with :mod:`runner_service.registration`, which needs only the stubs.
"""
