"""Security: services on 127.0.0.1, a dashboard without a write path, names that cannot leave outputs/,
SQL as bound parameters, no eval/exec anywhere, secrets kept out of logs, MLflow params and the dashboard.
docs/RELIABILITY.md maps every case to its test."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from parity.commands.train import train

# ---------------------------------------------------------------- security: services, dashboard, paths, SQL, eval, secrets

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _listening(pids: set[int]) -> list[tuple[str, int, int]]:
    import psutil

    return sorted({(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections(kind="inet")
                   if c.status == psutil.CONN_LISTEN and c.pid in pids})


def _tree(pid: int) -> set[int]:
    import psutil

    try:
        p = psutil.Process(pid)
        return {pid} | {c.pid for c in p.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _make_recipe(target: str) -> str:
    import subprocess

    from tests.conftest import REPO

    out = subprocess.run(["make", "-n", "-s", target], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_local_services_listen_on_loopback_only(quick_cfg, tmp_path):
    """What this project starts on a machine (a local Ray, the dashboard, the MLflow UI, the Prefect server)
    listens on 127.0.0.1; the compose file publishes on PARITY_BIND_ADDRESS (tests/test_docker_compose.py)."""
    import inspect
    import os
    import shlex
    import socket
    import subprocess
    import time

    import ray

    from parity.distributed.cluster import ray_session
    from scripts import run_local
    from tests.conftest import REPO

    # a local Ray as `distributed.enabled=true` starts it, with an actor (a worker process) running
    dcfg = quick_cfg("distributed.enabled=true", "distributed.num_rollout_workers=1", "distributed.num_cpus=1").distributed
    # listeners this test process already had (servers of earlier tests in the same pytest session) are not Ray's
    before = set(_listening(_tree(os.getpid())))
    with ray_session(dcfg) as info:
        assert info["started"]

        @ray.remote(num_cpus=0)
        class Probe:
            def pid(self) -> int:
                return os.getpid()

        probe = Probe.remote()
        assert ray.get(probe.pid.remote()) in _tree(os.getpid())
        ray_socks = [x for x in _listening(_tree(os.getpid())) if x not in before]
        ray.kill(probe)
    assert len({pid for _, _, pid in ray_socks}) >= 3, ray_socks  # GCS, raylet, agents, the actor: really seen
    assert {ip for ip, _, _ in ray_socks} <= LOOPBACK, ray_socks
    assert info["address"].startswith("127.0.0.1:")

    # the dashboard, started with `make dashboard`'s own command line
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = shlex.split(_make_recipe("dashboard")) + ["--server.port", str(port)]
    assert "--server.address" in cmd and cmd[cmd.index("--server.address") + 1] == "127.0.0.1"
    env = {**os.environ, "PARITY_OUTPUTS": str(tmp_path), "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline, socks = time.monotonic() + 120, []
        while not any(p == port for _, p, _ in socks):
            assert proc.poll() is None, "the dashboard exited"
            assert time.monotonic() < deadline, "the dashboard did not listen within 120 s"
            time.sleep(0.25)
            socks = _listening(_tree(proc.pid))
        assert {ip for ip, _, _ in socks} <= LOOPBACK, socks
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)

    # the MLflow UI and the Prefect server of `make run`: their command lines bind 127.0.0.1
    ui = shlex.split(_make_recipe("mlflow-ui"))
    assert ui[ui.index("--host") + 1] == "127.0.0.1"
    src = inspect.getsource(run_local.start_server)
    assert '"--host", "127.0.0.1"' in src and run_local.prefect_env(tmp_path)["PREFECT_SERVER_API_HOST"] == "127.0.0.1"


WRITE_CALLS = {  # MLflow / registry / filesystem writes: none may appear in the dashboard's code
    "log_metric", "log_param", "log_params", "log_metrics", "log_batch", "log_artifact", "log_artifacts", "set_tag",
    "set_terminated", "create_run", "create_experiment", "delete_run", "delete_experiment", "update_run",
    "create_registered_model", "create_model_version", "transition_model_version_stage", "delete_tag",
    "start_pipeline", "finish_pipeline", "start_stage", "end_stage", "add_artifact", "add_evaluation",
    "set_baseline", "add_regression_check", "set_mlflow_model_version", "set_pipeline_mlflow_run",
    "write_text", "write_bytes", "mkdir", "unlink", "rmdir", "rmtree", "touch", "executescript", "create_all",
    "drop_all", "to_sql", "to_parquet",
}
# generic method names that write only on these receivers (sqlalchemy's insert/update/delete, os/shutil moves)
WRITE_ON = {"sa": {"insert", "update", "delete"}, "sqlalchemy": {"insert", "update", "delete"},
            "os": {"remove", "rename", "replace", "makedirs"}, "shutil": {"move", "copy", "copyfile", "copytree"}}


def _sources(*roots: str) -> list[Path]:
    from tests.conftest import REPO

    return sorted(p for r in roots for p in (REPO / r).rglob("*.py") if "__pycache__" not in p.parts)


def _writes(source: str, file: str) -> list[str]:
    """Calls and SQL in `source` that could write."""
    import ast
    import re

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in WRITE_CALLS or (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                                       and name in WRITE_ON.get(f.value.id, ())):
                found.append(f"{file}:{node.lineno} {name}()")
            if name == "open" and any(isinstance(a, ast.Constant) and isinstance(a.value, str)
                                      and set(a.value) & set("wax+") for a in node.args[1:]):
                found.append(f"{file}:{node.lineno} open(..., write mode)")
            if name == "to_csv" and (node.args or any(k.arg == "path_or_buf" for k in node.keywords)):
                found.append(f"{file}:{node.lineno} to_csv(path)")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.search(
                r"(?i)\b(insert\s+into|update\s+\w+\s+set|delete\s+from|drop\s+table|create\s+table|alter\s+table)\b",
                node.value):
            found.append(f"{file}:{node.lineno} SQL that writes")
    return found


def test_dashboard_has_no_write_path():
    """No call in dashboards/ can write: no MLflow or registry write API, no file write, no SQL that changes
    data. (Its stores are opened read-only too: tests/test_dashboard_frames.py, tests/test_dashboard_pages.py.)"""
    files = _sources("dashboards")
    assert len(files) >= 8
    assert [w for p in files for w in _writes(p.read_text(), p.name)] == []
    probe = ('c.log_metric(r, "k", 1)\nopen(p, "w")\nsa.insert(t)\nq = "DELETE FROM runs"\nos.remove(p)\n'
             'reg.add_evaluation(1)\ndf.to_csv("x.csv")\n')
    assert len(_writes(probe, "probe.py")) == 7  # the scan sees each kind of write


@pytest.mark.parametrize(("where", "overrides", "key"), [
    ("train", ["trainer.run_name=../../escaped"], "trainer.run_name"),
    ("train", ["trainer.run_name=.."], "trainer.run_name"),
    ("train", ["trainer.run_name=/tmp/escaped"], "trainer.run_name"),
    ("prepare", ["model.name=../../escaped"], "model.name"),
    ("evaluate", ["eval.run_name=../../escaped"], "eval.run_name"),
    ("evaluate", ["eval.out_dir={root}/escaped"], "eval.out_dir"),
    ("evaluate", ["eval.out_dir={outputs}/../escaped"], "eval.out_dir"),
    ("evaluate", ["eval.out_dir={outputs}/link/escaped"], "eval.out_dir"),  # a symlink inside outputs/ to outside
])
def test_user_names_and_paths_cannot_leave_outputs(quick_cfg, prepared_model, tmp_path, where, overrides, key):
    from parity.commands import evaluate as evaluate_cmd
    from parity.errors import ParityError
    from parity.training.warm_start import prepare_model

    outputs = Path(quick_cfg().outputs_dir)
    root = tmp_path / "outside"
    root.mkdir()
    link = outputs / "link"
    if not link.is_symlink():
        link.symlink_to(root, target_is_directory=True)
    over = [o.format(root=root, outputs=outputs) for o in overrides]
    if where == "evaluate":
        over += ["eval.suite=[arithmetic]", "eval.limit=2", "eval.max_new_tokens=4", "eval.grade_workers=1"]
    cfg = quick_cfg(*over)
    run = {"train": train, "prepare": prepare_model, "evaluate": evaluate_cmd.run}[where]
    with pytest.raises(ParityError, match=rf"config key `{key}`"):
        run(cfg)
    assert list(root.iterdir()) == []  # nothing written outside
    assert not (outputs.parent / "escaped").exists() and not (outputs / "runs" / "escaped").exists()


def _formatted_sql(node) -> bool:
    import ast

    if not isinstance(node, ast.Call) or not node.args:
        return False
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name not in {"execute", "executemany", "executescript", "exec_driver_sql", "text"}:
        return False
    a = node.args[0]
    return (isinstance(a, ast.JoinedStr) or (isinstance(a, ast.BinOp) and isinstance(a.op, ast.Mod | ast.Add))
            or (isinstance(a, ast.Call) and isinstance(a.func, ast.Attribute) and a.func.attr == "format"))


EVIL = "x'); DROP TABLE pipelines; -- \" OR 1=1"


def test_sql_goes_through_bound_parameters(quick_cfg, mlflow_store, tmp_path):
    import ast

    from dashboards import mlflow_sql
    from parity.config import with_values
    from parity.tracking import mlflow_log
    from parity.tracking.registry import Registry
    from tasks.recording import close_pipeline, open_pipeline, stage

    formatted = [f"{p.name}:{n.lineno}" for p in _sources("platform", "tasks", "flows", "dashboards", "scripts")
                 for n in ast.walk(ast.parse(p.read_text())) if _formatted_sql(n)]
    assert formatted == []  # no SQL text is built by formatting values into it
    assert _formatted_sql(ast.parse('c.execute(f"SELECT {x}")').body[0].value)  # the scan can see one

    uri, reg_url = mlflow_store, f"sqlite:///{tmp_path}/registry.db"
    cfg = quick_cfg(f"tracking.tracking_uri={uri}", f"tracking.registry_url={reg_url}")
    cfg = with_values(cfg, {"trainer.run_name": EVIL})
    ref = open_pipeline("train-and-eval", cfg, [f"trainer.run_name={EVIL}"])
    with stage(ref, EVIL) as st:
        st.done({"note": EVIL})
    close_pipeline(ref, ok=True)
    with Registry(reg_url) as reg:
        p = reg.pipeline(ref.pipeline_id)
        assert p["overrides"] == [f"trainer.run_name={EVIL}"] and p["status"] == "completed"
        assert p["stages"][0]["name"] == EVIL and p["stages"][0]["result"] == {"note": EVIL}
        assert reg.count("pipelines") == 1 and reg.count("stages") == 1  # every table still there
    c = mlflow_log.client(uri)
    assert c.get_run(ref.run_id).data.params["trainer.run_name"] == EVIL
    eng = mlflow_sql.engine(uri)  # the dashboard's read path reads it back literally
    runs = {r.run_name: r for r in mlflow_sql.fetch_runs(eng)}
    assert f"{ref.title} / {EVIL}" in runs and runs[ref.title].params["trainer.run_name"] == EVIL
    assert runs[ref.title].tags["parity.run_name"] == EVIL
    assert mlflow_sql.metric_history(eng, [runs[f"{ref.title} / {EVIL}"].run_id, EVIL], [EVIL, "reward/mean"]).empty


def test_no_eval_or_exec_anywhere_in_the_sources():
    """Model output is graded as mathematics (math-verify) and compared, never run: no eval/exec/compile in the
    platform, its tasks, flows, dashboards, scripts or Docker helpers (the grader's side of it is
    test_grader_attacks_score_zero_within_the_timeout_and_run_no_code)."""
    import ast

    files = _sources("platform", "tasks", "flows", "dashboards", "scripts", "docker")
    assert len(files) > 50
    found = []
    for path in files:
        for n in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(n, ast.Call):
                f = n.func
                if (isinstance(f, ast.Name) and f.id in {"eval", "exec", "compile", "__import__"}) or (
                        isinstance(f, ast.Attribute) and f.attr in {"eval", "exec"}
                        and isinstance(f.value, ast.Name) and f.value.id == "builtins"):
                    found.append(f"{path.relative_to(path.parents[len(path.parts) - 2])}:{n.lineno}")
    assert found == []


SECRET = "s3cr3t-Pa55w0rd"


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _page_bytes(at) -> bytes:
    out: list[bytes] = []

    def walk(node) -> None:
        proto = getattr(node, "proto", None)
        if proto is not None and hasattr(proto, "SerializeToString"):
            out.append(proto.SerializeToString())
        for child in (getattr(node, "children", None) or {}).values():
            walk(child)

    walk(at._tree)
    return b"".join(out)


def test_secrets_stay_out_of_logs_mlflow_params_and_the_dashboard(quick_cfg, mlflow_store, tmp_path, caplog,
                                                                  monkeypatch):
    from streamlit.testing.v1 import AppTest

    from dashboards import data
    from parity.config import flatten, to_yaml, with_values
    from parity.tracking import mlflow_log
    from parity.tracking.mlflow_log import MlflowCallback
    from parity.tracking.registry import Registry, RegistryError
    from parity.tracking.secrets import mask_url
    from tests.conftest import REPO

    port = _closed_port()
    pg = f"postgresql+psycopg://parity:{SECRET}@127.0.0.1:{port}/registry?connect_timeout=2"
    http = f"http://parity:{SECRET}@127.0.0.1:{port}"
    uri = mlflow_store  # holds the other tests' runs too: none may show a secret
    cfg = quick_cfg(f"tracking.tracking_uri={uri}")
    cfg = with_values(cfg, {"tracking.registry_url": pg})
    with caplog.at_level(logging.DEBUG):
        c = mlflow_log.client(uri)
        run_id = mlflow_log.start_run(c, mlflow_log.experiment_id(c, "secrets", mlflow_log.default_artifact_dir(uri)),
                                      "pipeline")
        mlflow_log.log_params(c, run_id, flatten(cfg))  # what open_pipeline logs
        (tmp_path / "config.yaml").write_text(mask_url(to_yaml(cfg)))
        mlflow_log.log_artifact(c, run_id, tmp_path / "config.yaml")
        mlflow_log.log_metrics(c, run_id, {"reward/mean": 0.5}, step=1)
        with pytest.raises(RegistryError) as down:
            Registry(pg)
        cb = MlflowCallback(http, run_id, retry_after_s=0.0)
        cb.on_step(1, {"reward/mean": 0.5})
        assert not cb.close(wait_s=0.0)
    assert "MLflow logging paused" in caplog.text and "parity:***@127.0.0.1" in caplog.text
    assert SECRET not in caplog.text and SECRET not in str(down.value)
    params = c.get_run(run_id).data.params
    assert params["tracking.registry_url"] == pg.replace(SECRET, "***") and SECRET not in repr(params)
    art = Path(c.download_artifacts(run_id, "config.yaml", str(tmp_path / "dl")))
    assert "parity:***@" in art.read_text() and SECRET not in art.read_text()

    # the dashboard on these stores: every element of every page, dataframes and charts included
    monkeypatch.setenv("PARITY_TRACKING_URI", uri)
    monkeypatch.setenv("PARITY_REGISTRY_URL", pg)
    monkeypatch.setenv("PARITY_OUTPUTS", str(tmp_path))
    shown = b""
    for page in [None, "compare", "benchmarks", "regression", "precision"]:
        at = AppTest.from_file(str(REPO / "dashboards" / "app.py"), default_timeout=120).run()
        if page:
            at.switch_page(f"views/{page}.py").run()
        assert not at.exception, [e.value for e in at.exception]
        blob = _page_bytes(at)
        assert SECRET.encode() not in blob, page
        shown += blob
    assert b"parity:***@127.0.0.1" in shown  # the registry URL was shown, masked
    with pytest.raises(data.SourceUnavailable) as e:
        data.mlflow_client(http)  # an MLflow server with credentials in its URL, down
    assert SECRET not in str(e.value) and "unreachable" in str(e.value)
    monkeypatch.setenv("PARITY_TRACKING_URI", http)
    assert data.load_sources().mlflow_ui == f"http://127.0.0.1:{port}"  # the UI links carry no credentials
