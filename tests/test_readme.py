"""The README names only paths that exist: every backticked ``dir/...`` whose first part is a
top-level entry of the repository, and every relative Markdown link target."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _named_paths(text: str) -> set[str]:
    top = {p.name for p in ROOT.iterdir()}
    out = set()
    for token in re.findall(r"`([^`\s]+)`", text):
        token = token.rstrip(",.:;")
        if "/" in token and token.split("/")[0] in top and "://" not in token:
            out.add(token)
    for target in re.findall(r"\]\(([^)#\s]+)", text):
        if "://" not in target:
            out.add(target)
    return out


def test_every_path_the_readme_names_exists() -> None:
    text = (ROOT / "README.md").read_text()
    paths = _named_paths(text)
    assert {"docs/architecture.md", "services/paths.py", "bench/startup.py"} <= paths  # the check sees them
    missing = sorted(p for p in paths if not any(ROOT.glob(p.rstrip("/"))))
    assert not missing, f"README.md names paths that do not exist: {missing}"
