"""`python -m parity <command> [hydra overrides...]`.

Stage commands (prepare, train, quantize, validate, evaluate, pipeline, ...) are Hydra applications:
`--cfg job --resolve`, `--config-dir DIR`, `--multirun` work as Hydra users know them. Each command is a
module parity.commands.<name> with `run(cfg) -> dict`; flag-style commands (grade) define `main(argv)`.
The last stdout line of every command is a one-line JSON summary of its result."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys

# Before torch loads OpenMP: on shared machines busy-waiting threads make CPU work 10-30x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import parity.commands as commands_pkg  # noqa: E402

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
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m parity <command> [overrides...]\ncommands: {', '.join(known)}")
        return
    cmd, rest = argv[0], argv[1:]
    if cmd not in known:
        _fail(f"unknown command {cmd!r}; known: {', '.join(known)}")
    module = importlib.import_module(f"parity.commands.{cmd}")
    if cmd in FLAG_COMMANDS:
        try:
            _emit(module.main(rest))
        except (ValueError, FileNotFoundError) as e:
            _fail(str(e))
        return
    _run_hydra(cmd, module, rest)


def _run_hydra(cmd: str, module, rest: list[str]) -> None:
    import hydra
    from omegaconf import DictConfig

    from parity.config import ConfigError, config_dir, normalize_overrides, register_schema, validate_config
    from parity.errors import ParityError

    try:
        register_schema(normalize_overrides(rest))  # modules named by algorithm.correction.modules register first
    except ConfigError as e:
        _fail(str(e))

    @hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")
    def app(cfg: DictConfig) -> None:
        try:
            validate_config(cfg)
            result = module.run(cfg)
        except (ConfigError, ParityError, FileNotFoundError) as e:
            _fail(str(e))
        _emit(result)

    sys.argv = [f"parity {cmd}", *normalize_overrides(rest)]
    app()


if __name__ == "__main__":
    main()
