"""Hydra config: schema registration, composition from the repo's configs/, validation."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from parity.config.schema import ParityConfig
from parity.config.validate import ConfigError, validate_config

_REGISTERED = False


def register_schema() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from hydra.core.config_store import ConfigStore  # lazy: the numerical core runs without hydra

        ConfigStore.instance().store(name="parity_schema", node=ParityConfig)
        _REGISTERED = True


def repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


def config_dir() -> Path:
    env = os.environ.get("PARITY_CONFIGS")
    return Path(env).resolve() if env else repo_root() / "configs"


def normalize_overrides(overrides: list[str]) -> list[str]:
    """`+experiment=x` and `experiment=x` mean the same here: experiment is always in the defaults list
    (arith_tiny), so Hydra would refuse the `+` form that users know from other projects."""
    return [o[1:] if o.startswith("+experiment=") else o for o in overrides]


def load_config(overrides: list[str] | None = None, extra_config_dir: str | None = None,
                validate: bool = True) -> DictConfig:
    """Compose the config the way `python -m parity <command>` does (Hydra compose API), for flows and tests."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    overrides = normalize_overrides(list(overrides or []))
    if extra_config_dir:
        overrides = [f"hydra.searchpath=[file://{Path(extra_config_dir).resolve()}]", *overrides]
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    if validate:
        validate_config(cfg)
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def flatten(cfg: DictConfig) -> dict[str, object]:
    """Resolved config as dotted keys (for MLflow params)."""
    out: dict[str, object] = {}

    def walk(node: object, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            out[prefix] = node

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


__all__ = ["ConfigError", "load_config", "validate_config", "register_schema", "config_dir", "flatten", "to_yaml"]
