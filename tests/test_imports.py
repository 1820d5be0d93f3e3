"""The house rules of the package layout, checked over every module found in the tree:

- each module imports on its own, in a fresh interpreter (no import cycle, no import that only
  works because another module ran first);
- packages import only downward, in the order of :data:`warmserve.LAYERS` (module-level and
  lazy, function-level imports alike).

New packages (a top-level directory with an ``__init__.py``) and new modules are picked up
automatically; a new package must be given its place in :data:`warmserve.LAYERS`.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from warmserve import LAYERS

REPO = Path(__file__).resolve().parents[1]
NOT_PROJECT = {"tests", "bench"}


def project_packages() -> list[str]:
    """Every top-level package of the repository (a directory holding an ``__init__.py``)."""
    return sorted(p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name not in NOT_PROJECT)


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of every project package."""
    modules = {}
    for package in project_packages():
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def imported_names(module: str, path: Path) -> set[str]:
    """The absolute names of every module ``module`` imports anywhere in its file (relative
    imports resolved against its package)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                names.add(".".join([*base, node.module] if node.module else base))
            else:
                names.add(node.module)
    return names


def _import_alone(module: str) -> tuple[str, int, str]:
    done = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    return module, done.returncode, done.stderr


def test_the_tree_is_discovered() -> None:
    modules = project_modules()
    for package in ("services", "kernel_cache_service", "weight_service", "runner_service", "router_service",
                    "openai_service", "warmserve"):
        assert package in modules, package
    assert "services.proto.warmserve.v1.generation_pb2" in modules
    assert not any(m.split(".")[0] in NOT_PROJECT for m in modules)


def test_every_module_imports_alone_in_a_fresh_interpreter() -> None:
    modules = sorted(project_modules())
    workers = max(2, min(8, os.cpu_count() or 2))
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(_import_alone, modules))
    failures = [f"{module} (exit {code}):\n{stderr.strip().splitlines()[-1] if stderr.strip() else ''}"
                for module, code, stderr in results if code != 0]
    assert not failures, "modules that do not import alone:\n" + "\n".join(failures)


def test_every_package_has_a_layer() -> None:
    layered = [package for layer in LAYERS for package in layer]
    assert len(layered) == len(set(layered)), "a package is listed in two layers"
    missing = sorted(set(project_packages()) - set(layered))
    assert not missing, f"give {missing} a place in warmserve.LAYERS (its docstring says what may import what)"


def test_packages_import_only_downward() -> None:
    rank = {package: i for i, layer in enumerate(LAYERS) for package in layer}
    violations = []
    for module, path in project_modules().items():
        own = module.split(".")[0]
        for name in sorted(imported_names(module, path)):
            other = name.split(".")[0]
            if other in rank and other != own and rank[other] >= rank[own]:
                where = "above" if rank[other] > rank[own] else "beside"
                violations.append(f"{module} imports {name} ({other} is {where} {own})")
    assert not violations, "imports against the layer order of warmserve.LAYERS:\n" + "\n".join(violations)


def test_the_layer_check_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    path = tmp_path / "mod.py"
    path.write_text("def f():\n    from router_service.client import list_runners\n"
                    "from . import sibling\nfrom ..up import thing\n")
    assert imported_names("runner_service.sub.mod", path) == {
        "router_service.client", "runner_service.sub", "runner_service.up"}
