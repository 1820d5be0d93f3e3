"""openai_service: an OpenAI-compatible HTTP door over the router's ``warmserve.v1.Generation``.

A thin adapter on the ASGI stack vLLM and SGLang serve their OpenAI APIs with (FastAPI on
uvicorn): each HTTP request becomes one ``Generate`` call to the router over an async gRPC
channel (``grpc.aio``), and the streamed answer comes back as JSON or server-sent events. It
imports ``services`` only (the Generation stubs, errors, addresses, logging); the router and the
runners are reached over gRPC, never imported.

- ``config.py`` — :class:`~openai_service.config.OpenAIConfig` (router address, bind address,
  served model name), validated;
- ``protocol.py`` — the OpenAI request and response bodies (pydantic models);
- ``errors.py`` — :class:`~openai_service.errors.OpenAIError` and OpenAI's error JSON; gRPC
  statuses and validation errors mapped to HTTP status codes;
- ``convert.py`` — OpenAI requests -> ``GenerateRequest``; ``GenerateResponse`` messages ->
  OpenAI choices, logprobs, finish reasons and usage;
- ``router_client.py`` — :class:`~openai_service.router_client.RouterClient`, the async
  ``Generation`` client;
- ``served_model.py`` — :class:`~openai_service.served_model.ServedModel`, the one model name
  the door publishes and the names a request may use;
- ``sse.py`` — server-sent events, and cancelling work when the HTTP client goes away;
- ``app.py`` — :func:`~openai_service.app.create_app`, the FastAPI application;
- ``healthcheck.py`` — an HTTP probe of ``GET /health`` (``python -m openai_service.healthcheck``);
- ``daemon.py`` — :class:`~openai_service.daemon.OpenAIServer` (uvicorn), ``warmserve openai serve``;
- ``cli.py`` — its ``warmserve`` subcommand.
"""
