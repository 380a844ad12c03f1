"""User-given names and folders that become paths under outputs/: checked so that none escapes it."""

from __future__ import annotations

from pathlib import Path

from parity.errors import ParityError


def plain_name(value: object, key: str) -> str:
    """A name that becomes one folder name (a run, a model): no separator, no traversal, not hidden, not empty."""
    name = str(value)
    if not name or name in (".", "..") or any(c in name for c in "/\\\0") or name.startswith("."):
        raise ParityError(f"config key `{key}`: {name!r} is not a valid name: it becomes a folder under outputs/, "
                          "so it may not be empty, contain '/', '\\' or NUL, or start with '.'")
    return name


def inside_outputs(path: object, outputs_dir: object, key: str) -> Path:
    """`path` (relative paths are taken from the working directory, like outputs_dir itself) resolved with its
    symlinks; a ParityError naming `key` unless it lies inside outputs_dir."""
    root = Path(str(outputs_dir)).expanduser().resolve()
    p = Path(str(path)).expanduser().resolve()
    if p != root and root not in p.parents:
        raise ParityError(f"config key `{key}`: {path} resolves to {p}, outside the outputs folder {root} "
                          "(outputs_dir / $PARITY_OUTPUTS); everything a run writes stays under it")
    return p
