"""`python -m parity --help` and `python -m parity <command> --help`, fast: nothing heavy is imported.

Each command module documents itself: its docstring (the first sentence after the usage is its one-line
summary), `EXAMPLES` (command lines) and `KEYS` ("key: what it does" for the keys a user changes most),
all read from the source with `ast`, so printing help imports neither the command nor torch. The config
groups and their options are the folders and files of the config tree."""

from __future__ import annotations

import ast
import functools
import re
import textwrap
from pathlib import Path

from parity.config_tree import config_groups, default_groups

_COMMANDS_DIR = Path(__file__).resolve().parent
PROG = "python -m parity"
HYDRA_FLAGS = (
    "Hydra flags: `--cfg job [--resolve]` prints the composed config (every key) and exits; `--config-dir DIR` "
    "adds a folder of your own configs; `--multirun` sweeps comma-separated values. `--help-full` prints "
    "Hydra's help page with the whole config, `--hydra-help` Hydra's own flags."
)


@functools.cache
def command_doc(name: str) -> dict:
    """{'doc': docstring, 'summary': one line, 'examples': [...], 'keys': [...], 'groups': [...]}, from the source."""
    tree = ast.parse((_COMMANDS_DIR / f"{name}.py").read_text())
    doc = ast.get_docstring(tree) or ""
    consts: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("EXAMPLES", "KEYS", "GROUPS"):
                consts[node.targets[0].id] = ast.literal_eval(node.value)
    first = doc.split("\n\n", 1)[0].replace("\n", " ")
    summary = first.split("`: ", 1)[1] if first.startswith("`") and "`: " in first else first
    summary = summary.split(". ", 1)[0].rstrip(".")
    return {"doc": doc, "summary": summary, "examples": list(consts.get("EXAMPLES", [])),
            "keys": list(consts.get("KEYS", [])), "groups": list(consts.get("GROUPS", []))}


def overview(commands: list[str]) -> str:
    width = max(len(c) for c in commands)
    lines = [
        "Parity: RL post-training whose rollouts come from a low-precision inference engine; the",
        "training/inference mismatch is measured on every step and corrected by a pluggable correction.",
        "",
        f"usage: {PROG} <command> [overrides...]     overrides are Hydra's: key=value, group=option",
        "",
        "commands:",
    ]
    for c in commands:
        d = command_doc(c)
        lines += textwrap.wrap(d["summary"], 110, initial_indent=f"  {c:<{width}}  ",
                               subsequent_indent=" " * (width + 4))
        if d["examples"]:
            lines.append(f"  {'':<{width}}  e.g. {d['examples'][0]}")
    lines += [
        "",
        f"`{PROG} <command> --help` lists a command's config groups, main keys and examples;",
        f"`{PROG} <command> --cfg job` prints every key it would run with. The last stdout line of every",
        "command is a one-line JSON summary of its result. Docs: README.md and docs/README.md.",
    ]
    return "\n".join(lines)


def command_help(name: str) -> str:
    d = command_doc(name)
    doc = re.sub(r"^`[^`]*`:\s*", "", d["doc"].strip())  # the usage line says it already
    lines = [f"usage: {PROG} {name} [overrides...]", "", doc[:1].upper() + doc[1:], ""]
    groups = config_groups()
    shown = [g for g in d["groups"] if g in groups]
    if shown:
        in_defaults = default_groups()
        width = max(len(g) + 1 for g in shown)
        lines.append("config groups (pick an option; `+group=option` where marked +):")
        for g in shown:
            mark = " " if g in in_defaults else "+"
            lines.append(f"  {mark}{g:<{width}} {', '.join(groups[g])}")
        lines.append("")
    if d["keys"]:
        lines.append("main keys (key=value; `--cfg job` shows them all):")
        lines += [f"  {k}" for k in d["keys"]]
        lines.append("")
    if d["examples"]:
        lines.append("examples:")
        lines += [f"  {e}" for e in d["examples"]]
        lines.append("")
    lines += textwrap.wrap(HYDRA_FLAGS, 110)
    return "\n".join(lines)


__all__ = ["command_doc", "command_help", "config_groups", "overview", "HYDRA_FLAGS", "PROG"]
