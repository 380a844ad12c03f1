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
_SECRET_KEY = re.compile(r"(?i)(password|passwd|secret|token|api_?key|credential|private_key)")


def mask_url(text: str) -> str:
    text = _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    return _QUERY_SECRET.sub(lambda m: f"{m['key']}{MASK}", text)


def is_secret_key(key: str) -> bool:
    return bool(_SECRET_KEY.search(key.rsplit(".", 1)[-1]))


def mask_value(key: str, value: Any) -> Any:
    if value is None:
        return None
    if is_secret_key(key):
        return MASK
    return mask_url(value) if isinstance(value, str) else value


def mask_params(params: dict[str, Any]) -> dict[str, Any]:
    return {k: mask_value(k, v) for k, v in params.items()}
