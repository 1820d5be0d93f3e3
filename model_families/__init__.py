"""Model families: one plug-in per architecture family, used by the weight service (config and
pack spec), the runner (weights, KV-cache layout, forward) and the compiled programs (decode
module and fingerprinted sources). The contract is :class:`model_families.family.ModelFamily`.

A family lives in its own sub-package ``model_families/<name>/`` that exposes ``FAMILY`` (an
instance of its :class:`~model_families.family.ModelFamily`); sub-packages are discovered on the
first lookup, so adding a family is adding a folder. Tests and plug-ins outside this package call
:func:`register_family` (and :func:`unregister_family` to undo it).

Lookups raise :class:`services.errors.InvalidArgument` with the known names when nothing matches.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from typing import TYPE_CHECKING

from services.errors import InvalidArgument

if TYPE_CHECKING:
    from model_families.family import FamilyConfig, ModelFamily


class FamilyRegistry:
    """Family name -> :class:`ModelFamily`; built-in sub-packages are imported on first use."""

    def __init__(self, package: str | None) -> None:
        self._package = package
        self._families: dict[str, ModelFamily] = {}
        self._discovered = package is None
        self._lock = threading.Lock()

    def _ensure(self) -> dict[str, ModelFamily]:
        with self._lock:
            if not self._discovered:
                self._discovered = True
                pkg = importlib.import_module(self._package)
                for info in pkgutil.iter_modules(pkg.__path__):
                    if info.ispkg:
                        family = importlib.import_module(f"{self._package}.{info.name}").FAMILY
                        self._families.setdefault(family.name, family)
            return self._families

    def register(self, family: ModelFamily) -> None:
        """Add ``family``; ``InvalidArgument`` when its name or one of its architectures is taken."""
        families = self._ensure()
        with self._lock:
            if family.name in families:
                raise InvalidArgument(f"a model family named {family.name!r} is already registered")
            for other in families.values():
                shared = other.architectures & family.architectures
                if shared:
                    raise InvalidArgument(f"architecture {sorted(shared)[0]!r} already belongs to family "
                                          f"{other.name!r}")
            families[family.name] = family

    def unregister(self, name: str) -> None:
        """Remove the family ``name`` (no-op when absent)."""
        self._ensure().pop(name, None)

    def get(self, name: str) -> ModelFamily:
        """The family named ``name``; ``InvalidArgument`` when unknown."""
        families = self._ensure()
        try:
            return families[name]
        except KeyError:
            raise InvalidArgument(f"unknown model family {name!r} (known: {', '.join(sorted(families))})") from None

    def for_architecture(self, architecture: str) -> ModelFamily:
        """The family serving HF ``architecture`` (``LlamaForCausalLM``); ``InvalidArgument``
        naming the supported ones when none does."""
        families = self._ensure()
        for family in families.values():
            if architecture in family.architectures:
                return family
        known = sorted(a for f in families.values() for a in f.architectures)
        raise InvalidArgument(f"no pack spec for architecture {architecture!r}: no model family serves it "
                              f"(supported: {', '.join(known)})")

    def for_config(self, config: FamilyConfig) -> ModelFamily:
        """The family whose ``config_class`` built ``config``."""
        for family in self._ensure().values():
            if type(config) is family.config_class:
                return family
        raise InvalidArgument(f"no registered model family uses the config type {type(config).__name__}")

    def names(self) -> list[str]:
        """Registered family names, sorted."""
        return sorted(self._ensure())


#: The process-wide registry (built-in families are sub-packages of this package).
REGISTRY = FamilyRegistry(__name__)

register_family = REGISTRY.register
unregister_family = REGISTRY.unregister
get_family = REGISTRY.get
family_for_architecture = REGISTRY.for_architecture
family_for_config = REGISTRY.for_config
