"""The config asks the registries: the correction sections are the declared ones (parity.algorithm_config, which
the correction registry agrees with; a typo or a wrong type in any fails at load naming the key, without torch),
validation knows the policy losses, aggregation modes and advantage estimators from their registries, and the keys
that did nothing are gone."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from parity import algorithm_config as corrections
from parity.algorithms import (
    ADV_ESTIMATORS,
    AGGREGATIONS,
    CORRECTIONS,
    POLICY_LOSSES,
    build_corrections,
    get_policy_loss,
)
from parity.config import ConfigError, load_config
from parity.config.schema import CorrectionConfig

REPO = Path(__file__).resolve().parents[1]


def _compose_error(*overrides: str) -> str:
    with pytest.raises((ConfigCompositionException, ConfigError)) as e:  # an unknown key, or a wrong type
        load_config(list(overrides))
    return f"{e.value} {e.value.__cause__}"


def test_the_declarations_are_the_registered_sections() -> None:
    """Each built-in correction's section is declared without torch (parity.algorithm_config) as its registration
    names it; the schema holds each as a plain mapping, which loading fills and converts through the dataclass."""
    cfg = load_config([])
    builtin = {n: CORRECTIONS.get(n) for n in corrections.NAMES}
    assert {n: c.config_key for n, c in builtin.items()} == corrections.NAMES
    assert all(corrections.SECTIONS.get(c.config_key) is c.config_cls for c in builtin.values() if c.config_key)
    assert set(corrections.names()) == set(CORRECTIONS.names())
    for key, cls in corrections.SECTIONS.items():
        assert getattr(cfg.algorithm.correction, key) == dataclasses.asdict(cls()), key
        assert getattr(CorrectionConfig(), key) == dataclasses.asdict(cls()), key
    assert CORRECTIONS.get("seq_tis").config_key == "tis"  # seq_tis reads the tis section
    loaded = load_config(["algorithm.correction.tis.C=3"]).algorithm.correction.tis
    assert loaded == {"C": 3.0, "level": "token"} and isinstance(loaded["C"], float)


@pytest.mark.parametrize(("override", "named"), [
    ("algorithm.correction.tis.Cc=3", "Cc"),
    ("algorithm.correction.tis.C=lots", "C"),
    ("algorithm.correction.dual.lambda_0=0.2", "lambda_0"),
    ("algorithm.correction.tiss.C=3", "tiss"),
    ("algorithm.correction.name=tiss", "tiss"),
    ("algorithm.adv_eps=1e-3", "adv_eps"),  # removed: it did nothing
    ("data.max_prompt_chars=100", "max_prompt_chars"),  # removed: prompts are cut by tokens
])
def test_bad_keys_fail_at_composition_naming_the_key(override: str, named: str) -> None:
    assert named in _compose_error(override)


@pytest.mark.parametrize(("section", "named"), [
    ("lr_lambda: 0.2", "config key `algorithm.correction.dual.lr_lambda`: unknown key; did you mean "
                       "algorithm.correction.dual.lambda0?"),
    ("eta: often", "config key `algorithm.correction.dual.eta`: Value 'often' of type 'str' could not be converted "
                   "to Float"),
])
def test_a_config_files_bad_section_key_fails_at_load_naming_it(tmp_path: Path, section: str, named: str) -> None:
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(
        f"# @package _global_\nalgorithm:\n  correction:\n    name: dual\n    dual:\n      {section}\n")
    for validate in (True, False):
        with pytest.raises(ConfigError) as e:
            load_config(["experiment=mine"], extra_config_dir=str(tmp_path), validate=validate)
        assert str(e.value) == named


def test_the_config_imports_neither_torch_nor_the_algorithms() -> None:
    """parity.config is a leaf: importing it, and checking keys and values (the corrections' sections and names
    included), loads no torch and no parity.algorithms module."""
    code = """
import sys
import parity.config
from parity.config import ConfigError, checked_overrides
for bad in ("algorithm.correction.dual.lambda_00=1", "algorithm.correction.tis.C=lots",
            "algorithm.correction.name=tiss"):
    try:
        checked_overrides([bad], check_paths=True)
    except ConfigError:
        pass
    else:
        raise SystemExit(bad + " passed")
checked_overrides(["algorithm.correction.name=dual", "algorithm.correction.dual.eta=2"], check_paths=True)
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "parity.algorithms")))
print(loaded)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_sections_are_declared_once(monkeypatch) -> None:
    @dataclass
    class Other:
        x: int = 0

    monkeypatch.setattr(corrections, "_DECLARED", dict(corrections._DECLARED))
    with pytest.raises(ValueError, match=r"algorithm\.correction\.tis is already the section of"):
        corrections.declare("other", "tis", Other)
    with pytest.raises(ValueError, match=r"algorithm\.correction\.name is one of algorithm\.correction's own keys"):
        corrections.declare("other", "name", Other)
    with pytest.raises(TypeError, match="must be a dataclass"):
        corrections.declare("other", "other", dict)
    with pytest.raises(ValueError, match="correction 'tis' is declared in parity.algorithm_config with the section"):
        corrections.declare("tis", "tis", Other)
    corrections.declare("tis", "tis", corrections.TISConfig)  # as declared: nothing changes
    assert "other" not in corrections.names()
    with pytest.raises(ValueError, match="correction 'tis' is registered twice"):
        CORRECTIONS.register("tis")(CORRECTIONS.get("none"))


def test_a_correction_registered_after_composing_is_composable(monkeypatch) -> None:
    """A registration after a config was loaded (a notebook importing its own module late) is seen by the next load;
    its section is under algorithm.correction.external. The registry and the declarations are restored after."""
    from parity.algorithms.corrections import Correction

    load_config([])
    monkeypatch.setattr(CORRECTIONS, "_items", dict(CORRECTIONS._items))
    monkeypatch.setattr(corrections, "_DECLARED", dict(corrections._DECLARED))

    @dataclass
    class LateConfig:
        x: int = 1

    @CORRECTIONS.register("late", config=LateConfig)
    class Late(Correction):
        pass

    cfg = load_config(["algorithm.correction.name=late", "algorithm.correction.external.late.x=3"])
    assert cfg.algorithm.correction.external == {"late": {"x": 3}}
    assert build_corrections(cfg.algorithm.correction).corrections[0].cfg == LateConfig(x=3)
    with pytest.raises(ConfigError, match=r"^config key `algorithm.correction.external.late.y`: unknown key"):
        load_config(["algorithm.correction.name=late", "algorithm.correction.external.late.y=3"])


@pytest.mark.parametrize(("key", "registry"), [("algorithm.policy_loss", POLICY_LOSSES),
                                               ("algorithm.loss_agg_mode", AGGREGATIONS),
                                               ("algorithm.adv_estimator", ADV_ESTIMATORS)])
def test_validation_asks_the_registries(key: str, registry, monkeypatch) -> None:
    known = ", ".join(registry.names())
    with pytest.raises(ConfigError, match=rf"config key `{key}`: unknown .* 'nope'; known: {known}$"):
        load_config([f"{key}=nope"])
    # what a registry holds is valid, whatever it is called
    monkeypatch.setitem(registry._items, "nope", registry.get(registry.names()[0]))
    assert load_config([f"{key}=nope"]) is not None


def test_the_objective_resolves_its_configuration_once() -> None:
    from parity.algorithms import Objective
    from parity.config.schema import AlgorithmConfig

    obj = Objective(AlgorithmConfig(policy_loss="reinforce", loss_agg_mode="seq-mean-token-mean"),
                    build_corrections(None))
    assert obj.policy_loss is get_policy_loss("reinforce") and obj.aggregate is AGGREGATIONS.get("seq-mean-token-mean")
    with pytest.raises(ValueError, match="algorithm.policy_loss: score_centering is derived for the REINFORCE"):
        Objective(AlgorithmConfig(policy_loss="ppo_clip"), build_corrections(CorrectionConfig(name="score_centering")))
    with pytest.raises(ValueError, match="algorithm.loss_agg_mode: unknown mode 'sum'"):
        Objective(AlgorithmConfig(loss_agg_mode="sum"), build_corrections(None))


def test_a_config_sent_with_a_section_this_process_lacks_still_loads() -> None:
    """A Ray actor gets the driver's config as plain values: a section of a correction registered only in the driver
    (its module not named in algorithm.correction.modules) is a plain mapping there, kept as it came (building the
    corrections names it if it is selected); the schema's own keys stay checked."""
    from parity.config import as_plain, from_plain

    plain = as_plain(load_config([]))
    plain["algorithm"]["correction"]["external"]["registered_elsewhere"] = {"k": 1.0}
    cfg = from_plain(plain)
    assert cfg.algorithm.correction.external == {"registered_elsewhere": {"k": 1.0}}
    assert cfg.algorithm.correction.name == "none" and as_plain(cfg) == plain
    plain["algorithm"]["correction"]["tolerance_multiplee"] = 2.0
    with pytest.raises(ConfigError, match="tolerance_multiplee"):
        from_plain(plain)
    plain = as_plain(load_config([]))
    plain["trainer"]["lrr"] = 1.0
    with pytest.raises(ConfigError, match="trainer.lrr"):
        from_plain(plain)


def test_a_loaded_config_pickles_and_copies() -> None:
    """The schema's classes are plain dataclasses: pickling and copying need nothing of their own."""
    import copy
    import pickle

    cfg = load_config(["algorithm.correction.name=dual", "algorithm.correction.dual.eta=2.5", "trainer.lr=3e-4"])
    for node in (cfg, cfg.algorithm, cfg.algorithm.correction):
        back = pickle.loads(pickle.dumps(node))
        assert back == node and type(back) is type(node)
    deep = copy.deepcopy(cfg)
    deep.algorithm.correction.dual["eta"] = 1.0
    assert cfg.algorithm.correction.dual["eta"] == 2.5 and type(deep) is type(cfg)
    assert copy.copy(cfg.algorithm.correction) == cfg.algorithm.correction
