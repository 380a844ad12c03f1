"""Unknown config keys are refused, whether written `a.b=1`, `+a.b=1` or `++a.b=1`, with the closest valid keys.

The valid keys are the fields of the schema's dataclasses (parity.config.schema.ParityConfig), read from
their type hints, so a key added to the schema is valid at once. A field typed as a mapping
(`dict[str, Any]`) or as `Any` takes keys of the user's choosing: those are the open groups (`open_groups()`:
`eval.benchmarks`, whose entries the evaluation runner checks itself, and the corrections' sections
`algorithm.correction.<section>`, whose keys are checked here against the section's declaration,
parity.algorithm_config, and `algorithm.correction.external`, checked when the config is loaded). Everything else below the root is
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

from parity.algorithm_config import check_name, section_class
from parity.errors import ConfigError

_LIST_TYPES = (list, tuple)

# keys the schema no longer has, refused with their new spelling (an old config or command fails naming both)
REMOVED: dict[str, str] = {
    "rollout.dtype": "`model.dtype`, the one compute dtype of the trainer and the rollout engine",
}

# names that other tools (or a first guess) give to one of our keys: an unknown key of that name is answered with ours
ALIASES: dict[str, str] = {
    "checkpoint": "eval.model_path",
    "checkpoint_path": "eval.model_path",
    "ckpt": "eval.model_path",
    "model_path": "eval.model_path",
    "learning_rate": "trainer.lr",
    "max_steps": "trainer.total_steps",
    "num_steps": "trainer.total_steps",
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
    from parity.config.schema import ParityConfig

    return ParityConfig


def _kinds(cls: type, prefix: str) -> dict[str, Any]:
    """_fields of the schema dataclass at `prefix`, a correction's section (an open group of the schema) given as the
    dataclass that declares its keys (parity.algorithm_config), so that they are checked like the schema's own."""
    return {name: (section_class(prefix + name) or dict) if kind is dict else kind
            for name, kind in _fields(cls).items()}


@functools.cache
def schema_keys() -> tuple[str, ...]:
    """Every dotted key of the schema, groups and values alike (trainer, trainer.lr, ...), the built-in corrections'
    sections' keys too."""
    keys: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, kind in _kinds(cls, prefix).items():
            key = f"{prefix}{name}"
            keys.append(key)
            if dataclasses.is_dataclass(kind):
                walk(kind, f"{key}.")

    walk(_root(), "")
    return tuple(keys)


@functools.cache
def open_groups() -> tuple[str, ...]:
    """Schema keys that take keys of the user's choosing (mapping-typed fields), e.g. `eval.benchmarks`; the
    corrections' sections among them are checked against their declarations."""
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
    """One line, `config key `KEY`: unknown...`, naming the closest valid keys (or, when none is close, the keys
    beside it). Close means: a name of the same level a letter or two away, a key elsewhere with the same last name
    (model.lr -> trainer.lr), a name that other tools use for one of ours (ALIASES: checkpoint -> eval.model_path),
    and, for a top-level name when none of those is found, a near name anywhere in the schema.

    `groups`: config group names (folders of the config tree), valid as top-level names too."""
    if key in REMOVED:
        return f"config key `{key}` was removed (nothing read it); use {REMOVED[key]}"
    bad = _walk_key(key) or key
    parts, bad_parts = key.split("."), bad.split(".")
    parent, last, rest = ".".join(bad_parts[:-1]), bad_parts[-1], parts[len(bad_parts):]
    keys = set(schema_keys())
    if parent in keys and _walk_key(parent) is None and not dataclasses.is_dataclass(_kind(parent)):
        return f"config key `{key}`: unknown key: `{parent}` is a value, not a group of keys"
    siblings = _children(parent) + ([g for g in groups if g not in keys] if not parent else [])
    tail = ".".join([last, *rest])
    close = [ALIASES[last]] if last in ALIASES and not rest else []
    close += [".".join(filter(None, [parent, s, *rest])) for s in difflib.get_close_matches(last, siblings, 3, 0.7)]
    close += [k for k in sorted(keys) if k.endswith("." + tail) and k not in close]  # model.lr -> trainer.lr
    if not close and not parent:  # a top-level name near one anywhere: temprature -> rollout.temperature
        names = {k.rsplit(".", 1)[-1] for k in keys}
        close = [k for n in difflib.get_close_matches(last, names, 3, 0.8) for k in sorted(keys)
                 if k.rsplit(".", 1)[-1] == n and not rest]
        close += [k for k in difflib.get_close_matches(key, keys, 3, 0.8) if k not in close]  # trainer_lr
    what = "unknown key or group" if not parent and not rest else "unknown key"
    msg = f"config key `{key}`: {what}"
    if close:
        return msg + "; did you mean " + " or ".join(close[:3]) + "?"
    return msg + f"; valid {'under ' + parent if parent else 'at the top level'}: " + ", ".join(sorted(siblings))


def _kind(key: str) -> Any:
    cls: Any = _root()
    parts = key.split(".")
    for i, part in enumerate(parts):
        cls = _kinds(cls, ".".join([*parts[:i], ""]))[part]
    return cls


def _walk_key(key: str) -> str | None:
    """None when `key` is a schema key or lies inside an open group; else the first unknown prefix."""
    cls: Any = _root()
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = _kinds(cls, ".".join([*parts[:i], ""]))
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


def check_overrides(overrides: Iterable[str], search_dirs: Iterable[Path], *, skip: tuple[str, ...] = (),
                    paths: bool = False) -> None:
    """Refuse an override that names a key the schema does not have, or gives a value of the wrong type for the
    field it sets (ConfigError, one line: `config key `KEY`: ...`); with `paths`, also one that names a file or
    folder that is not there (PATH_KEYS). Keys starting with one of `skip` are left out.

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
        if key.startswith(skip):
            continue
        if _is_group(key, dirs):
            continue
        if _walk_key(key) is not None:
            raise ConfigError(unknown_key_message(key, _groups(dirs)))
        values = _values(o)
        _check_type(key, values)
        if key == "algorithm.correction.name":  # the declared names: no torch (parity.algorithm_config)
            for value in values:
                if not (isinstance(value, str) and "${" in value):
                    check_name(value)
        if paths and key in PATH_KEYS:
            _check_path(key, values)


# keys whose value names a file or folder that must be there: (what it must be, the test), checked on the command
# line before a command loads its libraries (`eval.model_path`'s run folder is resolved to its latest valid
# checkpoint by the command itself)
PATH_KEYS: dict[str, tuple[str, Any]] = {
    "eval.model_path": ("a checkpoint folder (config.json) or a run folder (checkpoints/)",
                        lambda p: (p / "config.json").is_file() or (p / "checkpoints").is_dir()),
    "data.path": ("a JSONL file", lambda p: p.is_file()),
}


def _values(o: Any) -> list[Any]:
    """The values an override sets: one, or each of a choice or range sweep (`trainer.lr=1e-3,1e-4`); none for an
    interval or glob sweep, whose values the sweeper picks."""
    if not o.is_sweep_override():
        return [o.value()]
    if o.is_choice_sweep() or o.is_range_sweep():
        return list(o.sweep_iterator())
    return []


def _leaf(key: str) -> tuple[type, str] | None:
    """(schema dataclass, field name) when `key` names one value of the schema (not a group of keys, nor a key
    inside an open group or a list)."""
    *parents, name = key.split(".")
    cls: Any = _root()
    for i, part in enumerate(parents):
        cls = _kinds(cls, ".".join([*parents[:i], ""])).get(part)
        if not dataclasses.is_dataclass(cls):
            return None
    return (cls, name) if name in _fields(cls) and _fields(cls)[name] in (None, list) else None


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is not None:
        return f"{typing.get_origin(tp).__name__}[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    return "any value" if tp is Any else getattr(tp, "__name__", str(tp))


def _check_type(key: str, values: list[Any]) -> None:
    """Each value as OmegaConf takes it for the field (the same conversions as Hydra's merge: "3" for an int, 1 for
    a float), or a ConfigError naming the key, the field's type and the value. An interpolation is left to Hydra."""
    from omegaconf.errors import ValidationError

    leaf = _leaf(key)
    if leaf is None:
        return
    node = _structured(leaf[0])
    for value in values:
        if isinstance(value, str) and "${" in value:
            continue
        try:
            node[leaf[1]] = value
        except ValidationError:
            got = "null" if value is None else repr(value)
            raise ConfigError(f"config key `{key}`: expected {_type_name(typing.get_type_hints(leaf[0])[leaf[1]])}, "
                              f"got {got}") from None


@functools.cache
def _structured(cls: type) -> Any:
    """The structured config of one schema dataclass (not the root's, ~0.2 s), kept to check values against: setting a
    field validates and converts the value as Hydra's merge does (what the field held before does not matter)."""
    from omegaconf import OmegaConf

    return OmegaConf.structured(cls)


def _check_path(key: str, values: list[Any]) -> None:
    what, ok = PATH_KEYS[key]
    for value in values:
        if value in (None, "") or "${" in str(value):
            continue
        p = Path(str(value)).expanduser()
        if not p.exists():
            raise ConfigError(f"config key `{key}`: {p} does not exist (expected {what})")
        if not ok(p):
            raise ConfigError(f"config key `{key}`: {p} is not {what}")


def check_config(cfg: Any) -> None:
    """Refuse a composed config (a DictConfig, or the typed one with an attribute set that the schema lacks)
    holding a key the schema does not have (ConfigError, one line)."""
    from omegaconf import DictConfig

    def items(node: Any) -> Iterable[tuple[str, Any]]:
        return node.items_ex(resolve=False) if isinstance(node, DictConfig) else vars(node).items()

    def walk(node: Any, cls: type, prefix: str) -> None:
        fields = _kinds(cls, prefix)
        for name, child in items(node):
            key = f"{prefix}{name}"
            if name not in fields:
                raise ConfigError(unknown_key_message(key))
            kind = fields[name]
            if dataclasses.is_dataclass(kind) and (isinstance(child, DictConfig) or dataclasses.is_dataclass(child)):
                walk(child, kind, f"{key}.")

    walk(cfg, _root(), "")


__all__ = ["ALIASES", "PATH_KEYS", "check_config", "check_overrides", "open_groups", "schema_keys", "unknown_key_message"]
