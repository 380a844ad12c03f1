"""Unknown config keys are refused, whether written `a.b=1`, `+a.b=1` or `++a.b=1`, with the closest valid keys.

The valid keys are the fields of the schema's dataclasses (parity.config.schema.ParityConfig), read from
their type hints, so a key added to the schema is valid at once. A field typed as a mapping
(`dict[str, Any]`) or as `Any` takes keys of the user's choosing: those are the open groups (`open_groups()`, today
`eval.benchmarks`, whose entries the evaluation runner checks itself). Everything else below the root is
closed: Hydra's `+` (append) would otherwise add an unknown key to the composed config, where nothing reads
it, and the run would go on as if the typo were not there.

Two checks, one message: `check_overrides` looks at the override strings before Hydra composes (so the
CLI and `load_config` answer a typo the same way, before Hydra's own "Could not override" text), and
`check_config` walks a composed config (keys from a config file, or anything the first check cannot see).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from parity.config.validate import ConfigError

_LIST_TYPES = (list, tuple)

# keys the schema no longer has, refused with their new spelling (an old config or command fails naming both)
REMOVED: dict[str, str] = {
    "rollout.dtype": "`model.dtype`, the one compute dtype of the trainer and the rollout engine",
}


def _unwrap(tp: Any) -> Any:
    """A type hint without its `| None`."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return tp


@functools.cache
def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _fields(cls: type) -> dict[str, Any]:
    """{field name: dataclass | dict (open: any keys) | list | None (a plain value)} of one schema dataclass."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = _unwrap(hints.get(f.name, Any))
        org = typing.get_origin(tp) or tp
        if dataclasses.is_dataclass(tp):
            out[f.name] = tp
        elif tp is Any and not isinstance(_default(f), Mapping):  # a value of several types (e.g. a number or auto)
            out[f.name] = None
        elif tp is Any or (isinstance(org, type) and issubclass(org, Mapping)):
            out[f.name] = dict
        elif isinstance(org, type) and issubclass(org, _LIST_TYPES):
            out[f.name] = list
        else:
            out[f.name] = None
    return out


def _root() -> type:
    from parity.config.schema import parity_schema

    return parity_schema()


def _sections() -> tuple[str, ...]:
    """The sections of algorithm.correction: they grow as corrections register, so the key lists below are cached
    per set of sections."""
    from parity.config.schema import correction_sections

    return tuple(correction_sections())


def schema_keys() -> tuple[str, ...]:
    """Every dotted key of the schema, groups and values alike (trainer, trainer.lr, ...)."""
    return _schema_keys(_sections())


def open_groups() -> tuple[str, ...]:
    """Schema keys that take keys of the user's choosing (mapping-typed fields), e.g. `eval.benchmarks`."""
    return _open_groups(_sections())


@functools.cache
def _schema_keys(_sections: tuple[str, ...]) -> tuple[str, ...]:
    keys: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, kind in _fields(cls).items():
            key = f"{prefix}{name}"
            keys.append(key)
            if dataclasses.is_dataclass(kind):
                walk(kind, f"{key}.")

    walk(_root(), "")
    return tuple(keys)


@functools.cache
def _open_groups(_sections: tuple[str, ...]) -> tuple[str, ...]:
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, kind in _fields(cls).items():
            if kind is dict:
                out.append(f"{prefix}{name}")
            elif dataclasses.is_dataclass(kind):
                walk(kind, f"{prefix}{name}.")

    walk(_root(), "")
    return tuple(out)


def _children(parent: str) -> list[str]:
    keys = schema_keys()
    return [k.rsplit(".", 1)[-1] for k in keys if k.rpartition(".")[0] == parent]


def unknown_key_message(key: str, groups: Iterable[str] = ()) -> str:
    """One line naming `key` and the closest valid keys (or, when none is close, the keys beside it).

    `groups`: config group names (folders of the config tree), valid as top-level names too."""
    if key in REMOVED:
        return f"config key `{key}` was removed (nothing read it); use {REMOVED[key]}"
    bad = _walk_key(key) or key
    parts, bad_parts = key.split("."), bad.split(".")
    parent, last, rest = ".".join(bad_parts[:-1]), bad_parts[-1], parts[len(bad_parts):]
    keys = set(schema_keys())
    if parent in keys and _walk_key(parent) is None and not dataclasses.is_dataclass(_kind(parent)):
        return f"unknown config key `{key}`: `{parent}` is a value, not a group of keys"
    siblings = _children(parent) + ([g for g in groups if g not in keys] if not parent else [])
    tail = ".".join([last, *rest])
    close = [".".join(filter(None, [parent, s, *rest])) for s in difflib.get_close_matches(last, siblings, 3, 0.7)]
    close += [k for k in sorted(keys) if k.endswith("." + tail) and k not in close]  # model.lr -> trainer.lr
    what = "config key or group" if not parent and not rest else "config key"
    msg = f"unknown {what} `{key}`"
    if close:
        return msg + "; did you mean " + " or ".join(close[:3]) + "?"
    return msg + f"; valid {'under ' + parent if parent else 'at the top level'}: " + ", ".join(sorted(siblings))


def _kind(key: str) -> Any:
    cls: Any = _root()
    for part in key.split("."):
        cls = _fields(cls)[part]
    return cls


def _walk_key(key: str) -> str | None:
    """None when `key` is a schema key or lies inside an open group; else the first unknown prefix."""
    cls: Any = _root()
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = _fields(cls)
        if part not in fields:
            return ".".join(parts[: i + 1])
        kind = fields[part]
        if kind is dict:
            return None
        if kind is list:  # trainer.betas.0=0.8: an index into a list value
            rest = parts[i + 1:]
            return None if all(p.isdigit() for p in rest) else ".".join(parts[: i + 2])
        if kind is None:
            return None if i == len(parts) - 1 else ".".join(parts[: i + 2])
        cls = kind
    return None


def _groups(search_dirs: Iterable[Path]) -> list[str]:
    return sorted({p.name for d in search_dirs if Path(d).is_dir() for p in Path(d).iterdir() if p.is_dir()})


def _is_group(key: str, search_dirs: Iterable[Path]) -> bool:
    rel = key.replace(".", "/")
    return any((Path(d) / rel).is_dir() for d in search_dirs)


def check_overrides(overrides: Iterable[str], search_dirs: Iterable[Path]) -> None:
    """Refuse an override that names a key the schema does not have (ConfigError, one line).

    Config group choices (`model=hf`, `+precision=w8a8_int8`, `algorithm/correction=...`) are not keys:
    a name that is a folder of one of `search_dirs` is a group. Hydra's own keys (`hydra.*`) and
    deletions (`~key`) are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import OverrideParseException

    dirs = [Path(d) for d in search_dirs]
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException as e:
        raise ConfigError(f"bad override: {str(e).splitlines()[0]}") from None
    for o in parsed:
        key = o.key_or_group
        if o.is_hydra_override() or o.type == OverrideType.DEL or o.package is not None or "/" in key:
            continue
        bad = _walk_key(key)
        if bad is None:
            continue
        if _is_group(key, dirs):
            continue
        raise ConfigError(unknown_key_message(key, _groups(dirs)))


def check_config(cfg: Any) -> None:
    """Refuse a composed config (a DictConfig, or the typed one with an attribute set that the schema lacks)
    holding a key the schema does not have (ConfigError, one line)."""
    from omegaconf import DictConfig

    def items(node: Any) -> Iterable[tuple[str, Any]]:
        return node.items_ex(resolve=False) if isinstance(node, DictConfig) else vars(node).items()

    def walk(node: Any, cls: type, prefix: str) -> None:
        fields = _fields(cls)
        for name, child in items(node):
            key = f"{prefix}{name}"
            if name not in fields:
                raise ConfigError(unknown_key_message(key))
            kind = fields[name]
            if dataclasses.is_dataclass(kind) and (isinstance(child, DictConfig) or dataclasses.is_dataclass(child)):
                walk(child, kind, f"{key}.")

    walk(cfg, _root(), "")


__all__ = ["check_config", "check_overrides", "open_groups", "schema_keys", "unknown_key_message"]
