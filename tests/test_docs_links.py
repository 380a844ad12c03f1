"""Every relative link in the repository's Markdown points at a file or folder that exists (docs moved between
pages must not leave dead links behind)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_relative_markdown_links_resolve() -> None:
    names = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True,
                           timeout=60).stdout.split()
    assert "README.md" in names and "docs/README.md" in names
    dead = []
    for name in names:
        path = REPO / name
        if not path.is_file():
            continue
        for target in LINK.findall(path.read_text(encoding="utf-8")):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):  # http:, mailto:, anchors
                continue
            rel = target.split("#", 1)[0]
            if not (path.parent / rel).resolve().exists():
                dead.append(f"{name}: {target}")
    assert not dead, "dead links:\n" + "\n".join(dead)
