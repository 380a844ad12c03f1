"""Registry DB on SQLite and on a real PostgreSQL server (started and stopped here): Alembic upgrades
(empty DB, and from the previous revision), lineage, concurrent writers, atomic failures, bound
parameters, secrets kept out of errors."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from sqlalchemy import inspect, text

from parity.tracking.registry import Registry, RegistryError, migrate
from parity.tracking.registry.store import make_engine

PG_PASSWORD = "pg-s3cret-Pw"
WRITERS, ROWS_EACH = 2, 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pg_bin(name: str) -> str:
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (d / name).exists():
            return str(d / name)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"PostgreSQL's {name} not found: apt-get install -y postgresql")
    return found


@pytest.fixture(scope="module")
def postgres_url():
    """A throwaway PostgreSQL cluster on 127.0.0.1 and a free port, password auth over TCP."""
    root = Path(tempfile.mkdtemp(prefix="parity-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    (root / "pw").write_text(PG_PASSWORD + "\n")
    as_pg: list[str] = []
    if os.geteuid() == 0:  # initdb refuses to run as root
        shutil.chown(root, "postgres")
        shutil.chown(sock, "postgres")
        shutil.chown(root / "pw", "postgres")
        as_pg = ["runuser", "-u", "postgres", "--"]
    port = _free_port()
    subprocess.run([*as_pg, _pg_bin("initdb"), "-D", str(data), "-U", "postgres", "--pwfile", str(root / "pw"),
                    "--auth-host=scram-sha-256", "--auth-local=trust", "-E", "UTF8"], check=True,
                   capture_output=True)
    subprocess.run([*as_pg, _pg_bin("pg_ctl"), "-D", str(data), "-w", "-t", "60", "-l", str(root / "log"),
                    "-o", f"-p {port} -k {sock} -c listen_addresses=127.0.0.1", "start"], check=True,
                   capture_output=True)
    try:
        subprocess.run([*as_pg, "psql", "-h", str(sock), "-p", str(port), "-U", "postgres", "-c",
                        "CREATE DATABASE registry"], check=True, capture_output=True)
        yield f"postgresql+psycopg://postgres:{PG_PASSWORD}@127.0.0.1:{port}/registry"
    finally:
        subprocess.run([*as_pg, _pg_bin("pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
                       capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/registry.db"
    url = request.getfixturevalue("postgres_url")
    eng = make_engine(url)
    with eng.begin() as conn:  # each test starts from an empty database
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
    eng.dispose()
    return url


TABLES = {"pipelines", "stages", "model_artifacts", "evaluation_results", "evaluation_samples", "baselines",
          "regression_checks"}


def _tables(url: str) -> set[str]:
    eng = make_engine(url)
    try:
        return set(inspect(eng).get_table_names()) - {"alembic_version"}
    finally:
        eng.dispose()


def test_upgrade_empty_and_from_previous_revision(db_url):
    eng = make_engine(db_url)
    try:
        assert migrate.current_revision(eng) is None
        migrate.upgrade(eng, "0001")
        assert migrate.current_revision(eng) == "0001"
        assert _tables(db_url) == {"pipelines", "stages", "model_artifacts"}
        with eng.begin() as conn:  # data written under the previous revision survives the upgrade
            conn.execute(text("INSERT INTO pipelines (flow, overrides, status, started_at) "
                              "VALUES (:f, :o, :s, CURRENT_TIMESTAMP)"), {"f": "old", "o": "[]", "s": "completed"})
        migrate.upgrade(eng)
        assert migrate.current_revision(eng) == migrate.head_revision() == "0003"
        assert _tables(db_url) == TABLES
        migrate.downgrade(eng, "0001")
        assert _tables(db_url) == {"pipelines", "stages", "model_artifacts"}
    finally:
        eng.dispose()
    with Registry(db_url) as reg:  # opening upgrades to head on its own
        assert reg.count("pipelines") == 1
        assert reg.pipeline(1)["flow"] == "old"
        assert _tables(db_url) == TABLES


def test_pipeline_stages_lineage_and_evaluation(db_url):
    with Registry(db_url) as reg:
        pid = reg.start_pipeline("train-and-eval", ["trainer.lr=1e-4"], experiment="arith_tiny")
        s1 = reg.start_stage(pid, "quantize")
        reg.end_stage(s1, "completed", {"path": "/q"})
        base = reg.add_artifact("base", "/m", pipeline_id=pid)
        q = reg.add_artifact("quantized", "/q", "wint8-aint8-kvbf16", parent_id=base, pipeline_id=pid)
        v = reg.add_artifact("validated", "/q", "wint8-aint8-kvbf16", parent_id=q, validation_status="passed",
                             report={"mean_abs_prob_diff": 0.003}, report_path="/q/report.json")
        ck = reg.add_artifact("checkpoint", "/run/step_2", "wint8-aint8-kvbf16", parent_id=v, pipeline_id=pid)
        assert [a["kind"] for a in reg.lineage(ck)] == ["checkpoint", "validated", "quantized", "base"]
        assert reg.lineage(ck)[1]["report"] == {"mean_abs_prob_diff": 0.003}
        assert reg.latest_artifacts(registered_only=True) == []
        reg.set_mlflow_model_version(ck, "parity-x", "3")
        assert reg.latest_artifacts(registered_only=True)[0]["id"] == ck
        samples = [{"problem_id": f"p{i}", "sample": j, "score": float((i + j) % 2)} for i in range(5) for j in range(2)]
        rid = reg.add_evaluation("aime24", 2, 5, {"avg@k": 0.5}, samples, pipeline_id=pid, artifact_id=ck)
        assert reg.sample_scores(rid) == {f"p{i}": [float(i % 2), float((i + 1) % 2)] for i in range(5)}
        assert reg.baseline_result("aime24") is None
        reg.set_baseline("aime24", rid)
        rid2 = reg.add_evaluation("aime24", 2, 5, {"avg@k": 0.4}, samples[:4])
        reg.set_baseline("aime24", rid2)
        assert reg.baseline_result("aime24") == rid2 and reg.count("baselines") == 2
        reg.finish_pipeline(pid, "completed")
        p = reg.pipeline(pid)
        assert p["status"] == "completed" and p["stages"][0]["result"] == {"path": "/q"}


def test_failed_write_leaves_earlier_rows_and_writes_nothing_half(db_url):
    with Registry(db_url) as reg:
        pid = reg.start_pipeline("train-and-eval")
        done = reg.start_stage(pid, "prepare")
        reg.end_stage(done, "completed", {"model_dir": "/m"})
        n_samples = reg.count("evaluation_samples")
        bad = [{"problem_id": "a", "sample": 0, "score": 1.0}, {"problem_id": "b", "sample": 1}]  # no score
        with pytest.raises(KeyError):
            reg.add_evaluation("amc23", 1, 2, {}, bad, pipeline_id=pid)
        assert reg.count("evaluation_results") == 0 and reg.count("evaluation_samples") == n_samples
        with pytest.raises(RegistryError, match="add_artifact failed"):  # foreign key to a missing parent
            reg.add_artifact("quantized", "/q", parent_id=10_000, pipeline_id=pid)
        assert reg.count("model_artifacts") == 0
        assert reg.pipeline(pid)["stages"][0]["status"] == "completed"


def test_values_are_bound_parameters(db_url):
    evil = "x'); DROP TABLE pipelines; --"
    with Registry(db_url) as reg:
        pid = reg.start_pipeline(evil, [evil], experiment=evil)
        assert reg.pipeline(pid)["flow"] == evil and reg.pipeline(pid)["overrides"] == [evil]
        assert "pipelines" in _tables(db_url)


def _writer(url: str, wid: int, n: int) -> None:
    with Registry(url, upgrade=False) as reg:
        pid = reg.start_pipeline(f"writer-{wid}")
        for i in range(n):
            reg.end_stage(reg.start_stage(pid, f"s{i}"), "completed", {"w": wid, "i": i})


def test_concurrent_writers_lose_no_rows(db_url):
    Registry(db_url).close()  # schema first; the writers only write
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(db_url, w, ROWS_EACH)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    with Registry(db_url) as reg:
        assert reg.count("pipelines") == WRITERS
        assert reg.count("stages") == WRITERS * ROWS_EACH
        for pid in range(1, WRITERS + 1):
            stages = reg.pipeline(pid)["stages"]
            assert sorted(s["result"]["i"] for s in stages) == list(range(ROWS_EACH))
            assert all(s["status"] == "completed" for s in stages)


def test_unreachable_database_names_url_without_password(postgres_url):
    port = _free_port()
    url = f"postgresql+psycopg://parity:{PG_PASSWORD}@127.0.0.1:{port}/registry?connect_timeout=2"
    t0 = time.monotonic()
    with pytest.raises(RegistryError) as e:
        Registry(url)
    assert f"127.0.0.1:{port}" in str(e.value) and PG_PASSWORD not in str(e.value)
    assert time.monotonic() - t0 < 30
    wrong = postgres_url.replace(PG_PASSWORD, "wrong-Pw-123")
    with pytest.raises(RegistryError) as e:
        Registry(wrong)
    assert "wrong-Pw-123" not in str(e.value) and "password" in str(e.value).lower()


def test_bad_url_is_named():
    with pytest.raises(RegistryError, match="tracking.registry_url"):
        Registry("not a url")
