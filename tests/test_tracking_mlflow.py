"""MLflow logging: secrets never reach params, the per-step callback buffers while the tracking server
is down and writes everything, once each, when it is back (a real MLflow server app on 127.0.0.1,
stopped and restarted by the test)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from parity.tracking import mlflow_log
from parity.tracking.mlflow_log import MlflowCallback, metric_key
from parity.tracking.secrets import MASK, mask_params, mask_url

SECRET = "hunter2-Token"


def test_mask_url_and_params():
    assert mask_url(f"postgresql+psycopg://parity:{SECRET}@db:5432/reg") == "postgresql+psycopg://parity:***@db:5432/reg"
    assert mask_url(f"https://user:{SECRET}@mlflow.example/api?token={SECRET}&x=1") == \
        "https://user:***@mlflow.example/api?token=***&x=1"
    assert mask_url("sqlite:///outputs/registry.db") == "sqlite:///outputs/registry.db"
    params = {"tracking.registry_url": f"postgresql://u:{SECRET}@h/db", "tracking.api_token": SECRET,
              "model.password": SECRET, "trainer.lr": 1e-4, "data.path": "/data/x.jsonl"}
    masked = mask_params(params)
    assert SECRET not in repr(masked)
    assert masked["tracking.api_token"] == MASK and masked["model.password"] == MASK
    assert masked["trainer.lr"] == 1e-4 and masked["data.path"] == "/data/x.jsonl"


def test_metric_key_is_accepted_by_mlflow():
    assert metric_key("eval/aime24/avg@k") == "eval/aime24/avg_at_k"
    assert metric_key("mismatch/k3 kl") == "mismatch/k3 kl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MlflowServer:
    """MLflow's tracking server app in a thread: stoppable and restartable on the same port."""

    def __init__(self, store_uri: str, artifact_root: str) -> None:
        os.environ["_MLFLOW_SERVER_FILE_STORE"] = store_uri
        os.environ["_MLFLOW_SERVER_ARTIFACT_ROOT"] = artifact_root
        from mlflow.server import app

        self.app = app
        self.port = _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.server = None

    def start(self) -> None:
        from werkzeug.serving import make_server

        self.server = make_server("127.0.0.1", self.port, self.app, threaded=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("mlflow")
    s = MlflowServer(f"sqlite:///{d}/mlflow.db", str(d / "artifacts"))
    with pytest.MonkeyPatch.context() as mp:
        # MLflow's own request timeout (120 s): the server answers from a thread of this busy process, and the
        # dashboard's 10 s (dashboards/data.py sets it process-wide when an earlier test imports it) ran out on a
        # loaded 2-core machine
        mp.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
        s.start()
        yield s
        s.stop()


def test_params_through_a_real_store_are_masked(server):
    c = mlflow_log.client(server.uri)
    exp = mlflow_log.experiment_id(c, "masking")
    run_id = mlflow_log.start_run(c, exp, "p")
    mlflow_log.log_params(c, run_id, {f"k{i}": i for i in range(150)} |
                          {"tracking.registry_url": f"postgresql+psycopg://u:{SECRET}@h/db", "x.token": SECRET})
    params = c.get_run(run_id).data.params
    assert len(params) == 152 and params["k149"] == "149"
    assert SECRET not in repr(params) and params["x.token"] == MASK


def test_callback_buffers_while_store_is_down_and_flushes_once(server):
    c = mlflow_log.client(server.uri)
    run_id = mlflow_log.start_run(c, mlflow_log.experiment_id(c, "outage"), "train")
    cb = MlflowCallback(server.uri, run_id, retry_after_s=0.0)
    cb.on_step(0, {"eval/accuracy": 0.25})
    assert cb.buffer == [] and cb.written == 1
    server.stop()
    try:
        for step in range(1, 6):  # "training" goes on; each step returns at once
            t0 = time.monotonic()
            cb.on_step(step, {"reward/mean": step / 10, "mismatch/k3": 1e-3 * step})
            assert time.monotonic() - t0 < 3.0
        assert len(cb.buffer) == 10 and cb.outages == 1
        assert not cb.close(wait_s=0.0)
    finally:
        server.start()
    cb.on_step(6, {"reward/mean": 0.6, "mismatch/k3": 6e-3})
    assert cb.buffer == [] and cb.written == 13 and cb.outages == 1
    hist = c.get_metric_history(run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in hist) == [(s, pytest.approx(s / 10)) for s in range(1, 7)]
    assert [m.step for m in c.get_metric_history(run_id, "eval/accuracy")] == [0]
    assert cb.close(wait_s=0.0)


def test_register_model_version_tags(server, tmp_path):
    c = mlflow_log.client(server.uri)
    run_id = mlflow_log.start_run(c, mlflow_log.experiment_id(c, "register"), "register")
    (tmp_path / "config.json").write_text("{}")
    v1 = mlflow_log.register_model(c, run_id, tmp_path, "tiny-test", {"precision": "wint8-aint8-kvbf16",
                                                                       "validation_status": "passed"})
    v2 = mlflow_log.register_model(c, run_id, tmp_path, "tiny-test", {"precision": "bf16",
                                                                       "validation_status": "not_required"})
    assert (v1, v2) == ("1", "2")
    mv = c.get_model_version("tiny-test", "1")
    assert mv.tags["precision"] == "wint8-aint8-kvbf16" and mv.tags["validation_status"] == "passed"
    assert [a.path for a in c.list_artifacts(run_id, "model")] == ["model/config.json"]


def test_candidate_and_champion_aliases(server, tmp_path):
    """Each registered version becomes the candidate (MLflow's own model-registry alias); the first one is the
    champion too, and a later version does not move it."""
    c = mlflow_log.client(server.uri)
    run_id = mlflow_log.start_run(c, mlflow_log.experiment_id(c, "aliases"), "register")
    (tmp_path / "config.json").write_text("{}")
    assert mlflow_log.alias_version(c, "alias-test", "champion") is None  # no such model yet
    v1 = mlflow_log.register_model(c, run_id, tmp_path, "alias-test", {})
    assert mlflow_log.set_candidate(c, "alias-test", v1) == {"candidate": "1", "champion": "1"}
    v2 = mlflow_log.register_model(c, run_id, tmp_path, "alias-test", {})
    assert mlflow_log.set_candidate(c, "alias-test", v2) == {"candidate": "2", "champion": "1"}
    assert str(c.get_model_version_by_alias("alias-test", "candidate").version) == "2"  # an int or a str by store
    assert mlflow_log.alias_version(c, "alias-test", "champion") == "1"


def test_two_runs_of_one_configuration_get_two_names(server):
    from parity.tracking import naming

    c = mlflow_log.client(server.uri)
    exp = mlflow_log.experiment_id(c, "names")
    name = "arith_tiny / int8+int4kv / none / seed 0"
    assert naming.unique_run_name(c, exp, name) == name
    mlflow_log.start_run(c, exp, name)
    assert naming.unique_run_name(c, exp, name) == f"{name} #2"
    mlflow_log.start_run(c, exp, f"{name} #2")
    mlflow_log.start_run(c, exp, f"{name} / train")  # a stage of the first: not a name of this run
    assert naming.unique_run_name(c, exp, name) == f"{name} #3"
    assert naming.unique_run_name(c, exp, "arith_tiny / bf16 / none / seed 0") == "arith_tiny / bf16 / none / seed 0"
