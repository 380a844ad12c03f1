"""`python -m parity <command> [hydra overrides...]`.

Stage commands (prepare, train, quantize, validate, evaluate, pipeline, ...) are Hydra applications:
`--cfg job --resolve`, `--config-dir DIR`, `--multirun` work as Hydra users know them. Each command is a
module parity.commands.<name> with `run(cfg) -> dict`; flag-style commands (grade) define `main(argv)`.
The last stdout line of every command is a one-line JSON summary of its result.

`--help` (alone, or after a command) is answered from the command modules' sources without importing them
(parity.commands._help); `--help-full` is Hydra's own help page (the whole config), `--hydra-help` Hydra's
flags. An override naming a key the schema lacks, a value of the wrong type or a path that is not there stops the
command before Hydra composes and before torch is imported (parity.config.keys), with one line
`error: config key `KEY`: ...` and exit status 2, whether it was written `a.b=1` or `+a.b=1`."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys

# Before torch loads OpenMP: on shared machines busy-waiting threads make CPU work many times slower
# (docs/CPU_PERFORMANCE.md, CPU lanes).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import parity.commands as commands_pkg  # noqa: E402
from parity.commands._help import command_doc, command_help, overview
from parity.errors import ParityError

FLAG_COMMANDS = {"grade", "study"}


def _commands() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(commands_pkg.__path__) if not m.name.startswith("_"))


def _emit(result: dict) -> None:
    sys.stdout.flush()
    print(json.dumps(result, default=str), flush=True)


def _fail(msg: str, code: int = 2) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    known = _commands()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(overview(known))
        return
    cmd, rest = argv[0], argv[1:]
    if cmd not in known:
        import difflib

        close = difflib.get_close_matches(cmd, known, n=1)
        _fail(f"unknown command {cmd!r}{'; did you mean ' + close[0] + '?' if close else ''} "
              f"(known: {', '.join(known)}; `python -m parity --help` describes them)")
    if cmd in FLAG_COMMANDS:
        module = importlib.import_module(f"parity.commands.{cmd}")
        if any(a in ("-h", "--help") for a in rest):
            d = command_doc(cmd)
            print(module._parser().format_help().rstrip() + "\n\nexamples:\n" +
                  "\n".join(f"  {e}" for e in d["examples"]))
            return
        try:
            _emit(module.main(rest))
        except (ValueError, FileNotFoundError) as e:
            _fail(str(e))
        return
    if any(a in ("-h", "--help") for a in rest):
        print(command_help(cmd))
        return
    _run_hydra(cmd, ["--help" if a == "--help-full" else a for a in rest])


# Hydra's command-line flags that take a value (the rest of the arguments are overrides or plain flags)
_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--config-dir",
                "-cd", "--experimental-rerun"}
_INFO_CHOICES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def _split_args(rest: list[str]) -> tuple[list[str], list[str]]:
    """(overrides, config dirs given with --config-dir) out of a Hydra command line."""
    overrides, dirs, i = [], [], 0
    while i < len(rest):
        a = rest[i]
        if a.startswith("-"):
            flag, _, value = a.partition("=")
            if flag in _VALUE_FLAGS and not value and i + 1 < len(rest):
                i, value = i + 1, rest[i + 1]
            elif flag in ("--info", "-i") and not value and i + 1 < len(rest) and rest[i + 1] in _INFO_CHOICES:
                i += 1
            if flag in ("--config-dir", "-cd") and value:
                dirs.append(value)
        else:
            overrides.append(a)
        i += 1
    return overrides, dirs


def _run_hydra(cmd: str, rest: list[str]) -> None:
    from parity.config import (
        ConfigError,
        checked_config,
        checked_overrides,
        config_dir,
        normalize_overrides,
        typed,
    )

    overrides, dirs = _split_args(rest)
    try:
        checked_overrides(overrides, dirs, check_paths=True)  # a typo is answered before torch loads
    except ConfigError as e:
        _fail(str(e))

    import hydra
    from omegaconf import DictConfig

    @hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")
    def app(cfg: DictConfig) -> None:
        try:
            checked_config(cfg)
            module = importlib.import_module(f"parity.commands.{cmd}")  # after composition: `--cfg job` stays fast
            result = module.run(typed(cfg))
        except (ConfigError, ParityError, FileNotFoundError) as e:
            _fail(str(e))
        _emit(result)

    sys.argv = [f"parity {cmd}", *normalize_overrides(rest)]
    app()


if __name__ == "__main__":
    main()
