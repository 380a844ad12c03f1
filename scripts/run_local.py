"""`make run` / `make stop` on the embedded default, and the process plumbing the flow tests share.

run:  start a local Prefect server (127.0.0.1, its database under outputs/prefect), serve the
      deployments (flows/deployments.py) with the run's overrides as their `chain` default,
      `prefect deployment run train-and-eval/local` (on that default), wait for it, print the result and how
      to open the MLflow UI and the dashboard. A later `--params '{"overrides": [...]}'` changes only what it
      names: the second run is the first with one thing changed.
stop: stop what `run` started (pid files under outputs/pids), SIGTERM first, then SIGINT/SIGKILL.

Everything it starts binds 127.0.0.1, and every path it writes is under $PARITY_OUTPUTS (default outputs/)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
# the second run `make run` suggests: its own chain with one thing changed
AGAIN_PARAMS = """--params '{"overrides": ["algorithm.correction.name=tis"]}'"""


def outputs_dir() -> Path:
    return Path(os.environ.get("PARITY_OUTPUTS", REPO / "outputs")).resolve()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prefect_env(home: Path, api_url: str | None = None, piped: bool | None = None) -> dict[str, str]:
    """The environment of Prefect's server, workers and CLI. `piped`: the CLI's output goes to a pipe or a file, not
    a terminal (default: whether this process's stdout does, which a child inherits)."""
    env = dict(os.environ)
    env.update({"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db",
                "PREFECT_LOCAL_STORAGE_PATH": str(home / "storage"), "PREFECT_UI_ENABLED": "true",
                "PREFECT_SERVER_API_HOST": "127.0.0.1", "OMP_WAIT_POLICY": "PASSIVE",
                "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join(
                    [str(REPO), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])})
    if api_url:
        env["PREFECT_API_URL"] = api_url
    if piped is None:
        piped = not sys.stdout.isatty()
    if piped:
        # a pipe or a file (`make run | tee run.log`): the CLI's Rich console would break every line at 80 columns
        # (it cannot ask a pipe its width); whole lines instead, as a terminal shows them
        env.setdefault("PREFECT_CLI_WRAP_LINES", "false")
    return env


def server_env(home: Path, port: int) -> dict[str, str]:
    """The server's settings. `--port` alone moves the API but not what the UI is told: the UI asks the server
    for its API address (/ui-settings), which Prefect derives from PREFECT_UI_API_URL, else PREFECT_API_URL,
    else PREFECT_SERVER_API_HOST/PORT (port default 4200), so a server on any other port served a UI that
    could not reach it. The UI's address and the port are set to this server's own. Logs are streamed out, so
    `prefect deployment run ... --watch` prints the flow run's log (its Result line) beside its events."""
    return {**prefect_env(home), "PREFECT_SERVER_API_PORT": str(port),
            "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",
            "PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true", "PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true"}


def start_server(home: Path, port: int, log_path: Path) -> subprocess.Popen:
    home.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([str(Path(PY).parent / "prefect"), "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], env=server_env(home, port), stdout=log_path.open("ab"),
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=str(REPO))


def wait_healthy(api_url: str, proc: subprocess.Popen | None = None, timeout_s: float = 300.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"Prefect server exited with code {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"Prefect server at {api_url} not healthy after {timeout_s:.0f} s")


def start_serving(home: Path, api_url: str, log_path: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**prefect_env(home, api_url), **(extra_env or {})}
    return subprocess.Popen([PY, "-m", "flows.deployments"], env=env, stdout=log_path.open("ab"),
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=str(REPO))


def wait_deployment(api_url: str, name: str, proc: subprocess.Popen | None = None, timeout_s: float = 300.0) -> None:
    flow_name, dep = name.split("/", 1)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the serving process exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{api_url}/deployments/name/{flow_name}/{dep}", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"deployment {name} not served after {timeout_s:.0f} s")


def stop_process(pid: int, grace_s: float = 15.0) -> None:
    """The process group started for a server or a serve loop: SIGTERM, then SIGINT (a Prefect runner
    needs it), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        t0 = time.monotonic()
        while time.monotonic() - t0 < grace_s:
            try:
                os.kill(pid, 0)
                if _reaped(pid):
                    return
            except ProcessLookupError:
                return
            time.sleep(0.2)


def _reaped(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == pid
    except ChildProcessError:
        return False


def _pids_dir() -> Path:
    return outputs_dir() / "pids"


def write_pid(name: str, pid: int) -> None:
    _pids_dir().mkdir(parents=True, exist_ok=True)
    (_pids_dir() / f"{name}.pid").write_text(str(pid))


def stop_all() -> list[str]:
    stopped = []
    for f in sorted(_pids_dir().glob("*.pid")) if _pids_dir().is_dir() else []:
        try:
            pid = int(f.read_text().strip())
        except ValueError:
            f.unlink()
            continue
        stop_process(pid)
        f.unlink()
        stopped.append(f"{f.stem} (pid {pid})")
    return stopped


def run(args: argparse.Namespace) -> int:
    out = outputs_dir()
    home, logs = out / "prefect", out / "logs"
    stop_all()  # a previous `make run` that was interrupted
    port = args.port or free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    t0 = time.monotonic()
    server = start_server(home, port, logs / "prefect-server.log")
    write_pid("prefect-server", server.pid)
    print(f"[run] Prefect server on {api_url} (log {logs / 'prefect-server.log'})", flush=True)
    wait_healthy(api_url, server)
    serving = start_serving(home, api_url, logs / "serve.log",
                            extra_env={"PARITY_DEPLOYMENT_OVERRIDES": json.dumps(list(args.overrides))})
    write_pid("serve", serving.pid)
    wait_deployment(api_url, "train-and-eval/local", serving)
    print(f"[run] deployments served after {time.monotonic() - t0:.0f} s (log {logs / 'serve.log'})", flush=True)
    cmd = [str(Path(PY).parent / "prefect"), "deployment", "run", "train-and-eval/local",
           "--watch", "--watch-timeout", str(args.timeout)]
    rc = subprocess.call(cmd, env=prefect_env(home, api_url), cwd=str(REPO))
    summary = latest_summary(out)
    print(json.dumps(summary, indent=1, default=str))
    nightly = next_scheduled_run(api_url, "benchmark-regression/nightly")
    cli = f"PREFECT_API_URL={api_url} .venv/bin/prefect"
    print(f"\nflow run {'completed' if rc == 0 else 'FAILED'} in {time.monotonic() - t0:.0f} s.\n"
          f"Prefect UI:   {api_url.removesuffix('/api')}   (server and deployments keep running; `make stop` ends them)\n"
          f"Results:      {cli} artifact inspect train-and-eval-summary   (`artifact ls`: every kind; the UI's "
          f"Artifacts tab)\n"
          f"Nightly:      benchmark-regression/nightly, next scheduled run {nightly or 'not listed yet'}\n"
          f"MLflow UI:    make mlflow-ui   then open the link it prints (the runs table, on http://127.0.0.1:5000)\n"
          f"Dashboard:    make dashboard   (streamlit, reads MLflow and {out / 'registry.db'})\n"
          f"Again:        {cli} deployment run train-and-eval/local --watch {AGAIN_PARAMS}\n"
          f"              (this run with the correction alone changed, on its prepared model: the deployments' "
          f"`chain` is this run's overrides; `\"chain\": []` starts from the config's defaults instead)",
          flush=True)
    (out / "pids" / "prefect-api-url").write_text(api_url)
    return rc


def next_scheduled_run(api_url: str, name: str) -> str | None:
    """When the server's scheduler has the deployment's next run (its expected start time), else None."""
    flow_name, dep = name.split("/", 1)
    try:
        with urllib.request.urlopen(f"{api_url}/deployments/name/{flow_name}/{dep}", timeout=10) as r:
            dep_id = json.load(r)["id"]
        body = json.dumps({"flow_runs": {"deployment_id": {"any_": [dep_id]}, "state": {"type": {"any_": ["SCHEDULED"]}}},
                           "sort": "EXPECTED_START_TIME_ASC", "limit": 1}).encode()
        req = urllib.request.Request(f"{api_url}/flow_runs/filter", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            runs = json.load(r)
    except (OSError, ValueError, KeyError):
        return None
    return runs[0]["expected_start_time"] if runs else None


def latest_summary(out: Path) -> dict:
    """The last train-and-eval pipeline as the registry recorded it (stage results trimmed)."""
    from parity.tracking.registry import Registry, RegistryError
    from parity.tracking.secrets import mask_url

    url = os.environ.get("PARITY_REGISTRY_URL") or f"sqlite:///{out / 'registry.db'}"
    try:
        with Registry(url) as reg:
            p = reg.latest_pipeline("train-and-eval")
    except RegistryError as e:
        return {"error": str(e)}
    if p is None:
        return {"error": f"no train-and-eval pipeline recorded in {mask_url(url)}"}
    keep = ("run_dir", "final_accuracy", "initial_accuracy", "final_reward", "latest_checkpoint", "macro", "out_dir",
            "status", "precision", "version", "model_name", "seconds", "lib_seconds")
    for st in p["stages"]:
        st["result"] = {k: v for k, v in (st["result"] or {}).items() if k in keep}
    return p

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/run_local.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="server + deployments + one train-and-eval/local run")
    r.add_argument("--port", type=int, default=int(os.environ.get("PARITY_PREFECT_PORT", "0")))
    r.add_argument("--timeout", type=int, default=3600, help="seconds to wait for the flow run (a loaded machine is slow)")
    r.add_argument("overrides", nargs="*", help="Hydra overrides for the flow run")
    sub.add_parser("stop", help="stop what `run` started")
    args = p.parse_args(argv)
    if args.cmd == "stop":
        stopped = stop_all()
        print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
