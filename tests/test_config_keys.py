"""Typos never pass: a key the schema lacks is refused however it is written (`a.b=1`, `+a.b=1`, `++a.b=1`),
by `load_config` and by the CLI alike, in one line naming the key and the closest valid keys; the open
groups (mapping-typed schema fields) are derived from the schema and documented."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from parity.config import ConfigError, check_config, load_config, open_groups
from parity.config.keys import schema_keys

REPO = Path(__file__).resolve().parents[1]
TYPOS = ["trainer.lrr=1", "+trainer.lrr=1", "++trainer.lrr=1"]
MESSAGE = "config key `trainer.lrr`: unknown key; did you mean trainer.lr?"


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parity", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


@pytest.mark.parametrize("override", TYPOS)
def test_load_config_refuses_a_typo_however_written(override: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config([override])
    assert str(e.value) == MESSAGE


@pytest.mark.parametrize("override", TYPOS[:2])
def test_cli_refuses_a_typo_with_the_same_line(override: str) -> None:
    out = _cli("train", override)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip() == f"error: {MESSAGE}"  # one line, no traceback, Hydra's "use +..." hint gone
    assert out.stdout == ""
    # --cfg job composes without running the command: refused all the same, before Hydra prints anything
    out = _cli("train", override, "--cfg", "job")
    assert out.returncode == 2 and out.stderr.strip() == f"error: {MESSAGE}" and "trainer:" not in out.stdout


@pytest.mark.parametrize(("override", "message"), [
    ("traner.lr=1", "config key `traner.lr`: unknown key; did you mean trainer.lr?"),
    ("model.lr=1", "config key `model.lr`: unknown key; did you mean model.warm_start.lr or trainer.lr?"),
    ("modle=hf", "config key `modle`: unknown key or group; did you mean model?"),
    ("+algorithm.corection.name=tis", "config key `algorithm.corection.name`: unknown key; did you mean "
                                      "algorithm.correction.name?"),
    ("trainer.lr.x=1", "config key `trainer.lr.x`: unknown key: `trainer.lr` is a value, not a group of keys"),
])
def test_the_message_names_the_closest_keys(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config([override])
    assert str(e.value) == message


def test_no_close_key_lists_the_keys_beside_it() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(["+algorithm.correction.dual.zzz=1"])
    assert str(e.value) == ("config key `algorithm.correction.dual.zzz`: unknown key; valid under "
                            "algorithm.correction.dual: c, discrepancy, eta, lambda0, lambda_max")


def test_groups_sweeps_and_open_groups_still_pass() -> None:
    cfg = load_config(["model=tiny_qwen3_moe", "+precision=w8a8_int8", "trainer.lr=1e-4", "trainer.betas.0=0.8",
                       "eval.benchmarks.aime24.k=4", "+eval.benchmarks.amc23.limit=3"])
    assert cfg.model.arch == "qwen3_moe" and cfg.rollout.precision.weights == "int8" and cfg.trainer.betas[0] == 0.8
    assert dict(cfg.eval.benchmarks) == {"aime24": {"k": 4}, "amc23": {"limit": 3}}


def test_a_composed_config_with_an_unknown_key_is_refused() -> None:
    """The walk over a composed config (keys that came from a config file or an open_dict edit)."""
    cfg = load_config([])
    check_config(cfg)
    cfg.rollout.precision.kv_cache_typo = "int8"  # the typed config: an attribute the schema lacks
    with pytest.raises(ConfigError, match=r"^config key `rollout.precision.kv_cache_typo`: unknown key; did you mean "
                                          r"rollout.precision.kv_cache\?$"):
        check_config(cfg)
    composed = OmegaConf.structured(type(load_config([])))
    with open_dict(composed.rollout.precision):
        composed.rollout.precision.kv_cache_typo = "int8"
    with pytest.raises(ConfigError, match=r"^config key `rollout.precision.kv_cache_typo`: unknown key"):
        check_config(composed)


def test_groups_of_a_users_config_folder_are_groups(tmp_path: Path) -> None:
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\ntrainer:\n  lr: 1.0e-4\n")
    assert load_config(["experiment=mine"], extra_config_dir=str(tmp_path)).trainer.lr == 1e-4
    with pytest.raises(ConfigError, match=r"config key `mygroup`: unknown key or group"):
        load_config(["+mygroup=x"], extra_config_dir=str(tmp_path))
    (tmp_path / "mygroup").mkdir()  # a group of the user's config folder is a group, not a key
    (tmp_path / "mygroup" / "x.yaml").write_text("# @package _global_\nexperiment_name: from_mygroup\n")
    assert load_config(["+mygroup=x"], extra_config_dir=str(tmp_path)).experiment_name == "from_mygroup"


def test_valid_keys_and_open_groups_come_from_the_schema() -> None:
    from parity import algorithm_config as corrections
    from parity.config import schema

    def walk(cls: type, prefix: str) -> list[str]:
        out = []
        for f in dataclasses.fields(cls):
            out.append(prefix + f.name)
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            section = corrections.section_class(prefix + f.name)  # a correction's section: its declared keys
            if section is not None or dataclasses.is_dataclass(default):
                out += walk(section or type(default), f"{prefix}{f.name}.")
        return out

    assert set(schema_keys()) == set(walk(schema.ParityConfig, ""))
    assert "algorithm.correction.dual.lambda0" in schema_keys()
    assert "eval.benchmarks" in open_groups()
    for group in open_groups():  # each open group's default is a mapping, and the docs name it
        node = load_config([])
        for part in group.split("."):
            node = getattr(node, part)
        assert isinstance(node, dict), group
    doc = (REPO / "docs" / "CONFIGURATION.md").read_text()
    missing = [g for g in open_groups() if f"`{g}`" not in doc]
    assert not missing, f"open groups not documented in docs/CONFIGURATION.md: {missing}"


def test_plus_on_a_defaults_list_group_and_eval_preset() -> None:
    for written in ("eval=quick", "+eval=quick"):
        cfg = load_config([written])
        assert cfg.eval.limit == 8 and "aime24" in cfg.eval.suite
    assert load_config(["+experiment=arith_tiny_moe"]).model.arch == "qwen3_moe"


def test_evaluate_eval_quick_cfg_job_resolves() -> None:
    out = _cli("evaluate", "eval=quick", "--cfg", "job", "--resolve")
    assert out.returncode == 0, out.stderr
    assert "limit: 8" in out.stdout and "- olympiadbench" in out.stdout and "${" not in out.stdout
