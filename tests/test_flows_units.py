"""The flows' small decisions without a server: run names, sweep members, retry policy, sample files."""

from __future__ import annotations

import json

import pytest

from flows.sweep import member_overrides
from flows.train_and_eval import compose
from parity.errors import ParityError
from tasks.records import read_samples
from tasks.stages import ValidationFailed, _transient


class _State:
    def __init__(self, exc: BaseException | None) -> None:
        self.exc = exc

    def result(self):
        if self.exc is not None:
            raise self.exc
        return 1


def test_compose_gives_each_pipeline_its_own_run_name(tmp_path):
    a = compose([f"outputs_dir={tmp_path}"])
    b = compose([f"outputs_dir={tmp_path}"])
    assert a.trainer.run_name.startswith("arith_tiny-") and a.trainer.run_name != b.trainer.run_name
    assert compose([f"outputs_dir={tmp_path}", "trainer.run_name=mine"]).trainer.run_name == "mine"


def test_sweep_members_one_per_correction():
    m = member_overrides(["none", "score_centering+tis"], ["trainer.total_steps=3"], "S")
    assert m == [["trainer.total_steps=3", "algorithm.correction.name=none", "trainer.run_name=sweep-S-none"],
                 ["trainer.total_steps=3", "algorithm.correction.name=score_centering+tis",
                  "trainer.run_name=sweep-S-score_centering_tis"]]
    seeded = member_overrides(["none", "tis"], [], "S", seeds=[0, 1])
    assert [m[-2:] for m in seeded] == [
        ["trainer.seed=0", "trainer.run_name=sweep-S-none-s0"], ["trainer.seed=1", "trainer.run_name=sweep-S-none-s1"],
        ["trainer.seed=0", "trainer.run_name=sweep-S-tis-s0"], ["trainer.seed=1", "trainer.run_name=sweep-S-tis-s1"]]
    assert [m[0] for m in seeded] == ["algorithm.correction.name=none"] * 2 + ["algorithm.correction.name=tis"] * 2


def test_deployments_keep_the_chain_apart_from_the_overrides():
    """A sweep member is the served chain, then the sweep's overrides, then its correction: the chain's own
    correction is overridden (Hydra: the last value of a key wins) and nothing else of it is lost."""
    from flows.deployments import chain_from_env
    from flows.sweep import sweep_members
    from parity.config import flatten, load_config
    from tests.prefect_services import make_run_chain

    chain = [*make_run_chain(), "trainer.total_steps=40"]  # the Makefile's, score centering among it
    (member,) = sweep_members(["tis"], chain, ["trainer.lr=1e-5"], None, [], "S")
    assert member == [*chain, "trainer.lr=1e-5", "algorithm.correction.name=tis", "trainer.run_name=sweep-S-tis"]
    a, b = flatten(load_config(chain)), flatten(load_config(member))
    assert {k for k in a if a[k] != b[k]} == {"algorithm.correction.name", "trainer.lr", "trainer.run_name"}
    assert b["rollout.precision.kv_cache"] == "int4_per_token_head" and b["trainer.total_steps"] == 40
    assert sweep_members(None, chain, ["ignored=1"], [["a=1"], ["b=2"]], [], "S") == [[*chain, "a=1"], [*chain, "b=2"]]
    with pytest.raises(ValueError, match="give `corrections`"):
        sweep_members([], chain, [], None, [], "S")

    # PARITY_DEPLOYMENT_OVERRIDES: what `make run` writes (JSON), or overrides separated by spaces (docker/.env)
    assert chain_from_env(json.dumps(["a=1 2", "b=3"])) == ["a=1 2", "b=3"]
    assert chain_from_env(" model=hf  model.path=Qwen/Qwen3-8B ") == ["model=hf", "model.path=Qwen/Qwen3-8B"]
    assert chain_from_env(None) == chain_from_env("") == []
    for bad in ('["a=1", 2]', "[a=1"):
        with pytest.raises(ValueError, match="PARITY_DEPLOYMENT_OVERRIDES: not a JSON list of strings"):
            chain_from_env(bad)


def test_sweep_prints_the_compare_page_of_its_members(monkeypatch):
    from flows.sweep import dashboard_compare_url

    assert dashboard_compare_url("sweep-20261201-101500") == "http://127.0.0.1:8501/compare?sweep=sweep-20261201-101500"
    monkeypatch.setenv("PARITY_DASHBOARD_URL", "https://dash.example/parity/")
    assert dashboard_compare_url("s 1") == "https://dash.example/parity/compare?sweep=s+1"


@pytest.mark.parametrize("exc, retry", [(ConnectionError("db down"), True), (RuntimeError("worker died"), True),
                                        (ParityError("config key `trainer.lr`"), False),
                                        (ValidationFailed("k3 too high"), False), (ValueError("bad"), False),
                                        (None, False)])
def test_only_transient_failures_are_retried(exc, retry):
    assert _transient(None, None, _State(exc)) is retry


def test_read_samples_groups_by_benchmark_and_names_bad_row(tmp_path):
    p = tmp_path / "samples.jsonl"
    rows = [{"benchmark": "aime24", "problem_id": "1", "sample": 0, "score": 1.0, "extracted": "3"},
            {"benchmark": "amc23", "problem_id": "7", "sample": 0, "score": 0.0}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    got = read_samples(p)
    assert sorted(got) == ["aime24", "amc23"] and got["aime24"][0]["extracted"] == "3"
    p.write_text(json.dumps(rows[0]) + "\n" + '{"benchmark": "amc23"}\n')
    with pytest.raises(ValueError, match="row 2"):
        read_samples(p)


def test_as_config_is_typed_and_each_caller_gets_its_own_copy(tmp_path):
    """The typed config of a task's plain dict is built once per content; callers may modify theirs."""
    from parity.config import ConfigError, ParityConfig, with_values
    from tasks.recording import as_config, plain

    d = plain(compose([f"outputs_dir={tmp_path}", "trainer.total_steps=3"]))
    a, b = as_config(d), as_config(d)
    assert isinstance(a, ParityConfig) and isinstance(a.trainer.total_steps, int)
    a.eval.model_path = "/x"
    a.trainer.total_steps = 9
    assert b.eval.model_path is None and b.trainer.total_steps == 3 and as_config(d).trainer.total_steps == 3
    with pytest.raises(ConfigError, match="trainer.total_steps"):
        with_values(b, {"trainer.total_steps": "many"})
    with pytest.raises(ConfigError, match="trainer.no_such_key"):
        with_values(b, {"trainer.no_such_key": 1})
    with pytest.raises(ConfigError, match="trainer.total_steps"):
        as_config({**d, "trainer": {**d["trainer"], "total_steps": "many"}})
    assert as_config({**d, "trainer": {**d["trainer"], "total_steps": 4}}).trainer.total_steps == 4
