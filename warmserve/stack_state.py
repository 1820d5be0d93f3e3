"""``HOME/stack.json``: what ``warmserve status`` learns about a running ``warmserve up``
(its router, and per child its address, pid and restarts)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from services.ports import KERNEL_CACHE, OPENAI, WEIGHTS

#: The stack's state file under its home.
STATE_FILE = "stack.json"


def write_state(home: Path, router_address: str, children) -> None:
    """Record a stack whose router is at ``router_address`` and whose children (each with
    ``name``, ``address``, ``proc`` and ``restarts``) are ``children``, as ``home/stack.json``
    (JSON, replaced atomically)."""
    doc = {"router": router_address, "pid": os.getpid(),
           "children": {c.name: {"address": c.address, "pid": c.proc.pid if c.proc else None, "restarts": c.restarts}
                        for c in children}}
    tmp = (home / STATE_FILE).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, home / STATE_FILE)


def _state_doc(home: Path, router_address: str) -> dict | None:
    """The state file of the ``warmserve up`` whose home is ``home``, when it runs the router at
    ``router_address`` and is still alive; ``None`` otherwise."""
    try:
        doc = json.loads((home / STATE_FILE).read_text())
        os.kill(int(doc["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return doc if doc.get("router") == router_address else None


def stack_router(home: Path) -> str | None:
    """The router address of the live ``warmserve up`` whose home is ``home`` (``None``: none runs)."""
    try:
        doc = json.loads((home / STATE_FILE).read_text())
        os.kill(int(doc["pid"]), 0)
        return str(doc["router"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_state(home: Path, router_address: str) -> dict[str, int]:
    """The restarts per child of the ``warmserve up`` whose home is ``home`` (see
    :func:`_state_doc`); ``{}`` when there is no such stack."""
    doc = _state_doc(home, router_address) or {}
    return {name: int(c.get("restarts", 0)) for name, c in doc.get("children", {}).items()}


def stack_services(home: Path, router_address: str) -> dict[str, str]:
    """The other services (kernel-cache, weights, and the OpenAI door when it runs) of that
    stack: name -> address."""
    doc = _state_doc(home, router_address) or {}
    return {name: c["address"] for name, c in doc.get("children", {}).items()
            if name in (KERNEL_CACHE, WEIGHTS, OPENAI) and c.get("address")}
