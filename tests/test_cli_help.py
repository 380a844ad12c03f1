"""The CLI guides: `--help` lists every command with a line and an example, `<command> --help` gives the
command's config groups, main keys and examples without importing the command (or torch), Hydra's own help
stays reachable, and every key a help page names is a key of the schema."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity.__main__ import FLAG_COMMANDS, _commands
from parity.commands._help import command_doc
from parity.config.keys import open_groups, schema_keys

REPO = Path(__file__).resolve().parents[1]
HYDRA_COMMANDS = [c for c in _commands() if c not in FLAG_COMMANDS]


def _cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "parity", *args], capture_output=True, text=True, timeout=120, cwd=REPO)
    return out, time.perf_counter() - t


def test_top_level_help_lists_every_command_with_a_line_and_an_example() -> None:
    out, _ = _cli("--help")
    assert out.returncode == 0, out.stderr
    for cmd in _commands():
        d = command_doc(cmd)
        assert re.search(rf"^  {cmd} +\S", out.stdout, re.M), cmd
        assert d["summary"] and d["examples"], f"{cmd}: no summary or EXAMPLES"
        assert f"e.g. {d['examples'][0]}" in out.stdout
        assert all(e.startswith(f"python -m parity {cmd}") for e in d["examples"]), cmd


@pytest.mark.parametrize("cmd", HYDRA_COMMANDS)
def test_command_help_is_short_and_imports_nothing_heavy(cmd: str) -> None:
    code = (f"import sys; from parity.__main__ import main; main([{cmd!r}, '--help']); "
            "heavy = [m for m in ('torch', 'transformers', 'hydra', 'omegaconf', 'vllm') if m in sys.modules]; "
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("HEAVY []"), out.stdout[-300:]
    text = out.stdout
    assert text.startswith(f"usage: python -m parity {cmd} [overrides...]")
    assert "config groups" in text and "examples:" in text and "--help-full" in text
    assert len(text.splitlines()) < 60


def test_train_help_names_groups_and_options() -> None:
    out, _ = _cli("train", "--help")
    assert out.returncode == 0
    assert re.search(r"^\s+model\s+hf, tiny_qwen3, tiny_qwen3_moe$", out.stdout, re.M)
    assert re.search(r"^\s+\+precision\s+w8a8_fp8, .*w8a8_int8_kv_int4$", out.stdout, re.M)  # not in the defaults list


def test_hydra_full_help_is_still_reachable() -> None:
    out, _ = _cli("train", "--help-full")
    assert out.returncode == 0, out.stderr
    assert "== Config ==" in out.stdout and "total_steps:" in out.stdout  # Hydra's page with the config dump
    out, _ = _cli("train", "--hydra-help")
    assert out.returncode == 0 and "Hydra" in out.stdout and "--multirun" in out.stdout


def test_grade_help_shows_its_flags_and_example() -> None:
    out, _ = _cli("grade", "--help")
    assert out.returncode == 0 and "--response" in out.stdout and "python -m parity grade --response" in out.stdout


def test_unknown_command_suggests_the_closest() -> None:
    out, _ = _cli("trian")
    assert out.returncode == 2 and "unknown command 'trian'; did you mean train?" in out.stderr


def test_keys_named_in_help_exist_in_the_schema() -> None:
    keys, opened = set(schema_keys()), open_groups()
    for cmd in _commands():
        for line in command_doc(cmd)["keys"]:
            named = line.split(": ", 1)[0]
            for key in re.findall(r"(?<![.\w])([a-z_]+(?:\.[a-z_<>0-9]+)+)", named):
                if key.startswith(tuple(f"{g}." for g in opened)):
                    continue
                assert key in keys, f"{cmd} --help names `{key}`, which is not a schema key"
