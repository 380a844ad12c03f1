"""Container health check of every role of the Parity image (stdlib only: the image has no curl).

`python healthcheck.py URL...` checks the given URLs; without arguments it reads the role that
docker/entrypoint.sh recorded and checks that role's own health endpoint. Exit 0 = healthy, 1 = not
(Docker's HEALTHCHECK contract); the reason goes to stderr, which `docker inspect` shows."""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

TIMEOUT_S = 5.0


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def role_urls(role: str) -> list[str]:
    """Health endpoints of a role; [] = nothing to probe (a one-off command is healthy while it runs)."""
    if role == "ray-head":
        return [f"http://127.0.0.1:{_env('RAY_DASHBOARD_PORT', '8265')}/api/gcs_healthz"]
    if role == "ray-worker":
        # every Ray node runs a dashboard agent; this endpoint is KubeRay's readiness probe
        return [f"http://127.0.0.1:{_env('RAY_DASHBOARD_AGENT_PORT', '52365')}/api/local_raylet_healthz"]
    if role == "dashboard":
        return [f"http://127.0.0.1:{_env('DASHBOARD_PORT', '8501')}/_stcore/health"]
    if role == "mlflow":
        return [f"http://127.0.0.1:{_env('MLFLOW_PORT', '5000')}/health"]
    if role == "prefect-server":
        return [f"http://127.0.0.1:{_env('PREFECT_SERVER_PORT', '4200')}/api/health"]
    if role == "flows":
        # a flows process is only useful while its Prefect server answers
        api = os.environ.get("PREFECT_API_URL")
        return [api.rstrip("/") + "/health"] if api else []
    return []


def probe(url: str, timeout_s: float = TIMEOUT_S) -> str | None:
    """None when the URL answers 2xx, else the reason."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (fixed local URLs)
            if 200 <= resp.status < 300:
                return None
            return f"{url}: HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        return f"{url}: HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return f"{url}: {getattr(e, 'reason', e)}"


def main(argv: list[str]) -> int:
    if argv:
        urls = argv
    else:
        role_file = Path(os.environ.get("PARITY_ROLE_FILE", "/tmp/parity-role"))
        role = role_file.read_text().strip() if role_file.exists() else ""
        urls = role_urls(role)
    failures = [reason for url in urls if (reason := probe(url)) is not None]
    for reason in failures:
        print(f"unhealthy: {reason}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
