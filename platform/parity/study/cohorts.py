"""A study's cohorts: its runs grouped by rollout engine, each group of two or more sampling through one rollout
server (parity.rollout.cohort_server), its members' loops meeting at each engine call.

Two runs share a rollout engine when their composed configs agree on everything the engine is built from: the
`rollout` section (format, sampling, engine), the `model` section, the device and the starting weights (a seed's
own warm start). The arms of one format differ in their correction and the trainer's settings, which the server
does not see. A perturbed rollout (the dial) draws its own Delta per run and is never a member.

    cohorts = plan(specs, model_dirs, folder)       # which runs share a server (groups of two or more)
    specs = with_members(specs, cohorts)            # their overrides gain rollout.cohort=SOCKET#i
    with serving(cohorts, env, log_dir, wait=False): run_all(...)   # servers start with the runs, stop after them
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from parity.study.members import RunSpec
from parity.study.preload import start


@dataclass
class Cohort:
    members: list[str]  # run names, in member order
    overrides: list[str]  # the first member's (what the server builds its engines from)
    model_dir: str
    address: str
    proc: Any = field(default=None, repr=False)


def rollout_key(overrides: list[str], model_dir: str) -> str | None:
    """What a run's rollout engine is built from (None: the run cannot share one)."""
    from omegaconf import OmegaConf

    from parity.config import load_config
    from parity.rollout import is_perturbed, rollout_precision

    cfg = load_config(list(overrides))
    if cfg.rollout.name != "torch" or is_perturbed(rollout_precision(cfg)):
        return None
    return json.dumps({"rollout": OmegaConf.to_container(OmegaConf.structured(cfg.rollout)),
                       "model": OmegaConf.to_container(OmegaConf.structured(cfg.model)),
                       "device": str(cfg.trainer.device), "weights": str(Path(model_dir).resolve())},
                      sort_keys=True, default=str)


def check_max_runs(max_runs: int | None) -> None:
    """`--cohort-max-runs`: None (one server a group) or 2 or more."""
    if max_runs is not None and max_runs < 2:
        raise ValueError(f"--cohort-max-runs {max_runs}: a cohort is two or more runs (give 2 or more)")


def plan(specs: list[RunSpec], model_dirs: dict[str, str], folder: Path, max_runs: int | None = None
         ) -> list[Cohort]:
    """The groups of two or more runs that share a rollout engine; `model_dirs`: run name -> starting weights.
    `max_runs`: a group of more runs is served by as few servers as keep each at most that many, its runs dealt
    out evenly in order (seven at most four: four and three). A cohort's call lasts as long as its slowest row and
    its products grow with its rows, so one large cohort can be the study's slowest member while the GPU has room
    for a second server beside it."""
    check_max_runs(max_runs)
    groups: dict[str, list[RunSpec]] = {}
    for s in specs:
        key = rollout_key(list(s.overrides), model_dirs[s.name])
        if key is not None:
            groups.setdefault(key, []).append(s)
    parts: list[list[RunSpec]] = []
    for g in groups.values():
        n = 1 if max_runs is None else -(-len(g) // max_runs)
        size, extra = divmod(len(g), n)
        start = 0
        for j in range(n):
            stop = start + size + (1 if j < extra else 0)
            parts.append(g[start:stop])
            start = stop
    out = []
    for i, ss in enumerate(g for g in parts if len(g) > 1):
        out.append(Cohort(members=[s.name for s in ss], overrides=list(ss[0].overrides),
                          model_dir=model_dirs[ss[0].name], address=str(folder / f"cohort{i}.sock")))
    return out


def with_members(specs: list[RunSpec], cohorts: list[Cohort]) -> list[RunSpec]:
    """The specs, each member's overrides with its `rollout.cohort`."""
    member = {name: (c, i) for c in cohorts for i, name in enumerate(c.members)}
    # quoted: '#' is not a character of Hydra's unquoted override values
    return [replace(s, overrides=(*s.overrides, f"rollout.cohort='{member[s.name][0].address}#{member[s.name][1]}'"))
            if s.name in member else s for s in specs]


@contextlib.contextmanager
def serving(cohorts: list[Cohort], env: dict, log_dir: Path, timeout_s: float = 600.0,
            sm_share: int | None = None, wait: bool = True, compile_threads: int | None = None,
            preloader: Any = None) -> Iterator[list[Cohort]]:
    """Start every cohort's server, all at once, yield, stop them. `wait`: yield once every server listens (its
    engines built); False: yield at once, so that the runs start while the servers build their engines (a member
    connects when its server listens, and fails with the server's error if it could not start: the server writes
    it to SOCKET's `.failed` file, parity.rollout.cohort_server). `sm_share`: under CUDA MPS, the share of the SMs
    a server's process may use at a time, where it differs from the runs' (a server decodes the rows of all its
    members in one call). `compile_threads`: Inductor's compile workers in a server's process
    (TORCHINDUCTOR_COMPILE_THREADS), where they differ from the runs' (a study's runs compile in their own process,
    one kernel at a time; a server's first calls compile and capture on every member's critical path).
    `preloader`: a parity.study.preload.Preloader the servers are forked from (their imports done), else each
    server is a new interpreter."""
    log_dir.mkdir(parents=True, exist_ok=True)
    if compile_threads is not None:
        if int(compile_threads) < 1:
            raise ValueError(f"--cohort-compile-threads: at least 1, got {compile_threads}")
        env = {**env, "TORCHINDUCTOR_COMPILE_THREADS": str(int(compile_threads))}
    if sm_share is not None:
        from parity.study.mps import SM_SHARE_ENV, check_sm_share
        env = {**env, SM_SHARE_ENV: str(check_sm_share(sm_share, "--cohort-sm-share"))}
    try:
        for i, c in enumerate(cohorts):
            for stale in (Path(c.address), *(Path(c.address).with_suffix(x) for x in (".ready", ".failed"))):
                stale.unlink(missing_ok=True)
            argv = ["-m", "parity.rollout.cohort_server", "--address", c.address, "--members", str(len(c.members)),
                    "--model-dir", c.model_dir, "--ready", str(Path(c.address).with_suffix(".ready")), "--",
                    *c.overrides]
            c.proc = start(argv, env, log_dir / f"cohort{i}.log", Path.cwd(), preloader)
        t0 = time.time()
        for i, c in enumerate(cohorts):
            ready = Path(c.address).with_suffix(".ready")
            while wait and not ready.exists():
                if c.proc.poll() is not None or time.time() - t0 > timeout_s:
                    tail = (log_dir / f"cohort{i}.log").read_text()[-2000:]
                    raise RuntimeError(f"cohort server {i} ({len(c.members)} members: {', '.join(c.members)}) did not "
                                       f"start:\n{tail}")
                time.sleep(0.2)
            print(f"study: cohort {i} {'serves' if wait else 'starts for'} {len(c.members)} runs "
                  f"({', '.join(c.members)}) on {c.address}", flush=True)
        yield cohorts
    finally:
        for c in cohorts:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.terminate()
                try:
                    c.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    c.proc.kill()


__all__ = ["Cohort", "plan", "rollout_key", "serving", "with_members"]
