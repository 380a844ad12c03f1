"""The `algorithm` section of the config and the corrections' config sections, declared without torch: the config
schema (parity.config.schema) and its checks read them, and parity.algorithms takes its settings as them (the
objective and the losses an AlgorithmConfig, each correction its section's dataclass); a module of its own, so that
the two packages need not import each other.

`algorithm.correction` holds, beside its own keys, one plain mapping per section (`algorithm.correction.dual`, ...):
an open group of the schema whose keys, types and defaults the section's dataclass below declares. A correction
registered outside parity (a module of `algorithm.correction.modules`) declares its own section when its module is
imported (`declare`, which the correction registry calls); that section is `algorithm.correction.external.<key>`.

    AlgorithmConfig  `algorithm`, and CorrectionConfig, `algorithm.correction`
    NAMES            correction name -> the key of its section (None: it has none), the built-in corrections
    SECTIONS         section key -> its dataclass, the built-in sections (schema.CorrectionConfig's mapping fields)
    declare          a correction (and its section) registered outside parity
    import_modules   the modules of algorithm.correction.modules, which declare theirs
    check_name       an algorithm.correction.name of declared corrections only
    section_class    the dataclass of a section, by its dotted key
    section_values   a section's values merged through its dataclass: defaults filled, types converted; a key it
                     lacks or a value of the wrong type fails naming the key
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from parity.errors import ConfigError
from parity.mismatch_tolerance import DEFAULT_TOLERANCE

KEY = "algorithm.correction"
EXTERNAL = "external"  # algorithm.correction.external.<key>: the sections of corrections registered outside parity


@dataclass
class DualConfig:
    # tolerance on the discrepancy; null = algorithm.correction.tolerance (a number, or auto); 0.0037 = the paper's
    c: float | None = None
    lambda0: float = 0.1
    eta: float = 1.0
    lambda_max: float = 10.0
    # the constrained discrepancy: seq_mean = (1/|tau|) sum_t |p_train - p_inf| per trajectory, averaged over the
    # step's trajectories (the paper's) | token_mean = averaged over all the step's response tokens
    discrepancy: str = "seq_mean"


@dataclass
class DualCenteredConfig:
    c: float | None = None  # tolerance on D; null = the quantile below, measured over the first steps
    quantile: float = 0.75  # of the per-response gaps of the first calibration_steps steps
    calibration_steps: int = 1
    lambda0: float = 0.1
    eta: float = 1.0  # per step, on the relative excess (D - c) / c
    lambda_max: float = 2.0  # in advantage units


@dataclass
class IcePopConfig:
    lo: float = 0.5  # tokens whose ratio pi_train/pi_inf lies outside [lo, hi] get weight 0
    hi: float = 5.0


@dataclass
class MISConfig:
    statistic: str = "k3"  # k1 | k3 | geo_mean (per-response statistic of the log-ratios: corrections/mis.py)
    threshold: float = 0.01  # k1: drop when |mean(-log r)| > threshold; k3: drop when mean k3 > threshold
    lo: float = 0.5  # geo_mean: drop when exp(mean log r) < lo ...
    hi: float = 2.0  # ... or > hi


@dataclass
class ScoreCenteringConfig:
    top_k: int = 0  # leading columns of the rollout's top-K used as the head H; 0 = all (rollout.topk_logprobs)
    tail_floor: float = 1e-6  # floor of both tail masses in rho = (1 - Q_H) / (1 - P_H)


@dataclass
class TISConfig:
    C: float = 2.0  # truncation threshold of the IS ratio, > 0
    level: str = "token"  # token | sequence


SECTIONS: dict[str, type] = {"dual": DualConfig, "dual_centered": DualCenteredConfig, "icepop": IcePopConfig,
                             "mis": MISConfig, "score_centering": ScoreCenteringConfig, "tis": TISConfig}
NAMES: dict[str, str | None] = {"none": None, "dual": "dual", "dual_centered": "dual_centered", "icepop": "icepop",
                                "mis": "mis", "score_centering": "score_centering", "tis": "tis", "seq_tis": "tis"}

_DECLARED: dict[str, tuple[str | None, type | None]] = {}  # name -> (section key, dataclass), registered outside


def declare(name: str, key: str | None, config: type | None) -> None:
    """Declare correction `name` with the section `key` of dataclass `config` (both None: no section), as its
    registration does. A built-in name must come with its declared section; a section key that is taken must come
    with the same dataclass (corrections may share one, e.g. tis and seq_tis)."""
    if config is not None and not dataclasses.is_dataclass(config):
        raise TypeError(f"the config of correction {name!r} must be a dataclass, got {config!r}")
    if name in NAMES:
        if NAMES[name] != key or SECTIONS.get(key) is not config:  # type: ignore[arg-type]
            raise ValueError(f"correction {name!r} is declared in parity.algorithm_config with the section "
                             f"{NAMES[name]!r}, not {key!r} of {config!r}")
        return
    have = _section_classes().get(key) if key is not None else None
    if have is not None and have is not config:
        raise ValueError(f"{KEY}.{key} is already the section of {have!r}")
    if key in {f.name for f in dataclasses.fields(CorrectionConfig)}:
        raise ValueError(f"{KEY}.{key} is one of {KEY}'s own keys, not a section")
    _DECLARED[name] = (key, config)


def import_modules(modules: Any) -> None:
    """Import the modules of `algorithm.correction.modules` (each registers, and so declares, its corrections when first
    imported; a module imported before is not run again)."""
    for m in modules or ():
        try:
            importlib.import_module(str(m))
        except ImportError as e:
            raise ConfigError(f"{KEY}.modules: cannot import {str(m)!r}: {e}") from e


def names() -> list[str]:
    """Every declared correction name, sorted."""
    return sorted({*NAMES, *_DECLARED})


def check_name(value: Any) -> None:
    """Refuse an `algorithm.correction.name` whose parts ('a+b') are not all declared corrections, as the registry
    would once torch is loaded (the stack checks the rest: empty parts, repeats, what composes)."""
    for part in str(value).split("+"):
        if part.strip() and part.strip() not in names():
            raise ConfigError(f"config key `{KEY}.name`: unknown correction {part.strip()!r}; known: {', '.join(names())}")


def _section_classes() -> dict[str, type]:
    return {**SECTIONS, **{k: c for k, c in _DECLARED.values() if k is not None and c is not None}}


def section_path(key: str) -> str:
    """The dotted key of section `key`: a built-in section under algorithm.correction, another under its `external`."""
    return f"{KEY}.{key}" if key in SECTIONS else f"{KEY}.{EXTERNAL}.{key}"


def section_class(dotted: str) -> type | None:
    """The dataclass of the section at `dotted` (algorithm.correction.dual, algorithm.correction.external.mine), or
    None when nothing declares one there."""
    prefix = f"{KEY}.{EXTERNAL}."
    if dotted.startswith(prefix):
        key = dotted[len(prefix):]
        return None if key in SECTIONS else _section_classes().get(key)
    return SECTIONS.get(dotted[len(KEY) + 1:]) if dotted.startswith(f"{KEY}.") else None


def section_values(key: str, section: Any) -> dict[str, Any]:
    """Section `key` (a mapping, a DictConfig, its dataclass or None) merged through its dataclass, as a plain dict:
    defaults filled, values converted as the schema converts them ("3" or 3 for a float). A key the dataclass lacks
    or a value of the wrong type is a ConfigError naming the key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = section_path(key)
    cls = _section_classes().get(key)
    if cls is None:
        raise ConfigError(f"config key `{path}`: no correction declares this section; declared: "
                          f"{', '.join(sorted(_section_classes()))} (a correction of another module is declared when "
                          f"{KEY}.modules names it)")
    if section is None:
        return dataclasses.asdict(cls())
    if dataclasses.is_dataclass(section) and not isinstance(section, type):
        section = dataclasses.asdict(section)
    if not isinstance(section, Mapping) and not hasattr(section, "items"):
        raise ConfigError(f"config key `{path}`: expected a mapping of {cls.__name__}'s keys, got {section!r}")
    fields = [f.name for f in dataclasses.fields(cls)]
    for name in section:
        if name not in fields:
            close = difflib.get_close_matches(str(name), fields, 3, 0.7)
            raise ConfigError(f"config key `{path}.{name}`: unknown key; " + (
                f"did you mean {' or '.join(f'{path}.{c}' for c in close)}?" if close else
                f"valid under {path}: {', '.join(sorted(fields))}"))
    try:
        merged = OmegaConf.merge(_structured(cls), dict(section.items()))
    except OmegaConfBaseException as e:
        name = str(getattr(e, "key", "") or "")
        detail = str(e).splitlines()[0]
        raise ConfigError(f"config key `{path}.{name}`: {detail}" if name else f"config key `{path}`: {detail}") from None
    return OmegaConf.to_container(merged, resolve=False)  # type: ignore[return-value]


@functools.cache
def _structured(cls: type) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.structured(cls)


def defaults(key: str) -> dict[str, Any]:
    """The built-in section `key`'s default values (the schema's default of its mapping field)."""
    return dataclasses.asdict(SECTIONS[key]())


@dataclass
class CorrectionConfig:
    """`algorithm.correction`: the stack's own keys, then each correction's section as a plain mapping (an open
    group whose keys, types and defaults the section's dataclass declares, below; loading the
    config fills and checks it, naming the key)."""

    name: str = "none"  # registered names joined by '+', e.g. score_centering+tis
    # c of the mismatch telemetry's over-tolerance fraction and of the dual: a number (0.0037 = DC-GRPO's for
    # Qwen3-8B) or auto = tolerance_multiple x the mean |p_train - p_inf| the validate stage measured for this
    # rollout precision (its validation.json), or, without one, of the first tolerance_steps steps
    tolerance: Any = DEFAULT_TOLERANCE
    tolerance_multiple: float = 1.0
    tolerance_steps: int = 3
    # modules that register corrections defined outside parity, imported by every process that builds the
    # corrections (the trainer, each Ray actor) before the names are looked up
    modules: list[str] = field(default_factory=list)
    dual: dict[str, Any] = field(default_factory=partial(defaults, "dual"))
    dual_centered: dict[str, Any] = field(default_factory=partial(defaults, "dual_centered"))
    icepop: dict[str, Any] = field(default_factory=partial(defaults, "icepop"))
    mis: dict[str, Any] = field(default_factory=partial(defaults, "mis"))
    score_centering: dict[str, Any] = field(default_factory=partial(defaults, "score_centering"))
    tis: dict[str, Any] = field(default_factory=partial(defaults, "tis"))
    # the sections of the corrections that modules register, by their key (algorithm.correction.external.<key>)
    external: dict[str, Any] = field(default_factory=dict)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True
    policy_loss: str = "ppo_clip"  # ppo_clip | reinforce
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
    logprob_chunk_size: int = 1024  # rows per chunk of the full-vocabulary log-softmax (parity.algorithms.logprobs)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    # MoE routing replay (R3): training forwards use the experts the rollout used (needs rollout.capture_routing)
    routing_replay: bool = False
