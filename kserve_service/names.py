"""Which model name the KServe door answers to, and which versions (``docs/architecture.md`` §10).

The name: :attr:`RouterConfig.served_model_name <router_service.config.RouterConfig>` (the
router's ``--served-model-name``), else :func:`services.served_model.published_name` of the
runners' model source; a request may name either that or the source itself
(:func:`services.model_name.names_model`), anything else is ``NOT_FOUND``. Model version ``""``,
``-1`` or ``1``; another number is ``NOT_FOUND``, anything else ``INVALID_ARGUMENT``.
"""

from __future__ import annotations

import logging

from kserve_service.model import MODEL_VERSION
from router_service.registry import RunnerState
from router_service.router import Router
from services.errors import InvalidArgument, NotFound, Unavailable, WarmserveError
from services.model_name import names_model
from services.served_model import CachedModelInfo, published_name

log = logging.getLogger(__name__)

#: How long a model source learnt through ``ModelInfo`` is trusted (seconds).
SOURCE_TTL_S = 5.0


class ModelNames:
    """Which model name the door answers to (see the module docstring); thread-safe.

    The source comes from the router's table (a registered runner says what it serves), else
    from a READY runner's ``ModelInfo`` (static runners), kept :data:`SOURCE_TTL_S` seconds."""

    def __init__(self, router: Router, configured: str = "") -> None:
        self._router = router
        self._configured = configured
        self._cache = CachedModelInfo(SOURCE_TTL_S)

    def source(self) -> str:
        """The runners' model source, or ``""`` when no runner has said it (never raises)."""
        runners = self._router.registry.snapshot()
        ready = [r for r in runners if r.state is RunnerState.READY]
        for r in ready:
            if r.model:
                return r.model
        cached = self._cache.fresh()
        if cached is not None:
            return cached.model
        if ready:
            try:
                info = self._router.model_info(timeout_s=5.0)
            except WarmserveError as e:
                log.debug("model source unknown", extra={"error": str(e)})
            else:
                self._cache.store(info)
                return info.model
        last = self._cache.last()
        return next((r.model for r in runners if r.model), last.model if last is not None else "")

    def current(self) -> tuple[str, str] | None:
        """``(served name, source)``; ``None`` while neither is known (no runner, no configured name)."""
        source = self.source()
        if not self._configured and not source:
            return None
        return published_name(self._configured, source), source
    def resolve(self, requested: str, version: str = "") -> str:
        """The served name when ``requested`` (and ``version``) name the model. Raises
        ``NotFound`` for another name or version, ``InvalidArgument`` for a version that is not
        a number, ``Unavailable`` when the name cannot be known yet."""
        names = self.current()
        if names is None:
            raise Unavailable(f"no runner is ready ({self._router.registry.describe()}), so the model's name is not "
                              f"known yet (the router's --served-model-name would fix it)")
        served, source = names
        if not requested or not names_model(requested, served_name=served, source=source or served):
            raise NotFound(f"Request for unknown model: '{requested}' is not found (this server serves '{served}')")
        check_version(served, version)
        return served


def check_version(model: str, version: str) -> None:
    """Accept ``""``, ``-1`` (latest) and ``1``. Raises ``InvalidArgument`` for a version that
    is not an integer and ``NotFound`` for another one."""
    text = version.strip()
    if text in ("", "-1", MODEL_VERSION):
        return
    try:
        int(text)
    except ValueError:
        raise InvalidArgument(f"failed to get model version from specified version string '{version}'") from None
    raise NotFound(f"Request for unknown model: '{model}' version {text} is not found (it has version "
                   f"{MODEL_VERSION})")
