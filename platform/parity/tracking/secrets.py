"""Secret masking for what tracking records (defined in parity.core.secrets, which the run folder shares)."""

from parity.core.secrets import (
    MASK,
    is_secret_key,
    mask_params,
    mask_tree,
    mask_url,
    mask_value,
    masked_config_yaml,
)

__all__ = ["MASK", "is_secret_key", "mask_params", "mask_tree", "mask_url", "mask_value", "masked_config_yaml"]
