"""Puts the KServe door into ``warmserve router serve`` (registered by :mod:`router_service.cli`,
listed before this module in :data:`warmserve.cli.COMMAND_MODULES`): the router process serves
:data:`kserve_service.door.ROUTER_DOORS` on its own port. Adds no command or flag."""

from __future__ import annotations


def register(subparsers) -> None:
    """Set ``warmserve router``'s ``doors`` default to :data:`~kserve_service.door.ROUTER_DOORS`."""
    from kserve_service.door import ROUTER_DOORS

    subparsers.choices["router"].set_defaults(doors=ROUTER_DOORS)
