"""`python -m parity train` without a flow (the CLI dispatcher in-process, as the command runs it):
tracking.enabled=true logs one MLflow run (flattened resolved config as params, every step's metrics,
config and run files as artifacts) to a real SQLite-backed MLflow store; disabled writes nothing there;
a run that fails is marked FAILED with the reason; an unreachable store is refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import QUICK


def _main(capsys, *args: str) -> dict:
    from parity.__main__ import main

    capsys.readouterr()
    main(list(args))
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _args(outputs_dir: Path, store: Path, *extra: str) -> list[str]:
    return ["train", f"outputs_dir={outputs_dir}", *QUICK, f"tracking.tracking_uri=sqlite:///{store}", *extra]


def test_enabled_logs_params_step_metrics_and_artifacts(outputs_dir, prepared_model, tmp_path, capsys):
    from parity.config import flatten, load_config
    from parity.tracking import mlflow_log

    store = tmp_path / "mlflow.db"
    args = _args(outputs_dir, store, "trainer.run_name=tracked", "tracking.enabled=true",
                 "tracking.experiment=plain-train")
    out = _main(capsys, *args)
    c = mlflow_log.client(f"sqlite:///{store}")
    run = c.get_run(out["mlflow_run_id"])
    # named like a pipeline's train stage, by what it ran; trainer.run_name and the facts as tags
    assert run.info.status == "FINISHED" and run.info.run_name == "arith_tiny / bf16 / none / seed 0 / train"
    exp = c.get_experiment(run.info.experiment_id)
    assert exp.name == "plain-train" and exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert run.data.tags["parity.command"] == "train" and run.data.tags["parity.run_name"] == "tracked"
    assert (run.data.tags["parity.correction"], run.data.tags["parity.precision"], run.data.tags["parity.seed"]) == \
        ("none", "bf16", "0")
    assert run.data.tags["parity.run_dir"] == str(Path(out["run_dir"]).resolve())

    # params: exactly the flattened resolved config of the same overrides, as MLflow stores them
    cfg = load_config(args[1:])
    expected = {p.key: p.value for p in mlflow_log.param_entities(flatten(cfg))}
    assert run.data.params == expected and len(expected) > 100
    assert run.data.params["trainer.total_steps"] == "2" and run.data.params["tracking.enabled"] == "True"

    # per-step metrics: every value of metrics.jsonl, at its step, once
    rows = [json.loads(x) for x in (Path(out["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("reward/mean", "mismatch/k3_kl", "perf/step_s", "train/loss"):
        hist = c.get_metric_history(run.info.run_id, key)
        assert [(m.step, m.value) for m in hist] == [(r["step"], pytest.approx(r[key])) for r in rows if key in r]
    assert [m.step for m in c.get_metric_history(run.info.run_id, "eval/accuracy")] == [0]
    assert out["mlflow_unwritten_metrics"] == 0
    # the headline numbers of the run (what MLflow's runs table shows as columns)
    summary = json.loads((Path(out["run_dir"]) / "summary.json").read_text())
    assert run.data.metrics["final_reward"] == pytest.approx(rows[-1]["reward/mean"])
    assert run.data.metrics["heldout_accuracy"] == pytest.approx(summary["final_accuracy"])
    assert ("collapsed" in run.data.metrics) == ("collapse_step" in summary)

    assert {a.path for a in c.list_artifacts(run.info.run_id)} == {"config.yaml", "run"}
    assert {a.path for a in c.list_artifacts(run.info.run_id, "run")} == {"run/metrics.jsonl", "run/summary.json"}

    # the same run name again (no resume): refused by training; the MLflow run says FAILED and why
    with pytest.raises(SystemExit) as e:
        _main(capsys, *args)
    assert e.value.code == 2
    runs = c.search_runs([run.info.experiment_id], "attributes.status = 'FAILED'")
    assert len(runs) == 1 and runs[0].data.tags["parity.run_name"] == "tracked"
    assert "already has checkpoints" in runs[0].data.tags["parity.failure"]


def test_experiment_defaults_to_the_experiment_name(outputs_dir, tmp_path, capsys):
    """Without tracking.experiment, runs land in one MLflow experiment per experiment_name; an experiment of an
    older store that lacks the kind tag gets it, one a user set is left alone."""
    from parity.config import load_config
    from parity.tracking import mlflow_log

    cfg = load_config([f"outputs_dir={outputs_dir}"])
    assert cfg.tracking.experiment == cfg.experiment_name == "arith_tiny"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    c = mlflow_log.client(uri)
    old = c.create_experiment("old-store")
    mine = c.create_experiment("mine", tags={"mlflow.experimentKind": "genai_development"})
    assert mlflow_log.experiment_id(c, "old-store") == old and mlflow_log.experiment_id(c, "mine") == mine
    assert c.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"
    assert c.get_experiment(mine).tags["mlflow.experimentKind"] == "genai_development"


def test_disabled_writes_nothing(outputs_dir, prepared_model, tmp_path, capsys):
    store = tmp_path / "store" / "mlflow.db"
    out = _main(capsys, *_args(outputs_dir, store, "trainer.run_name=untracked"))
    assert out["steps"] == 2 and "mlflow_run_id" not in out
    assert not (tmp_path / "store").exists()  # no store, no mlartifacts/


def test_unreachable_store_is_refused_naming_the_key(outputs_dir, capsys):
    from parity.__main__ import main
    from scripts.run_local import free_port

    with pytest.raises(SystemExit) as e:
        main(["train", f"outputs_dir={outputs_dir}", *QUICK, "trainer.run_name=nostore", "tracking.enabled=true",
              f"tracking.tracking_uri=http://127.0.0.1:{free_port()}"])
    assert e.value.code == 2
    assert "config key `tracking.tracking_uri`" in capsys.readouterr().err
    assert not (outputs_dir / "runs" / "nostore").exists()  # refused before training started


def test_step_metrics_reach_the_store_while_the_run_is_running(outputs_dir, prepared_model, tmp_path):
    """Batched every tracking.flush_every_s, yet never more than about that far behind: at step 2 the training
    stops for a while (as a long held-out evaluation would), and step 2's metrics reach the store before the run
    goes on, with no further step to carry them; the run is still RUNNING then."""
    import time

    from parity.commands.train import train
    from parity.config import load_config
    from parity.tracking import mlflow_log
    from parity.tracking.train_run import tracked_train

    # longer than a quick step takes, so step 2 arrives before it is due and has to be written by the flusher
    uri, flush_every_s = f"sqlite:///{tmp_path}/mlflow.db", 8.0
    cfg = load_config([f"outputs_dir={outputs_dir}", *QUICK, f"model.path={prepared_model}", "trainer.total_steps=3",
                       "trainer.run_name=streamed", "tracking.enabled=true", f"tracking.tracking_uri={uri}",
                       f"tracking.flush_every_s={flush_every_s}"])
    reader = mlflow_log.client(uri)
    seen: dict = {}

    class Probe:  # runs after the MLflow callback, in the training loop
        run_id = None

        def on_step(self, step, metrics):
            if step != 2:
                return
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3 * flush_every_s:
                steps = [m.step for m in reader.get_metric_history(self.run_id, "reward/mean")]
                if 2 in steps:
                    break
                time.sleep(0.2)
            seen.update(steps=steps, lag_s=time.monotonic() - t0, status=reader.get_run(self.run_id).info.status)

    probe = Probe()

    def train_fn(c, callbacks):
        probe.run_id = callbacks[0].run_id
        return train(c, callbacks=[*callbacks, probe])

    out = tracked_train(cfg, train_fn)
    assert seen["status"] == "RUNNING" and seen["steps"] == [1, 2], seen
    assert seen["lag_s"] <= flush_every_s + 3.0, seen  # written by the flusher once due, not at the run's end
    assert [m.step for m in reader.get_metric_history(out["mlflow_run_id"], "reward/mean")] == [1, 2, 3]
    assert out["mlflow_unwritten_metrics"] == 0
