"""runner_service: the data-plane runner that serves ``Generation`` for one model.

The engine (:mod:`runner_service.engine`) and its parts (model, KV cache, scheduler, sampler,
compiled programs) do the work; around them, the same file roles as every service package:
``convert.py`` (messages <-> engine objects), ``servicer.py`` (the thin ``Generation`` adapter),
``daemon.py`` (``warmserve runner serve``: sidecar, engine, server, registration),
``registration.py`` (the runner's side of the router's ``RouterControl``: register and
heartbeat), ``options.py`` (every ``runner serve`` option, declared once) and ``cli.py``. Clients use :mod:`services.generation_client` (the router serves the
same contract).
"""
