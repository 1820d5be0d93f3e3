"""openai_service: an OpenAI-compatible HTTP door over the router's ``warmserve.v1.Generation``.

A thin adapter on the ASGI stack vLLM and SGLang serve their OpenAI APIs with (FastAPI on
uvicorn): each HTTP request becomes one ``Generate`` call to the router over an async gRPC
channel (``grpc.aio``), and the streamed answer comes back as JSON or server-sent events. It
imports ``services`` only (the Generation stubs, errors, addresses, logging); the router and the
runners are reached over gRPC, never imported.

- ``config.py`` — :class:`~openai_service.config.OpenAIConfig` (router address, bind address,
  served model name, API key, TLS files, body limit, allowed hosts, docs), validated;
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
- ``guard.py`` — :class:`~openai_service.guard.RequestGuard`, the ``Host``, API-key and body-size
  checks that run before any route or body parser;
- ``openapi.py`` — the OpenAPI schema as the door answers (error statuses and bodies, streamed
  events, the bearer scheme);
- ``app.py`` — :func:`~openai_service.app.create_app`, the FastAPI application;
- ``healthcheck.py`` — an HTTP probe of ``GET /health`` (``python -m openai_service.healthcheck``);
- ``daemon.py`` — :class:`~openai_service.daemon.OpenAIServer` (uvicorn, HTTPS/mTLS with TLS
  files), the API key from a file or the environment, ``warmserve openai serve``;
- ``cli.py`` — its ``warmserve`` subcommand.
"""
