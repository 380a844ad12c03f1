"""The config asks the registries: the correction sections in the schema are the registered ones (a typo or a
wrong type in any fails at composition naming the key), validation knows the policy losses, aggregation modes
and advantage estimators from their registries, and the keys that did nothing are gone."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hydra.errors import ConfigCompositionException

from parity.algorithms import (
    ADV_ESTIMATORS,
    AGGREGATIONS,
    CORRECTIONS,
    POLICY_LOSSES,
    build_corrections,
    get_policy_loss,
)
from parity.config import ConfigError, load_config, schema
from parity.config.schema import (
    CORRECTION_KEYS,
    CorrectionConfig,
    add_correction_section,
    correction_sections,
    parity_schema,
)


def _compose_error(*overrides: str) -> str:
    with pytest.raises((ConfigCompositionException, ConfigError)) as e:  # an unknown key, or a wrong type
        load_config(list(overrides))
    return f"{e.value} {e.value.__cause__}"


def test_the_schema_carries_every_registered_section() -> None:
    cfg = load_config([])
    sections = CORRECTIONS.sections()
    assert {"tis", "icepop", "mis", "score_centering", "dual"} <= set(sections)
    for key, cls in sections.items():
        assert isinstance(getattr(cfg.algorithm.correction, key), cls), key
    assert CORRECTIONS.get("seq_tis").config_key == "tis"  # seq_tis reads the tis section
    assert load_config(["algorithm.correction.tis.C=3"]).algorithm.correction.tis.C == 3.0


@pytest.mark.parametrize(("override", "named"), [
    ("algorithm.correction.tis.Cc=3", "Cc"),
    ("algorithm.correction.tis.C=lots", "C"),
    ("algorithm.correction.dual.lambda_0=0.2", "lambda_0"),
    ("algorithm.correction.tiss.C=3", "tiss"),
    ("algorithm.adv_eps=1e-3", "adv_eps"),  # removed: it did nothing
    ("data.max_prompt_chars=100", "max_prompt_chars"),  # removed: prompts are cut by tokens
])
def test_bad_keys_fail_at_composition_naming_the_key(override: str, named: str) -> None:
    assert named in _compose_error(override)


def test_sections_are_declared_once() -> None:
    @dataclass
    class Other:
        x: int = 0

    with pytest.raises(ValueError, match=r"algorithm\.correction\.tis is already the section of"):
        add_correction_section("tis", Other)
    with pytest.raises(ValueError, match=r"algorithm\.correction\.name is CorrectionConfig's own key"):
        add_correction_section("name", Other)
    with pytest.raises(TypeError, match="must be a dataclass"):
        add_correction_section("other", dict)
    add_correction_section("tis", CORRECTIONS.sections()["tis"])  # the same dataclass again: nothing changes
    assert "other" not in correction_sections() and "other" not in parity_schema().__dataclass_fields__
    # declaring sections derives a schema; the classes of schema.py stay as written
    assert set(CorrectionConfig.__dataclass_fields__) == set(CORRECTION_KEYS)
    grown = parity_schema()().algorithm.correction
    assert isinstance(grown, CorrectionConfig) and grown.tis == CORRECTIONS.sections()["tis"]()
    assert parity_schema() is parity_schema()  # one class per set of sections
    with pytest.raises(ValueError, match="correction 'tis' is registered twice"):
        CORRECTIONS.register("tis")(CORRECTIONS.get("none"))


def test_a_correction_registered_after_composing_is_composable(monkeypatch) -> None:
    """A registration after the schema was stored with Hydra (a notebook importing its own module late) is seen by
    the next composition. The registry and the declared sections are restored after the test."""
    from parity.algorithms.corrections import Correction

    load_config([])
    monkeypatch.setattr(CORRECTIONS, "_items", dict(CORRECTIONS._items))
    monkeypatch.setattr(schema, "_SECTIONS", dict(schema._SECTIONS))

    @dataclass
    class LateConfig:
        x: int = 1

    @CORRECTIONS.register("late", config=LateConfig)
    class Late(Correction):
        pass

    cfg = load_config(["algorithm.correction.name=late", "algorithm.correction.late.x=3"])
    assert cfg.algorithm.correction.late.x == 3
    assert build_corrections(cfg.algorithm.correction).corrections[0].cfg == LateConfig(x=3)


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
    """A Ray actor gets the driver's config as plain values: a section registered only in the driver (its module not
    named in algorithm.correction.modules) is left out there instead of failing the actor; its own keys stay
    checked."""
    from parity.config import ConfigError, as_plain, from_plain

    plain = as_plain(load_config([]))
    plain["algorithm"]["correction"]["registered_elsewhere"] = {"k": 1.0}
    cfg = from_plain(plain)
    assert not hasattr(cfg.algorithm.correction, "registered_elsewhere") and cfg.algorithm.correction.name == "none"
    plain["algorithm"]["correction"]["tolerance_multiplee"] = 2.0
    with pytest.raises(ConfigError, match="tolerance_multiplee"):
        from_plain(plain)
    plain = as_plain(load_config([]))
    plain["trainer"]["lrr"] = 1.0
    with pytest.raises(ConfigError, match="trainer.lrr"):
        from_plain(plain)


def test_a_loaded_config_pickles_and_copies() -> None:
    """The loaded config's classes are derived in each process from what it registered (parity_schema), so pickling
    carries its values and the loader rebuilds it; copies stay field by field."""
    import copy
    import pickle

    cfg = load_config(["algorithm.correction.name=dual", "algorithm.correction.dual.eta=2.5", "trainer.lr=3e-4"])
    for node in (cfg, cfg.algorithm, cfg.algorithm.correction):
        back = pickle.loads(pickle.dumps(node))
        assert back == node and type(back) is type(node)
    deep = copy.deepcopy(cfg)
    deep.algorithm.correction.dual.eta = 1.0
    assert cfg.algorithm.correction.dual.eta == 2.5 and type(deep) is type(cfg)
