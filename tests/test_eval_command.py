"""`python -m parity evaluate`: model selection (checkpoint, run's latest checkpoint), the preset, the
summary it prints, and clear errors for a bad model path or run name."""

import json
from pathlib import Path

import pytest

from parity.config.schema import TinyModelConfig
from parity.errors import ParityError

SMALL = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16)


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """outputs/runs/r1 with checkpoints at steps 1 and 2 of a (random) tiny model."""
    from parity.models.tiny import build_tiny_model
    from parity.models.tokenizer import build_char_tokenizer
    from parity.training.checkpoint import CheckpointManager

    outputs = tmp_path_factory.mktemp("outputs")
    model, tok = build_tiny_model("qwen3", SMALL), build_char_tokenizer()
    mgr = CheckpointManager(outputs / "runs" / "r1", keep=3)
    mgr.save(1, model, tok, {"step": 1})
    mgr.save(2, model, tok, {"step": 2})
    return outputs


def _cfg(outputs: Path, *overrides: str):
    from parity.config import load_config

    return load_config([f"outputs_dir={outputs}", "+eval=quick", "eval.limit=2", "++eval.benchmarks.arithmetic.limit=4",
                        "eval.max_new_tokens=6", "eval.grade_workers=1", *overrides])


def test_model_selection(run_folder):
    from tests.helpers import resolve_eval_model

    ckpt = run_folder / "runs" / "r1" / "checkpoints"
    assert resolve_eval_model(_cfg(run_folder, "eval.run_name=r1")) == (ckpt / "step_000002", "eval.run_name")
    assert resolve_eval_model(_cfg(run_folder, f"eval.model_path={ckpt / 'step_000001'}"))[0] == ckpt / "step_000001"
    assert resolve_eval_model(_cfg(run_folder, f"eval.model_path={run_folder / 'runs' / 'r1'}"))[0] == ckpt / "step_000002"


@pytest.mark.parametrize(("override", "match"), [
    ("eval.model_path=/nonexistent/model", r"`eval.model_path`: /nonexistent/model is neither a checkpoint"),
    ("eval.run_name=nope", r"`eval.run_name`: no training run at .*runs/nope"),
    ("eval.run_name=../x", r"`eval.run_name`: '../x' is not a valid run name"),
])
def test_bad_model_selection_names_the_key(run_folder, override, match):
    from tests.helpers import resolve_eval_model

    with pytest.raises(ParityError, match=match):
        resolve_eval_model(_cfg(run_folder, override))


def test_corrupt_latest_checkpoint_falls_back(tmp_path):
    from parity.models.tiny import build_tiny_model
    from parity.models.tokenizer import build_char_tokenizer
    from parity.training.checkpoint import CheckpointManager
    from tests.helpers import resolve_eval_model

    mgr = CheckpointManager(tmp_path / "runs" / "r2", keep=3)
    model, tok = build_tiny_model("qwen3", SMALL), build_char_tokenizer()
    mgr.save(1, model, tok, {})
    last = mgr.save(2, model, tok, {})
    (last / "model.safetensors").write_bytes(b"corrupt")
    assert resolve_eval_model(_cfg(tmp_path, "eval.run_name=r2"))[0] == mgr.path(1)
    (mgr.path(1) / "MANIFEST.json").unlink()
    with pytest.raises(ParityError, match="has no valid checkpoint"):
        resolve_eval_model(_cfg(tmp_path, "eval.run_name=r2"))


def test_run_name_latest_picks_the_newest_run(tmp_path):
    import os

    from parity.models.tiny import build_tiny_model
    from parity.models.tokenizer import build_char_tokenizer
    from parity.training.checkpoint import CheckpointManager
    from tests.helpers import resolve_eval_model

    model, tok = build_tiny_model("qwen3", SMALL), build_char_tokenizer()
    old, new = CheckpointManager(tmp_path / "runs" / "b_old", keep=3), CheckpointManager(tmp_path / "runs" / "a_new")
    old.save(5, model, tok, {})
    new.save(1, model, tok, {})
    os.utime(old.path(5), (1_000_000, 1_000_000))  # written long ago; the name sorts after the newer run's
    (tmp_path / "runs" / "no_checkpoints").mkdir()
    assert resolve_eval_model(_cfg(tmp_path, "eval.run_name=latest")) == (
        new.path(1), "eval.run_name=latest (run a_new)")
    (new.path(1) / "MANIFEST.json").unlink()  # the newest run has no valid checkpoint left: the next newest
    assert resolve_eval_model(_cfg(tmp_path, "eval.run_name=latest"))[0] == old.path(5)
    with pytest.raises(ParityError, match=r"`eval.run_name`: `latest` found no training run with a valid checkpoint"):
        resolve_eval_model(_cfg(tmp_path / "empty", "eval.run_name=latest"))


def test_evaluate_without_a_model_says_it_evaluates_the_prepared_default(quick_cfg, prepared_model, outputs_dir,
                                                                          capsys):
    from parity.__main__ import main
    from tests.conftest import QUICK

    main(["evaluate", f"outputs_dir={outputs_dir}", *QUICK, "eval.suite=[arithmetic]", "eval.limit=4",
          "eval.max_new_tokens=6", f"eval.out_dir={outputs_dir / 'eval' / 'default-model'}"])
    captured = capsys.readouterr()
    assert (f"evaluate: no eval.model_path, eval.run_name or eval.registered_model given: evaluating the prepared "
            f"default model {prepared_model}") in captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["model"] == str(prepared_model) and summary["model_from"] == "prepared default"


def test_evaluate_command_end_to_end(run_folder, capsys):
    """The CLI dispatcher (in-process, as `python -m parity evaluate ...` runs it): the last stdout line
    is the JSON summary, and every benchmark of the quick preset is in it."""
    from parity.__main__ import main

    out = run_folder / "eval" / "end-to-end"  # inside outputs_dir: eval.out_dir may not leave it
    main(["evaluate", f"outputs_dir={run_folder}", "eval=quick", "eval.limit=2",
          "eval.benchmarks.arithmetic.limit=4", "eval.benchmarks.aime24.k=3", "eval.max_new_tokens=6",
          "eval.grade_workers=1", "eval.run_name=r1", f"eval.out_dir={out}"])
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["command"] == "evaluate" and summary["model"].endswith("step_000002")
    assert f"evaluate: model {summary['model']} (from eval.run_name)" in captured.err
    names = ["arithmetic", "aime24", "aime25", "amc23", "math500", "minerva_math", "olympiadbench"]
    assert list(summary["benchmarks"]) == names
    assert summary["benchmarks"]["aime24"]["k"] == 3 and summary["benchmarks"]["arithmetic"]["problems"] == 4
    assert set(summary["macro"]) == {"avg@k", "pass@1", "pass@k", "maj@k"}
    lines = (out / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 4 + 2 * 3 + 5 * 2
    assert (out / "table.md").is_file() and "| macro average |" in captured.err
    assert summary["benchmarks"]["olympiadbench"]["prompts_truncated"] >= 1  # long prompts vs 256 positions


def test_evaluate_command_bad_key_exits_with_the_key(run_folder, capsys):
    from parity.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["evaluate", f"outputs_dir={run_folder}", "eval.model_path=/nonexistent/m"])
    assert e.value.code == 2
    assert "`eval.model_path`" in capsys.readouterr().err


def test_registered_model_spec_and_no_store_creates_nothing(tmp_path):
    """NAME / NAME:latest / NAME:VERSION; with neither a registry DB nor an MLflow store the error names the
    key and both places, and neither file is created by asking."""
    from parity.commands.evaluate import resolve_eval_model_info
    from parity.tracking.registered import parse_spec

    assert parse_spec("parity-arith_tiny") == ("parity-arith_tiny", None)
    assert parse_spec("m:latest") == ("m", None) and parse_spec("m:12") == ("m", 12)
    for bad, match in [(":3", "has no model name"), ("m:0", "version '0'"), ("m:v2", "version 'v2'")]:
        with pytest.raises(ParityError, match=rf"config key `eval.registered_model`: .*{match}"):
            parse_spec(bad)
    with pytest.raises(ParityError, match=r"`eval.registered_model`: no registered model named 'm' in the registry "
                                          r"database .* \(no registry database at .*registry.db\) or the MLflow model "
                                          r"registry .* \(no MLflow store at .*mlflow.db\); nothing is registered yet"):
        resolve_eval_model_info(_cfg(tmp_path, "eval.registered_model=m:2"))
    assert not (tmp_path / "registry.db").exists() and not (tmp_path / "mlflow.db").exists()
