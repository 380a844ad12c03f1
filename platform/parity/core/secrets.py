"""Keep secrets out of logs, MLflow params and the dashboard: passwords in URLs and values whose key
names a secret are replaced by '***' before anything is recorded."""

from __future__ import annotations

import re
from typing import Any

MASK = "***"
# user:password@ in any URL-like string (postgresql+psycopg://u:p@h/db, https://u:tok@host)
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@/\s]+)@")
# ?token=...&password=... style query parameters
_QUERY_SECRET = re.compile(r"(?i)(?P<key>[?&;](?:password|passwd|pwd|token|access_token|api_key|apikey|secret|"
                           r"auth|sig|signature)=)(?P<val>[^&;\s]+)")
# a key names a secret when one of its words (split at _ and -) is one of these, or it holds one of the pairs:
# `hf_token`, `password`, `client_secret`, `api_key` are secrets; `max_new_tokens` and `tokenizer` are not
_SECRET_WORDS = frozenset({"password", "passwd", "pwd", "secret", "token", "apikey", "credential", "credentials"})
_SECRET_PAIRS = ("api_key", "private_key", "access_key", "secret_key", "auth_key")


def mask_url(text: str) -> str:
    text = _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    return _QUERY_SECRET.sub(lambda m: f"{m['key']}{MASK}", text)


def is_secret_key(key: str) -> bool:
    last = key.rsplit(".", 1)[-1].lower()
    return any(w in _SECRET_WORDS for w in re.split(r"[_\-]", last)) or any(p in last for p in _SECRET_PAIRS)


def mask_value(key: str, value: Any) -> Any:
    if value is None:
        return None
    if is_secret_key(key):
        return MASK
    return mask_url(value) if isinstance(value, str) else value


def mask_params(params: dict[str, Any]) -> dict[str, Any]:
    return {k: mask_value(k, v) for k, v in params.items()}


def mask_tree(node: Any, key: str = "") -> Any:
    """A nested dict/list (a resolved config) with secret-keyed values and URL credentials replaced by '***'."""
    if isinstance(node, dict):
        return {k: mask_tree(v, str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [mask_tree(v, key) for v in node]
    return mask_value(key, node)


def masked_config_yaml(cfg: Any) -> str:
    """The resolved config as YAML, secrets masked: what run folders and MLflow artifacts store."""
    import dataclasses

    from omegaconf import OmegaConf
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        tree = dataclasses.asdict(cfg)  # the typed config (parity.config.load_config)
    else:
        tree = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg
    return OmegaConf.to_yaml(OmegaConf.create(mask_tree(tree)))
