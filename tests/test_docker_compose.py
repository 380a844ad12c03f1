"""docker/compose.yaml against the code: the settings the compose file passes are the ones parity,
Prefect, MLflow and Ray read (composed with the platform's own config loader), its URLs point at its
own services and databases, only the UIs are published (on 127.0.0.1), secrets have no defaults."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from omegaconf import OmegaConf

from parity.config import compose_config, load_config

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "compose.yaml"
COMPOSE_GPU = DOCKER / "compose.gpu.yaml"
ENV_EXAMPLE = DOCKER / ".env.example"
SECRETS = {"POSTGRES_PASSWORD": "pw-test", "RAY_AUTH_TOKEN": "tok-test"}
# services that run the platform's own code (the Parity image with the parity settings block)
PLATFORM_SERVICES = ("ray-head", "ray-worker", "flows", "dashboard")
UI_PORTS = {"mlflow": 5000, "prefect-server": 4200, "ray-head": 8265, "dashboard": 8501}
# the settings the platform must receive, and the config key each one sets
REQUIRED = {
    "PARITY_OUTPUTS": "outputs_dir",
    "PARITY_DATASETS": "data.datasets_dir",
    "PARITY_TRACKING_URI": "tracking.tracking_uri",
    "PARITY_REGISTRY_URL": "tracking.registry_url",
    "PARITY_RAY_ADDRESS": "distributed.address",
}

# ---- compose interpolation (the subset of the Compose spec the files use) -------------------------
_VAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\})")


class MissingVariable(ValueError):
    pass


def interpolate(text: str, env: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        name, op, arg = m["name"], m["op"], m["arg"] or ""
        value = env.get(name)
        unset_or_empty = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if unset_or_empty else value  # type: ignore[return-value]
        if op in (":?", "?"):
            if unset_or_empty:
                raise MissingVariable(f"{name}: {arg}")
            return value  # type: ignore[return-value]
        return value or ""

    return _VAR.sub(one, text)


def _walk(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, dict):
        return {k: _walk(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_walk(v, env) for v in node]
    return interpolate(node, env) if isinstance(node, str) else node


def read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def resolved(files: tuple[Path, ...] = (COMPOSE,), overrides: dict[str, str] | None = None) -> dict[str, Any]:
    """Services of the compose files as Compose resolves them with .env.example plus `overrides`
    (later files merge into earlier ones service by service, as `-f a -f b` does for these keys)."""
    env = {**read_env_file(ENV_EXAMPLE), **(SECRETS if overrides is None else overrides)}
    services: dict[str, Any] = {}
    for f in files:
        doc = _walk(yaml.safe_load(f.read_text()), env)
        for name, svc in doc["services"].items():
            services[name] = {**services.get(name, {}), **svc}
    return services


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    assert isinstance(env, dict), "compose.yaml: use the mapping form of `environment`"
    return {k: str(v) for k, v in env.items()}


# ---- the platform reads what compose passes ----------------------------------------------------------
def env_reads_of_schema() -> dict[str, str]:
    """{ENV_NAME: dotted config key} for every `${oc.env:NAME,...}` in parity's composed (unresolved) config."""
    cfg = compose_config([], validate=False)
    found: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(node, str):
            for name in re.findall(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)", node):
                found[name] = prefix

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return found


def env_reads_of_code() -> set[str]:
    """PARITY_* names the Python code reads directly (os.environ / os.getenv), outside the config schema."""
    pattern = re.compile(r"""(?:environ(?:\.get)?\(?\[?|getenv\()\s*["'](PARITY_[A-Z0-9_]+)["']""")
    names: set[str] = set()
    for tree in ("platform", "flows", "tasks", "dashboards"):
        for path in (REPO / tree).rglob("*.py"):
            names |= set(pattern.findall(path.read_text()))
    return names


def test_the_schema_reads_the_names_this_test_expects() -> None:
    reads = env_reads_of_schema()
    assert {k: reads.get(k) for k in REQUIRED} == REQUIRED


@pytest.mark.parametrize("service", PLATFORM_SERVICES)
def test_platform_config_resolves_to_the_values_compose_passes(service: str, monkeypatch: pytest.MonkeyPatch) -> None:
    env = env_of(resolved()[service])
    reads = env_reads_of_schema()
    passed = {k for k in env if k.startswith("PARITY_")}
    unknown = passed - set(reads) - env_reads_of_code()
    assert not unknown, f"{service} passes {sorted(unknown)}, which neither parity's config nor its code reads"
    assert set(REQUIRED) <= passed, f"{service} lacks {sorted(set(REQUIRED) - passed)}"

    for name in list(os.environ):
        if name.startswith("PARITY_"):
            monkeypatch.delenv(name)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = load_config([])
    for name in passed & set(reads):
        node = cfg
        for part in reads[name].split("."):
            node = getattr(node, part)
        assert node == env[name], f"{service}: {name} -> {reads[name]}"
    # everything a run writes lands on the outputs volume
    outputs = env["PARITY_OUTPUTS"]
    assert cfg.rollout.precision.export_dir.startswith(outputs + "/")
    mounts = {v.split(":")[1] for v in resolved()[service].get("volumes", [])}
    assert outputs in mounts, f"{service} does not mount a volume at {outputs}"


def _db(url: str) -> tuple[str, str | None, int | None, str, str | None, str | None]:
    u = urlsplit(url)
    return u.scheme, u.hostname, u.port, u.path.lstrip("/"), u.username, u.password


def test_urls_point_at_the_compose_services_and_databases() -> None:
    svc = resolved()
    pg = env_of(svc["postgres"])
    user, password = pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"]
    assert password == SECRETS["POSTGRES_PASSWORD"]
    expected = {
        (env_of(svc["flows"])["PARITY_REGISTRY_URL"], "postgresql+psycopg", pg["REGISTRY_DB"]),
        (env_of(svc["mlflow"])["MLFLOW_BACKEND_STORE_URI"], "postgresql+psycopg", pg["MLFLOW_DB"]),
        (env_of(svc["prefect-server"])["PREFECT_API_DATABASE_CONNECTION_URL"], "postgresql+asyncpg", pg["PREFECT_DB"]),
    }
    assert len({db for _, _, db in expected}) == 3, "MLflow, Prefect and the registry need separate databases"
    for url, scheme, db in expected:
        assert _db(url) == (scheme, "postgres", 5432, db, user, password), url

    flows = env_of(svc["flows"])
    mlflow_port = int(env_of(svc["mlflow"])["MLFLOW_PORT"])
    assert urlsplit(flows["PARITY_TRACKING_URI"])[:2] == ("http", f"mlflow:{mlflow_port}")
    prefect_port = env_of(svc["prefect-server"])["PREFECT_SERVER_PORT"]
    assert flows["PREFECT_API_URL"] == f"http://prefect-server:{prefect_port}/api"
    # drivers join the cluster through the head's GCS (entrypoint default port 6379, not overridden)
    assert "RAY_GCS_PORT" not in env_of(svc["ray-head"])
    for name in ("flows", "ray-worker"):
        assert env_of(svc[name])["RAY_HEAD_ADDRESS"] == "ray-head:6379"
    assert flows["PARITY_RAY_ADDRESS"] == "auto"


def test_database_drivers_of_the_urls_are_installed() -> None:
    from sqlalchemy.engine import make_url

    svc = resolved()
    for url in (env_of(svc["flows"])["PARITY_REGISTRY_URL"], env_of(svc["mlflow"])["MLFLOW_BACKEND_STORE_URI"],
                env_of(svc["prefect-server"])["PREFECT_API_DATABASE_CONNECTION_URL"]):
        make_url(url).get_dialect().import_dbapi()  # ImportError names the missing driver


# Each library is asked, in a fresh process with the services' environment, what it resolved. MLflow's
# host guard module is loaded without running MLflow's package __init__ (a ~30 s import on a busy machine).
_PROBES = {
    "prefect": r"""
from prefect.settings import get_current_settings
s = get_current_settings()
url = s.server.database.connection_url
out = {"db": url.get_secret_value() if hasattr(url, "get_secret_value") else url,
       "api": s.api.url, "ui_api": s.server.ui.api_url}
""",
    "mlflow": r"""
import importlib.util, sys, types
root = importlib.util.find_spec("mlflow").submodule_search_locations[0]
for pkg, path in (("mlflow", root), ("mlflow.server", root + "/server")):
    sys.modules[pkg] = types.ModuleType(pkg)
    sys.modules[pkg].__path__ = [path]
from mlflow.server.security_utils import get_allowed_hosts_from_env, is_allowed_host_header
hosts = get_allowed_hosts_from_env() or []
out = {"hosts_ok": [is_allowed_host_header(hosts, h) for h in ("mlflow:5000", "127.0.0.1:5000", "evil.example:5000")]}
""",
    "ray": r"""
from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, get_authentication_mode
out = {"token_mode": get_authentication_mode() == AuthenticationMode.TOKEN,
       "token": AuthenticationTokenLoader.instance().get_raw_token(ignore_auth_mode=True)}
""",
}


def test_prefect_mlflow_and_ray_read_the_names_compose_sets() -> None:
    svc = resolved()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "RAY_"))}
    for name in ("prefect-server", "mlflow", "flows"):
        env.update(env_of(svc[name]))
    env["PREFECT_HOME"] = str(REPO / "outputs" / "test_docker_prefect_home")
    env["OMP_NUM_THREADS"] = "1"
    procs = {lib: subprocess.Popen([sys.executable, "-c", code + "\nimport json; print(json.dumps(out))"], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for lib, code in _PROBES.items()}
    out = {}
    for lib, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{lib}: {stderr[-2000:]}"
        out[lib] = json.loads(stdout.strip().splitlines()[-1])
    assert out["prefect"] == {"db": env_of(svc["prefect-server"])["PREFECT_API_DATABASE_CONNECTION_URL"],
                              "api": env_of(svc["flows"])["PREFECT_API_URL"],
                              "ui_api": "http://127.0.0.1:4200/api"}
    assert out["mlflow"]["hosts_ok"] == [True, True, False]
    assert out["ray"] == {"token_mode": True, "token": SECRETS["RAY_AUTH_TOKEN"]}


# ---- exposure, health, state, secrets ------------------------------------------------------------
def test_only_the_uis_are_published_and_on_loopback_by_default() -> None:
    published: dict[str, int] = {}
    for name, svc in resolved().items():
        for spec in svc.get("ports", []):
            ip, _host_port, container_port = str(spec).split(":")
            assert ip == "127.0.0.1", f"{name} publishes {spec} beyond loopback by default"
            published[name] = int(container_port)
    assert published == UI_PORTS


def test_ui_bind_address_is_configurable() -> None:
    svc = resolved(overrides={**SECRETS, "PARITY_BIND_ADDRESS": "0.0.0.0", "DASHBOARD_HOST_PORT": "9000"})
    assert svc["dashboard"]["ports"] == ["0.0.0.0:9000:8501"]


def test_every_service_has_a_healthcheck_and_state_is_on_named_volumes() -> None:
    svc = resolved()
    for name, s in svc.items():
        assert s.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        assert s.get("restart") == "unless-stopped", name
    named = set(yaml.safe_load(COMPOSE.read_text())["volumes"])
    state = {"postgres": "/var/lib/postgresql/data", "mlflow": "/data/mlflow-artifacts", "flows": "/data/outputs"}
    for name, path in state.items():
        sources = {v.split(":")[0] for v in svc[name]["volumes"] if v.split(":")[1] == path}
        assert sources and sources <= named, f"{name}:{path} is not on a named volume"


def test_flows_stops_with_the_signal_prefects_runner_handles() -> None:
    assert resolved()["flows"]["stop_signal"] == "SIGINT"


def test_ray_worker_can_scale() -> None:
    worker = resolved()["ray-worker"]
    assert "container_name" not in worker and "ports" not in worker
    assert worker["depends_on"]["ray-head"]["condition"] == "service_healthy"


def test_secrets_have_no_default_and_are_named_when_missing() -> None:
    example = read_env_file(ENV_EXAMPLE)
    for secret in SECRETS:
        assert example[secret] == "", f".env.example must not carry a value for {secret}"
        with pytest.raises(MissingVariable, match=secret):
            resolved(overrides={k: v for k, v in SECRETS.items() if k != secret})
    # every use of a secret is a required interpolation: no default, no literal value
    text = COMPOSE.read_text()
    for secret in SECRETS:
        uses = [m for m in _VAR.finditer(text) if m["name"] == secret]
        assert uses and all(m["op"] == ":?" for m in uses), secret
        assert not re.search(rf"^\s*{secret}:\s*[^$\s]", text, re.M), f"literal {secret} in compose.yaml"


def test_env_example_documents_every_variable_with_the_compose_default() -> None:
    example = read_env_file(ENV_EXAMPLE)
    used: dict[str, str | None] = {}
    for f in (COMPOSE, COMPOSE_GPU):
        for m in _VAR.finditer(f.read_text()):
            if m["name"]:
                used[m["name"]] = m["arg"] if m["op"] in (":-", "-") else None
    missing = sorted(set(used) - set(example))
    assert not missing, f".env.example does not document {missing}"
    differ = {k: (d, example[k]) for k, d in used.items() if d is not None and example[k] != d}
    assert not differ, f"defaults differ between compose and .env.example: {differ}"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="Debian's docker-compose is not installed")
def test_docker_compose_resolves_like_this_test() -> None:
    """Cross-check of the interpolation above with the real tool (scripts/lint.sh installs it)."""
    def start(files: tuple[Path, ...], env: dict[str, str], *extra: str) -> subprocess.Popen[str]:
        args = [a for f in files for a in ("-f", str(f))]
        return subprocess.Popen(["docker-compose", "--env-file", str(ENV_EXAMPLE), *args, "config", *extra],
                                env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    variants = ((COMPOSE,), (COMPOSE, COMPOSE_GPU))
    procs = [start(files, SECRETS) for files in variants]
    missing = start((COMPOSE,), {"RAY_AUTH_TOKEN": "x"}, "-q")
    for files, proc in zip(variants, procs):
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        theirs = yaml.safe_load(stdout)["services"]
        ours = resolved(files)
        assert set(theirs) == set(ours)
        for name in ours:
            assert env_of(theirs[name]) == env_of(ours[name]), name
            assert theirs[name].get("image") == ours[name].get("image"), name
    _, stderr = missing.communicate(timeout=60)
    assert missing.returncode != 0 and "POSTGRES_PASSWORD" in stderr
