"""The correction interface and its registry (`algorithm.correction.name`).

A correction is a named component with its own config section (`algorithm.correction.<config_key>`)
and state. Per micro-batch it may shift advantages, weight tokens (detached IS weights), mask tokens,
or add a per-token loss term; it records its metrics; once per step `end_step()` updates its state.
Adding one is a registration, `@CORRECTIONS.register(name, config=MyConfig)`: the name, the section's key (the name
unless `config_key` says otherwise) and its dataclass, which must match the declaration the config checks read
without torch (parity.algorithm_config: a built-in correction's is written there, one from another module is
declared by its registration; docs/ADD_A_CORRECTION.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from parity.algorithm_config import KEY, declare, section_path, section_values
from parity.algorithms.mismatch import StepMetrics
from parity.algorithms.registry import Registry
from parity.types import RolloutBatch


def token_rows(mask: torch.Tensor) -> torch.Tensor:
    """Flat indices of mask's True entries in row-major order (one device sync). Integer indexing with them needs
    no host sync; boolean indexing (x[mask]) syncs with the device on every call, which left the GPU idle
    between the many small launches of a compiled trainer step."""
    return mask.reshape(-1).nonzero().squeeze(1)


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x[mask] for x [b, R, ...] given rows = token_rows(mask)."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, rows)


def scatter_rows(flat: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The [b, R] tensor holding flat [n] at the response tokens and 0 elsewhere (differentiable)."""
    return flat.new_zeros(mask.numel()).index_copy(0, rows, flat).view(mask.shape)


@dataclass
class CorrectionContext:
    """What a correction sees of one micro-batch. Token tensors are [b, R]; head tensors are flat over
    the response tokens ([n, K], n = mask.sum(), in row-major order of `mask`)."""

    mask: torch.Tensor  # bool [b, R] response tokens
    logprobs: torch.Tensor  # fp32 [b, R] trainer log-probs of the sampled tokens, with grad
    train_logprobs: torch.Tensor  # fp32 [b, R] detached pi_train: old log-probs if given, else current
    rollout_logprobs: torch.Tensor  # fp32 [b, R] pi_inf
    head_logprobs: torch.Tensor | None = None  # fp32 [n, K] trainer log-probs of the rollout's top-K, with grad
    head_rollout_logprobs: torch.Tensor | None = None  # fp32 [n, K] pi_inf of the same ids
    head_valid: torch.Tensor | None = None  # bool [n, K]: False where the rollout returned no entry
    rows: torch.Tensor | None = None  # long [n]: flat indices of mask's True entries (mask.view(-1).nonzero())
    group_ids: torch.Tensor | None = None  # long [b]: the prompt group of each row (responses of one prompt share it)

    def flat_rows(self) -> torch.Tensor:
        if self.rows is None:
            self.rows = token_rows(self.mask)
        return self.rows

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x[mask] for x [b, R, ...], without a device sync."""
        return gather_rows(x, self.flat_rows())

    def scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """[n] values at the response tokens of a [b, R] zero tensor (differentiable)."""
        return scatter_rows(flat, self.flat_rows(), self.mask)

    @property
    def log_ratio(self) -> torch.Tensor:
        """log(pi_train / pi_inf) of the sampled tokens, 0 on padding."""
        return torch.where(self.mask, self.train_logprobs - self.rollout_logprobs, 0.0)


class Correction:
    # set by CORRECTIONS.register: the registered name, the key of its section under algorithm.correction (None:
    # no section) and the section's dataclass
    name: ClassVar[str] = ""
    config_key: ClassVar[str | None] = None
    config_cls: ClassVar[type | None] = None
    needs_topk: ClassVar[bool] = False

    def __init__(self, cfg: Any = None, tolerance: float = 0.0) -> None:
        """`cfg`: the section (a DictConfig, a mapping, a `config_cls` instance or None for the defaults), merged
        into `self.cfg` as a `config_cls` (parity.algorithm_config.section_values: an unknown key or a value of
        the wrong type raises a ConfigError, a ValueError, naming it)."""
        if self.config_cls is not None and self.config_key is not None:
            cfg = read_section(cfg, self.config_cls, self.config_key)
        self.cfg = cfg
        self.tolerance = tolerance

    @property
    def section(self) -> str:
        return section_path(self.config_key) if self.config_key else KEY

    @property
    def provides_token_is_weight(self) -> bool:
        """True if `is_weight` is a token-level IS rule (a function of each token's own log(p/q)), which a partner
        such as score centering can apply to other tokens than the sampled one."""
        return False

    @property
    def weights_tokens(self) -> bool:
        """True if the correction weights tokens (overrides `weights`): at most one of a stack may."""
        return type(self).weights is not Correction.weights

    def token_level_setting(self) -> str:
        """What makes this correction's weights a token-level IS rule, for an error that asks for one ('' when no
        setting does)."""
        return ""

    @property
    def top_k(self) -> int:
        """Leading columns of the rollout's top-K this correction reads when `needs_topk` (0 = all it returns)."""
        return 0

    def key(self, field: str) -> str:
        return f"{section_path(self.config_key)}.{field}" if self.config_key else f"{KEY}.{field}"

    # -- checks ------------------------------------------------------------------------------------
    def check(self, others: list[Correction], policy_loss: str | None, topk_logprobs: int | None) -> None:
        """Raise ValueError naming the key if this correction cannot run in this configuration."""

    def check_batch(self, batch: RolloutBatch) -> None:
        """Raise ValueError if the batch lacks what this correction needs."""

    # -- per micro-batch ---------------------------------------------------------------------------
    def advantage_shift(self, ctx: CorrectionContext) -> torch.Tensor | None:
        """[b, R] amount subtracted from the per-token advantages (0 on padding), or None."""
        return None

    def weights(self, ctx: CorrectionContext) -> torch.Tensor | None:
        """Detached multiplicative token weights [b, R], or None."""
        return None

    def keep_mask(self, ctx: CorrectionContext) -> torch.Tensor | None:
        """bool [b, R]: False drops the token's whole loss (it still counts in the denominators)."""
        return None

    def is_weight(self, log_ratio: torch.Tensor) -> torch.Tensor:
        """The token-level IS rule as a function of log(p/q) (only if provides_token_is_weight)."""
        raise NotImplementedError(f"correction {self.name!r} has no token-level IS weight")

    def extra_loss(self, ctx: CorrectionContext, advantages: torch.Tensor,
                   is_weight: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor | None:
        """Per-token loss term [b, R] added to the policy loss, or None."""
        return None

    def record(self, ctx: CorrectionContext, metrics: StepMetrics) -> None:
        """Accumulate this correction's metrics of the micro-batch."""

    # -- per step ----------------------------------------------------------------------------------
    def set_tolerance(self, c: float) -> None:
        """The mismatch tolerance c once `algorithm.correction.tolerance=auto` has measured it (or a resumed run
        restores it); a correction that uses c overrides this to take it up."""
        self.tolerance = float(c)

    def step_sums(self) -> dict[str, float]:
        """Sums this correction accumulates over the step's tokens before `end_step` uses them (e.g. dual's
        gap sum and token count). A data-parallel trainer adds them over its ranks and hands them back with
        `set_step_sums`, so `end_step` sees the whole batch."""
        return {}

    def set_step_sums(self, sums: dict[str, float]) -> None:
        """Replace the accumulated sums with `sums` (the same keys as `step_sums`)."""

    def end_step(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"correction {self.name!r} is stateless but its checkpoint state is {state!r}")


class CorrectionRegistry(Registry[type[Correction]]):
    """Registry of correction classes; a registration also declares the correction's config section
    (parity.algorithm_config.declare), which the config's checks read."""

    def register(self, name: str, config: type | None = None,  # type: ignore[override]
                 config_key: str | None = None) -> Callable[[type[Correction]], type[Correction]]:
        """`@CORRECTIONS.register("mine", config=MineConfig)`: the class becomes correction `mine` with the section
        `algorithm.correction.mine` (or `.<config_key>`, which corrections may share) of dataclass MineConfig; a
        correction from outside parity has it under `algorithm.correction.external`."""
        key = (config_key or name) if config is not None else None

        def decorator(cls: type[Correction]) -> type[Correction]:
            if not (isinstance(cls, type) and issubclass(cls, Correction)):
                raise TypeError(f"correction {name!r}: {cls!r} is not a Correction subclass")
            if name in self:
                raise ValueError(f"correction {name!r} is registered twice")
            declare(name, key, config)
            cls.name, cls.config_key, cls.config_cls = name, key, config
            return Registry.register(self, name)(cls)

        return decorator


CORRECTIONS = CorrectionRegistry("correction", f"{KEY}.name")


def read_section(section: Any, cls: type, key: str) -> Any:
    """Section `key` (a DictConfig, a mapping, a `cls` instance or None for the defaults) as a `cls` dataclass, merged
    through it (parity.algorithm_config.section_values: a ConfigError, a ValueError, names a bad key or value)."""
    return section if isinstance(section, cls) else cls(**section_values(key, section))


def require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{key}: {msg}")
