"""The Hydra config tree on disk: where it is (the repository's configs/, or $PARITY_CONFIGS), its groups and the
groups of config.yaml's defaults list. Read by the loader (parity.config) and by the CLI's help, which imports
neither omegaconf nor torch, so this module imports only the standard library."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def config_dir() -> Path:
    env = os.environ.get("PARITY_CONFIGS")
    return Path(env).resolve() if env else repo_root() / "configs"


def config_groups() -> dict[str, list[str]]:
    """{group: [options]} from the config tree's folders."""
    root = config_dir()
    if not root.is_dir():
        return {}
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in sorted(root.iterdir()) if d.is_dir()}


def default_groups() -> tuple[str, ...]:
    """Config groups that configs/config.yaml's defaults list always holds (model, experiment, eval, ...): chosen
    as `group=option`; the others take `+group=option`."""
    path = config_dir() / "config.yaml"
    return _default_groups(str(path), path.stat().st_mtime if path.is_file() else 0.0)


@functools.cache
def _default_groups(path: str, _mtime: float) -> tuple[str, ...]:
    if not Path(path).is_file():
        return ()
    # the indented lines under the top-level `defaults:` key; a `- group: option` entry names a group (a bare
    # `- name` entry, such as the schema or _self_, does not)
    block = re.search(r"^defaults:[ \t]*\n((?:[ \t]+.*\n?|[ \t]*\n)*)", Path(path).read_text(), re.M)
    entries = re.findall(r"^\s*-\s*(?:(?:override|optional)\s+)*([A-Za-z_][\w/]*)\s*:", block.group(1) if block else "",
                         re.M)
    return tuple(entries)
