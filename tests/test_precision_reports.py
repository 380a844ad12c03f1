"""Validation reports are kept, one per validation, on a real `quantize` + `validate` output folder
(tests/quantized_outputs.py: the seed block's W8A8 INT8 + INT4 KV, one passing validation, then a failing one):
named by the full precision spec and the time, the latest again as validation.json beside the checkpoint's
config.json at the seed's path; the dashboard's Precision page lists both and opens nothing else in the folder
(the tokenizer's model_max_length of 1e30 once crashed it)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.quantized_outputs import CHECKPOINT
from tests.test_dashboard_pages import _app, _texts, displayed

SPEC = "wint8-aint8-kvint4_per_token_head"


def test_every_validation_is_kept_and_the_latest_stays_where_readers_look(quantized_outputs):
    from parity.config import load_config
    from parity.precision.config import load_quantization_config_file, resolve_precision
    from parity.precision.validate import validated_discrepancy

    ck = Path(quantized_outputs["checkpoint_dir"])
    assert ck == Path(quantized_outputs["outputs_dir"]) / "precision_validation" / CHECKPOINT
    info = load_quantization_config_file(ck / "config.json", expect=("int8", "int8"))
    assert info.checkpoint_dir == ck  # the seed's quantization_config_file still names the checkpoint
    passed, failed = Path(quantized_outputs["passed"]["report_json"]), Path(quantized_outputs["failed_json"])
    assert passed.parent == failed.parent == ck / "validations" and passed != failed
    for p in (passed, failed):
        assert re.fullmatch(rf"{SPEC}-\d{{8}}-\d{{6}}(-\d+)?\.json", p.name), p.name
        assert p.with_suffix(".md").is_file()
    assert sorted(ck.joinpath("validations").glob("*.json")) == sorted([passed, failed])
    first, second = json.loads(passed.read_text()), json.loads(failed.read_text())
    assert first["passed"] is True and second["passed"] is False and first["created_at"] < second["created_at"]
    assert second["failures"] and "max_mean_abs_prob_diff" in second["failures"][0]
    assert first["thresholds"]["max_mean_abs_prob_diff"] == 0.5 and second["thresholds"]["max_mean_abs_prob_diff"] == 1e-12
    assert first["precision_spec"] == second["precision_spec"] == SPEC
    # the latest, where readers (and older tools) look: the failed one; the passing one is not lost
    assert json.loads((ck / "validation.json").read_text()) == second
    assert "FAILED" in (ck / "validation.md").read_text()
    cfg = load_config(quantized_outputs["overrides"])
    value, path = validated_discrepancy(cfg, resolve_precision(cfg))
    assert path == str(failed) and value == pytest.approx(second["metrics"]["abs_prob_diff_mean"])


def test_two_validations_in_one_second_keep_two_reports(tmp_path):
    from parity.precision.validate import record_report, thresholds_of

    report = {"n_prompts": 1, "samples_per_prompt": 1, "max_new_tokens": 1, "temperature": 1.0, "quant": {},
              "metrics": {"k3_kl": 0.1}, "thresholds": thresholds_of(), "failures": [], "passed": True}
    now = datetime(2026, 12, 2, 10, 15, 30, tzinfo=UTC)
    a = record_report(report, tmp_path, "bf16-sigma0.01", now=now)
    b = record_report({**report, "passed": False}, tmp_path, "bf16-sigma0.01", now=now)
    assert a["json"].name == "bf16-sigma0.01-20261202-101530.json"
    assert b["json"].name == "bf16-sigma0.01-20261202-101530-2.json"
    assert json.loads(a["json"].read_text())["passed"] is True  # not overwritten by the second
    assert json.loads((tmp_path / "validation.json").read_text())["passed"] is False


def test_dashboard_reads_only_the_reports(quantized_outputs):
    from dashboards import data

    ck = Path(quantized_outputs["checkpoint_dir"])
    tok = json.loads((ck / "tokenizer_config.json").read_text())
    assert (ck / "tokenizer.json").is_file() and (ck / "precision.json").is_file()
    assert tok.get("model_max_length", 0) > 2**63  # what crashed the page when every *.json was read
    found, problems = data.precision_reports(quantized_outputs["outputs_dir"])
    assert problems == []
    assert [p.name for p, _ in found] == [Path(quantized_outputs["passed"]["report_json"]).name,
                                          Path(quantized_outputs["failed_json"]).name]


@pytest.mark.parametrize("page", [None, "compare", "benchmarks", "regression", "precision"])
def test_every_page_renders_after_a_quantized_run(page, quantized_outputs, monkeypatch):
    out = quantized_outputs["outputs_dir"]
    monkeypatch.setenv("PARITY_OUTPUTS", out)
    monkeypatch.setenv("PARITY_TRACKING_URI", f"sqlite:///{out}/mlflow.db")
    monkeypatch.setenv("PARITY_REGISTRY_URL", f"sqlite:///{out}/registry.db")
    at = _app(page)  # asserts no exception
    if page != "precision":
        return
    df = at.dataframe[0].value
    assert df["verdict"].tolist() == ["FAILED", "passed"]  # newest first: the failure, then the passing one kept
    assert df["latest"].tolist() == [True, False]
    assert df["precision"].tolist() == ["int8+int4kv", "int8+int4kv"] and set(df["checkpoint"]) == {CHECKPOINT}
    assert df["threshold.max_mean_abs_prob_diff"].tolist() == pytest.approx([1e-12, 0.5])
    first = json.loads(Path(quantized_outputs["passed"]["report_json"]).read_text())
    assert df.iloc[1]["k3_kl"] == pytest.approx(first["metrics"]["k3_kl"])
    assert "max_mean_abs_prob_diff" in df.iloc[0]["failures"]
    assert any("1 of 1 precisions failed their latest validation" in t for t in _texts(at.error))
    shown = displayed(at.dataframe[0])
    assert shown.iloc[0]["threshold.max_p99_abs_prob_diff"] == "—"  # a check that was off
