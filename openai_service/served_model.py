"""The one model an OpenAI door publishes, and which names a request may give for it.

The id is :func:`services.served_model.published_name`: ``--served-model-name`` when given, else
the default of the model source the router's runners report (``ModelInfoResponse.model``). A
request's ``model`` may be that id, the source itself, or left out (vLLM accepts a missing
``model`` too); anything else is a 404 ``model_not_found``. The router's ``ModelInfo`` is asked
once and reused for ``ttl_s`` seconds (:class:`services.served_model.CachedModelInfo`).
"""

from __future__ import annotations

import time

from openai_service.errors import model_not_found
from openai_service.router_client import RouterClient
from services.model_name import names_model
from services.proto import generation_pb2
from services.served_model import CachedModelInfo, published_name


class ServedModel:
    """Resolves the served model through ``client`` (see the module docstring); ``name`` is the
    operator's choice or ``None``."""

    def __init__(self, client: RouterClient, name: str | None = None, *, ttl_s: float = 30.0) -> None:
        self._client = client
        self._name = name
        self._cache = CachedModelInfo(ttl_s)
        #: Unix seconds when the door first learned its model (``GET /v1/models``' ``created``).
        self.created = int(time.time())

    async def info(self) -> generation_pb2.ModelInfoResponse:
        """The router's ``ModelInfo`` (cached for the TTL). Raises ``OpenAIError`` (503 when no
        runner is ready)."""
        info = self._cache.fresh()
        if info is None:
            info = await self._client.model_info()
            self._cache.store(info)
        return info

    async def name(self) -> str:
        """The published model id."""
        if self._name is not None:
            return self._name
        return published_name(None, (await self.info()).model)

    async def check(self, requested: str | None) -> str:
        """The published id, after checking that ``requested`` (a request's ``model``) names it.
        Raises ``OpenAIError``: 404 ``model_not_found``, or 503 when the model is unknown yet
        because no runner is ready."""
        if requested is None or requested == "" or requested == self._name:
            return await self.name()
        info = await self.info()
        served = await self.name()
        if not names_model(requested, served_name=served, source=info.model):
            raise model_not_found(requested)
        return served
