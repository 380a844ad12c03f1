"""The study's warm start (parity.study.runs.prepare_model): built once in a process of its own, read in place
when it exists."""

from __future__ import annotations

import json
import subprocess

import pytest


def test_a_built_warm_start_is_read_without_starting_a_prepare_process(tmp_path, monkeypatch) -> None:
    """parity.study.runs.prepare_model: a warm start already under the outputs folder (its prepare.json written)
    is returned as it is, in this process; only a build starts `parity prepare` in a process of its own."""
    from parity.config import load_config
    from parity.models.prepare import resolve_model_dir
    from parity.study import runs

    base = ["experiment=countdown_tiny", "model.dtype=float32", "model.warm_start.seed=7"]
    target = resolve_model_dir(load_config([f"outputs_dir={tmp_path}", *base]))
    target.mkdir(parents=True)
    (target / "prepare.json").write_text(json.dumps({"weights_sha256": "abc", "heldout_accuracy": 0.25}))

    started = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: started.append(a) or pytest.fail("a process started"))
    got = runs.prepare_model(base, str(tmp_path), env_threads=1)
    assert got["model_dir"] == str(target) and got["cached"] and got["weights_sha256"] == "abc" and not started
    # another seed's warm start is not built yet: that one is a build, in a process of its own
    monkeypatch.setattr(subprocess, "run", lambda cmd, **k: started.append(cmd) or subprocess.CompletedProcess(
        cmd, 0, stdout=json.dumps({"model_dir": "built"}) + "\n", stderr=""))
    assert runs.prepare_model([*base[:-1], "model.warm_start.seed=8"], str(tmp_path), env_threads=1) == {"model_dir": "built"}
    assert started and started[0][1:4] == ["-m", "parity", "prepare"]
