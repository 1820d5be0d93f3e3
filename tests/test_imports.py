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
import importlib.util
import json
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


def imported_names(module: str, path: Path, module_level: bool = False) -> set[str]:
    """The absolute names of every module ``module`` imports anywhere in its file (relative
    imports resolved against its package); ``module_level``: only its top-level statements'."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body if module_level else ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                names.add(".".join([*base, node.module] if node.module else base))
            else:
                names.add(node.module)
    return names


#: A parent interpreter that imports only the third-party packages the project imports at module
#: level (each by its top-level name, as a fresh ``import torch`` would), then forks one child per
#: project module, which imports it and exits: a fresh interpreter as far as the project is
#: concerned (no project module is loaded before the fork; the parent checks), without paying
#: torch's import once per module. Prints one JSON line ``[module, exit code, output]`` per module.
ZYGOTE = r"""
import importlib, json, os, sys, traceback
preload, project, modules = (json.loads(a) for a in sys.argv[1:4])
for name in preload:
    importlib.import_module(name)
early = sorted(m for m in sys.modules if m.split(".")[0] in project)
if early:
    sys.exit(f"the preload imported project modules: {early}")
for module in modules:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.dup2(w, 1)
        os.dup2(w, 2)
        try:
            importlib.import_module(module)
            code = 0
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    os.close(w)
    with os.fdopen(r, errors="replace") as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    print(json.dumps([module, os.waitstatus_to_exitcode(status), out]), flush=True)
"""


def third_party_preload(modules: dict[str, Path]) -> list[str]:
    """The top-level names of the installed (non-stdlib, non-project) packages the project's
    modules import at module level, ``google.protobuf`` for the ``google`` namespace package."""
    project = set(project_packages()) | NOT_PROJECT | {"__future__"}
    tops = {name.split(".")[0] for module, path in modules.items() for name in imported_names(module, path, True)}
    return sorted("google.protobuf" if top == "google" else top for top in tops
                  if top not in project and top not in sys.stdlib_module_names and importlib.util.find_spec(top))


def _import_each_alone(modules: list[str], preload: list[str], project: list[str] | None = None,
                       cwd: Path = REPO) -> list[tuple[str, int, str]]:
    """``(module, exit code, output)`` of each of ``modules`` imported alone (:data:`ZYGOTE`)
    after ``preload``; ``project``: the packages none of which the preload may load (default
    :func:`project_packages`)."""
    project = project_packages() if project is None else project
    done = subprocess.run([sys.executable, "-c", ZYGOTE, json.dumps(preload), json.dumps(project),
                           json.dumps(modules)], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [tuple(json.loads(line)) for line in done.stdout.splitlines()]


def test_the_tree_is_discovered() -> None:
    modules = project_modules()
    for package in ("services", "kernel_cache_service", "weight_service", "runner_service", "router_service",
                    "openai_service", "warmserve"):
        assert package in modules, package
    assert "services.proto.warmserve.v1.generation_pb2" in modules
    assert not any(m.split(".")[0] in NOT_PROJECT for m in modules)


def test_every_module_imports_alone_in_a_fresh_interpreter() -> None:
    found = project_modules()
    modules, preload = sorted(found), third_party_preload(found)
    workers = max(2, min(8, os.cpu_count() or 2))
    with ThreadPoolExecutor(workers) as pool:
        results = [r for part in pool.map(_import_each_alone, [modules[i::workers] for i in range(workers)],
                                          [preload] * workers) for r in part]
    assert sorted(m for m, _, _ in results) == modules
    failures = [f"{module} (exit {code}):\n{out.strip().splitlines()[-1] if out.strip() else ''}"
                for module, code, out in results if code != 0]
    assert not failures, "modules that do not import alone:\n" + "\n".join(failures)


def test_a_module_that_needs_another_imported_first_fails_alone(tmp_path: Path) -> None:
    """The forking parent really isolates modules: one that works only after another ran fails."""
    (tmp_path / "needs_first").mkdir()
    (tmp_path / "needs_first" / "__init__.py").write_text("")
    (tmp_path / "needs_first" / "a.py").write_text("import sys\nsys.modules['needs_first'].ready = True\n")
    (tmp_path / "needs_first" / "b.py").write_text("import needs_first\nassert needs_first.ready\n")
    results = {m: (code, out) for m, code, out in _import_each_alone(["needs_first.a", "needs_first.b"], ["torch"],
                                                                     ["needs_first"], tmp_path)}
    assert results["needs_first.a"][0] == 0
    assert results["needs_first.b"][0] == 1 and "AttributeError" in results["needs_first.b"][1]


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


def test_the_cli_parser_imports_no_torch():
    """``warmserve`` builds its whole parser (every subcommand's flags and choices) without
    importing torch or transformers: ``warmserve status`` or a ``runner serve`` that hands its
    argv to a pre-started runner must not pay their 1-2 s of imports."""
    code = ("import sys; from warmserve.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
