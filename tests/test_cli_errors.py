"""One kind of error on the command line: a value of the wrong type, an unknown key (with the key meant) and a path
that is not there each stop `python -m parity <command>` with one line `error: config key `KEY`: ...` and exit status
2, before torch is imported and within seconds."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity.config import ConfigError, load_config
from parity.config.keys import ALIASES, schema_keys, unknown_key_message

REPO = Path(__file__).resolve().parents[1]

# The wall-time bound. The check needs Python, omegaconf, Hydra's override parser and the schema: 0.5-1.0 s measured
# on a 2-core CPU with other processes on its cores. Importing torch alone takes ~3 s on such a CPU, and loading a
# command (torch, transformers, the engine) 10-15 s: the path error took 15.6 s when it waited for them. 5 s leaves a
# CI machine five times the measured time for a loaded core or a cold file cache, and is still well under what any
# import of the heavy libraries costs; that no such import happened is asserted on its own below (-X importtime), so
# the test does not rest on the clock alone.
BOUND_S = 5.0


def _cli(*args: str) -> tuple[int, list[str], list[str], float]:
    """(exit status, stderr lines other than -X importtime's, modules imported, wall seconds) of `python -m parity`."""
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "parity", *args], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    wall = time.perf_counter() - t
    lines = out.stderr.splitlines()
    imported = [ln.rsplit("|", 1)[-1].strip() for ln in lines if ln.startswith("import time:")]
    return out.returncode, [ln for ln in lines if not ln.startswith("import time:")], imported, wall


def _refused(args: list[str], line: str) -> None:
    code, err, imported, wall = _cli(*args)
    assert code == 2, err
    assert err == [line], err  # one line: no traceback, no Hydra text
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")], "torch imported before the check"
    assert wall < BOUND_S, f"{wall:.1f} s (bound {BOUND_S} s: see BOUND_S)"


def test_a_value_of_the_wrong_type_names_the_key_and_the_type() -> None:
    _refused(["train", "trainer.lr=abc"], "error: config key `trainer.lr`: expected float, got 'abc'")


def test_an_unknown_top_level_key_names_the_key_meant() -> None:
    _refused(["evaluate", "checkpoint=/x"],
             "error: config key `checkpoint`: unknown key or group; did you mean eval.model_path?")


def test_a_missing_path_is_refused_before_the_command_loads(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    _refused(["evaluate", f"eval.model_path={missing}"],
             f"error: config key `eval.model_path`: {missing} does not exist (expected a checkpoint folder "
             "(config.json) or a run folder (checkpoints/))")
    (tmp_path / "empty").mkdir()  # there, but neither a checkpoint nor a run folder
    _refused(["evaluate", f"eval.model_path={tmp_path / 'empty'}"],
             f"error: config key `eval.model_path`: {tmp_path / 'empty'} is not a checkpoint folder (config.json) "
             "or a run folder (checkpoints/)")


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.total_steps=1.5"], "config key `trainer.total_steps`: expected int, got 1.5"),
    (["trainer.betas=0.9"], "config key `trainer.betas`: expected list[float], got 0.9"),
    (["trainer.resume=maybe"], "config key `trainer.resume`: expected bool, got 'maybe'"),
    (["trainer.lr=1e-3,abc"], "config key `trainer.lr`: expected float, got 'abc'"),  # each value of a sweep
    # a correction's section: checked against its declaration (parity.algorithm_config), torch not loaded
    (["algorithm.correction.tis.C=abc"], "config key `algorithm.correction.tis.C`: expected float, got 'abc'"),
])
def test_load_config_refuses_a_wrong_type_with_the_same_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(overrides)
    assert str(e.value) == message


def test_right_types_interpolations_and_conversions_pass() -> None:
    cfg = load_config(["trainer.lr='3e-4'", "trainer.total_steps=7", "trainer.grad_clip=2",
                       "trainer.weight_decay=${trainer.lr}", "model.path=null"])
    assert cfg.trainer.lr == 3e-4 and cfg.trainer.total_steps == 7 and cfg.trainer.grad_clip == 2.0
    assert cfg.trainer.weight_decay == 3e-4 and cfg.model.path is None


def test_aliases_point_at_schema_keys_at_any_level() -> None:
    assert set(ALIASES.values()) <= set(schema_keys())
    assert unknown_key_message("eval.checkpoint") == "config key `eval.checkpoint`: unknown key; did you mean " \
                                                     "eval.model_path?"
    assert re.search(r"did you mean .*rollout\.temperature", unknown_key_message("temprature"))
