"""Hydra config: schema registration, composition from the repo's configs/, validation."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from parity.algorithm_config import SECTIONS, import_modules, section_class, section_values
from parity.config.keys import REMOVED, check_config, check_overrides, open_groups, unknown_key_message
from parity.config.schema import ParityConfig
from parity.config.seed_block import fold_seed_block
from parity.config.validate import ConfigError, validate_config
from parity.config_tree import config_dir, default_groups

_STORED = False  # the schema is stored with Hydra


def register_schema() -> None:
    """Store the schema (ParityConfig) with Hydra as `parity_schema`, the first entry of configs/config.yaml's
    defaults list."""
    global _STORED
    if not _STORED:
        from hydra.core.config_store import ConfigStore  # lazy: the numerical core runs without hydra

        ConfigStore.instance().store(name="parity_schema", node=ParityConfig)
        _STORED = True


def _override_modules(overrides: list[str]) -> list[str]:
    keyed = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] == "algorithm.correction.modules" and "=" in o]
    if not keyed:
        return []
    from hydra.core.override_parser.overrides_parser import OverridesParser

    value = OverridesParser.create().parse_overrides(keyed[-1:])[0].value()
    return [str(v) for v in value] if isinstance(value, list) else [str(value)]


def normalize_overrides(overrides: list[str]) -> list[str]:
    """`+eval=quick` and `eval=quick` mean the same here, and so for every group of the defaults list
    (`+experiment=x`, `+model=hf`): the group is always there, so Hydra would refuse the `+` form that
    users know from other projects. A key inside an open group (`eval.benchmarks.aime24.k=4`) is added
    or changed without a `+`, since such groups take keys of the user's choosing."""
    groups, opened = default_groups(), tuple(f"{g}." for g in open_groups())
    out = []
    for o in overrides:
        name = o[1:].split("=", 1)[0] if o.startswith("+") and not o.startswith("++") and "=" in o else None
        if name in groups:
            o = o[1:]
        elif "=" in o and o[0] not in "+~" and o.startswith(opened):  # open groups take new keys as they are
            o = "++" + o
        out.append(o)
    return out


def check_keys(overrides: list[str], extra_config_dirs: list[str | Path] = (), paths: bool = False) -> None:
    """Refuse an override naming a key the schema lacks (one-line ConfigError: the key and the closest
    valid keys) or setting a value of the wrong type (the key, the type, the value), the keys of the corrections'
    sections too (their declarations, parity.algorithm_config: no torch); with `paths`, one naming a file or folder
    that is not there (parity.config.keys.PATH_KEYS). Group choices are recognised by the folders of the config tree
    and of `extra_config_dirs`."""
    check_overrides(overrides, [config_dir(), *(Path(d) for d in extra_config_dirs)], paths=paths)


def load_config(overrides: list[str] | None = None, extra_config_dir: str | None = None,
                validate: bool = True) -> ParityConfig:
    """Compose the config the way `python -m parity <command>` does (Hydra compose API), for flows and tests:
    checked, validated, and returned as the schema's dataclasses (`typed`)."""
    return typed(compose_config(overrides, extra_config_dir, validate))


def compose_config(overrides: list[str] | None = None, extra_config_dir: str | None = None,
                   validate: bool = True) -> DictConfig:
    """load_config before `typed`: the composed DictConfig, checked and validated, its interpolations (such as
    `${oc.env:PARITY_OUTPUTS,outputs}`) still unresolved, for what inspects the config's sources."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = checked_overrides(list(overrides or []), [extra_config_dir] if extra_config_dir else [])
    if extra_config_dir:
        overrides = [f"hydra.searchpath=[file://{Path(extra_config_dir).resolve()}]", *overrides]
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        try:
            cfg = compose(config_name="config", overrides=overrides)
        except Exception as e:
            _refuse_removed_key(e)
            raise
    return checked_config(cfg, validate)


def checked_overrides(overrides: list[str], config_dirs: list[str | Path] = (), check_paths: bool = False) -> list[str]:
    """What loading a config checks before Hydra composes it, in order, for `load_config` and the CLI alike: the
    overrides normalised (normalize_overrides); the modules an `algorithm.correction.modules=[...]` override names
    imported, so that the sections of the corrections they register can be set in the same overrides; every key and
    value type, with `check_paths` (the CLI) the paths too (check_keys), before anything imports torch; the schema
    stored with Hydra. Returns the normalised overrides; a ConfigError names the key."""
    overrides = normalize_overrides(overrides)
    import_modules(_override_modules(overrides))
    check_keys(overrides, config_dirs, paths=check_paths)
    register_schema()
    return overrides


def checked_config(cfg: DictConfig, validate: bool = True) -> DictConfig:
    """What loading a config checks once Hydra has composed it: keys set by config files (check_config), each
    correction section filled and converted through its declared dataclass (complete_sections), then the values and
    their combinations, the correction stack built (validate_config). `typed` then gives the library's
    dataclasses."""
    check_config(cfg)
    complete_sections(cfg)
    if validate:
        validate_config(cfg)
    return cfg


def complete_sections(cfg: DictConfig) -> None:
    """Each section of `algorithm.correction` (the built-in ones, and those of `external` that the corrections of
    `algorithm.correction.modules` declare) as its dataclass reads it: defaults filled, values converted (`eta: 1` is
    1.0), a key it lacks or a value of the wrong type a ConfigError naming the key."""
    correction = cfg.algorithm.correction
    import_modules(correction.get("modules"))
    for key in SECTIONS:
        correction[key] = section_values(key, correction.get(key))
    external = correction.get("external") or {}
    for key in list(external):
        external[key] = section_values(str(key), external[key])


def typed(cfg: DictConfig) -> ParityConfig:
    """A composed config as the schema's dataclasses, every interpolation resolved and the seed block's precision
    folded into `rollout.precision` (parity.config.seed_block): what library code takes."""
    return fold_seed_block(OmegaConf.to_object(cfg))  # type: ignore[arg-type]


def from_plain(plain: Mapping[str, Any]) -> ParityConfig:
    """A config sent as a plain resolved mapping (to a Ray actor, a Prefect task) back as the schema's
    dataclasses, its values checked against the schema's types (the corrections' sections are plain mappings: the
    process that builds the corrections reads them through their dataclasses)."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        return typed(OmegaConf.merge(OmegaConf.structured(ParityConfig), dict(plain)))  # type: ignore[arg-type]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"config key `{key}`: {str(e).splitlines()[0]}" if key else str(e).splitlines()[0]) from None


def as_plain(cfg: ParityConfig | DictConfig | Any) -> dict[str, Any]:
    """The config (or one section) as plain dicts and lists: what crosses a process boundary or is written out."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return copy.deepcopy(dict(cfg))


def with_values(cfg: ParityConfig, values: Mapping[str, Any]) -> ParityConfig:
    """A copy of `cfg` with the dotted keys of `values` set (`{"trainer.resume": True}`), each value checked
    against (and converted to) the schema's type; a key the schema lacks or a value of the wrong type is a
    ConfigError naming the key. The original is left as it was."""
    out = copy.deepcopy(cfg)
    for dotted, value in values.items():
        *parents, last = dotted.split(".")
        node: Any = out
        for part in parents:
            node = node[part] if isinstance(node, dict) else getattr(node, part, None)
            if node is None:
                raise ConfigError(unknown_key_message(dotted))
        if isinstance(node, dict) and section_class(".".join(parents)) is not None:  # a correction's section
            node.update(section_values(parents[-1], {**node, last: value}))
        elif isinstance(node, dict):
            node[last] = value
        elif dataclasses.is_dataclass(node) and last in {f.name for f in dataclasses.fields(node)}:
            setattr(node, last, _checked(node, last, dotted, value))
        else:
            raise ConfigError(unknown_key_message(dotted))
    return out

def _refuse_removed_key(error: BaseException) -> None:
    """A config file that sets a removed key fails in Hydra's composition (the schema lacks the key): raise the
    error that names the key's new spelling instead, with the file Hydra names."""
    full_key = None
    cause: BaseException | None = error
    while cause is not None and full_key is None:
        full_key = getattr(cause, "full_key", None)
        cause = cause.__cause__ or cause.__context__
    if full_key in REMOVED:
        where = str(error).splitlines()[0].split(":", 1)[0]  # "In 'experiment/old'"
        raise ConfigError(f"{where}: {unknown_key_message(full_key)}") from None


def _checked(node: Any, key: str, dotted: str, value: Any) -> Any:
    """`value` as the schema's field `key` of the section `node` takes it (OmegaConf's conversions: "3" for an
    int, 1 for a float), or a ConfigError naming `dotted`."""
    from omegaconf.errors import ValidationError

    if dataclasses.is_dataclass(value) or isinstance(value, dict | list):
        return value
    check = OmegaConf.structured(type(node))
    try:
        check[key] = value
    except ValidationError as e:
        raise ConfigError(f"config key `{dotted}`: {str(e).splitlines()[0]}") from None
    return OmegaConf.to_container(check, resolve=False)[key]  # a '${' in a string is text here, not a reference


def to_yaml(cfg: ParityConfig | DictConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(as_plain(cfg), flags={"allow_objects": True}))


def flatten(cfg: ParityConfig | DictConfig) -> dict[str, object]:
    """Resolved config as dotted keys (for MLflow params)."""
    out: dict[str, object] = {}

    def walk(node: object, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            out[prefix] = node

    walk(as_plain(cfg), "")
    return out


__all__ = ["ConfigError", "ParityConfig", "load_config", "compose_config", "typed", "from_plain", "as_plain", "with_values", "validate_config", "register_schema", "config_dir",
           "flatten", "to_yaml", "check_keys", "check_config", "open_groups", "normalize_overrides", "default_groups",
           "checked_overrides", "checked_config", "complete_sections"]
