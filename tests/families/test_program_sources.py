"""Every ``model_families`` module a family's forward imports (directly or through another one)
is among the family's ``program_sources``, so an edit to any code a compiled program traces
changes the program key (``runner_service.programs``)."""

from __future__ import annotations

import ast
import importlib
import importlib.util

import pytest

from model_families.deepseek_v4 import FAMILY as DEEPSEEK_V4
from model_families.llama import FAMILY as LLAMA


def _imported(name: str) -> set[str]:
    """The ``model_families`` modules (not packages) module ``name`` imports, statically."""
    tree = ast.parse(open(importlib.util.find_spec(name).origin).read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("model_families"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if importlib.util.find_spec(node.module).submodule_search_locations is not None
                        and importlib.util.find_spec(sub) is not None else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("model_families")}
    return {m for m in out if importlib.util.find_spec(m).submodule_search_locations is None}


def _closure(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += _imported(m)
    return seen


@pytest.mark.parametrize("family", [LLAMA, DEEPSEEK_V4], ids=lambda f: f.name)
def test_program_sources_list_every_module_the_forward_imports(family):
    model = importlib.import_module(f"model_families.{family.name}.model")
    listed = {m.__name__ for m in family.program_sources()}
    assert _closure(model.__name__) - listed == set()
