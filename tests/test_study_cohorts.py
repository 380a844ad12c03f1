"""A study's cohorts (parity.study.cohorts, `parity study --cohorts`): which runs share a rollout server, and a
quick study run both ways, whose runs must log the same numbers with and without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parity.study.members import RunSpec

PIN = "model.dtype=float32"


def _spec(name: str, *overrides: str, seed: int = 0) -> RunSpec:
    return RunSpec(name=name, arm=name, seed=seed, overrides=("experiment=countdown_tiny", PIN, f"trainer.seed={seed}",
                                                              *overrides))


def test_runs_share_a_server_when_their_rollout_engines_are_the_same(tmp_path) -> None:
    from parity.study.cohorts import plan, with_members

    w4 = ("rollout.precision.weights=int4", "rollout.precision.activations=int4",
          "rollout.precision.kv_cache=int4_per_token_head")
    specs = [_spec("exact"),
             _spec("w4-none", *w4), _spec("w4-tis", *w4, "algorithm.correction.name=tis"),
             _spec("w4-dual", *w4, "algorithm.correction.name=dual", "trainer.lr=1e-4"),
             _spec("w4-sc", *w4, "algorithm.correction.name=score_centering", "algorithm.policy_loss=reinforce",
                   "rollout.topk_logprobs=8"),
             _spec("w4-sc-tis", *w4, "algorithm.correction.name=score_centering+tis", "algorithm.policy_loss=reinforce",
                   "rollout.topk_logprobs=8"),
             _spec("dial-a", "rollout.precision.perturbation.sigma=0.1"),
             _spec("dial-b", "rollout.precision.perturbation.sigma=0.1", "algorithm.correction.name=tis"),
             _spec("w4-seed1", *w4, seed=1)]
    dirs = {s.name: str(tmp_path / ("m1" if s.seed == 1 else "m0")) for s in specs}
    cohorts = plan(specs, dirs, tmp_path)
    # the corrections and the trainer's settings do not change the rollout engine; top-K log-probs and the
    # starting weights (another seed's warm start) do; a perturbed rollout draws its own Delta: never a member
    assert [c.members for c in cohorts] == [["w4-none", "w4-tis", "w4-dual"], ["w4-sc", "w4-sc-tis"]]
    assert cohorts[0].model_dir == dirs["w4-none"] and cohorts[0].address != cohorts[1].address
    out = {s.name: s for s in with_members(specs, cohorts)}
    assert out["w4-tis"].overrides[-1] == f"rollout.cohort='{cohorts[0].address}#1'"
    assert out["exact"].overrides == specs[0].overrides and out["dial-b"].overrides == specs[7].overrides


def test_a_large_group_is_dealt_out_over_servers_of_at_most_max_runs(tmp_path) -> None:
    from parity.study.cohorts import plan

    w4 = ("rollout.precision.weights=int4", "rollout.precision.activations=int4")
    specs = [_spec(f"w4-{i}", *w4, f"trainer.lr={i + 1}e-5") for i in range(7)] + [_spec("exact"), _spec("exact-b",
                                                                                                       "trainer.lr=2e-5")]
    dirs = {s.name: str(tmp_path / "m0") for s in specs}
    names = [f"w4-{i}" for i in range(7)]
    assert [c.members for c in plan(specs, dirs, tmp_path)] == [names, ["exact", "exact-b"]]
    # seven at most four: four and three, in order; three at most: three, two, two; two: the pair stays one
    assert [c.members for c in plan(specs, dirs, tmp_path, 4)] == [names[:4], names[4:], ["exact", "exact-b"]]
    got = plan(specs, dirs, tmp_path, 3)
    assert [len(c.members) for c in got] == [3, 2, 2, 2] and sum((c.members for c in got[:3]), []) == names
    assert len({c.address for c in got}) == 4
    with pytest.raises(ValueError, match="--cohort-max-runs 1: a cohort is two or more runs"):
        plan(specs, dirs, tmp_path, 1)


def _metrics(outputs: Path, tag: str) -> dict[str, list[dict]]:
    out = {}
    for f in sorted((outputs / "runs").glob(f"*{tag}*/metrics.jsonl")):
        rows = [json.loads(x) for x in f.read_text().splitlines()]
        out[f.parent.name.replace(tag, "")] = [{k: v for k, v in r.items() if not k.startswith(("perf/", "time"))}
                                              for r in rows if "reward/mean" in r]
    return out


def test_a_study_with_cohorts_logs_what_it_logs_without(tmp_path) -> None:
    """Two W4A4 + INT4 KV arms of the laptop preset's quick form (2 steps), once with a rollout server for both
    and once each on its own engine: every logged number of every step equal, the rollout's log-prob gaps to
    float32 rounding of a batched product (tests/test_cohort.py). At step 2 the runs' weights differ (each its own
    correction's update), so a member answered with another's weights or rows would show."""
    from parity.commands.study import main

    arms = "w4a4+int4kv / none,w4a4+int4kv / dual / "
    common = ["--preset", "laptop", "--quick", "--arms", arms, "--concurrency", "2", "--outputs-dir", str(tmp_path),
              "--extra", PIN]
    with_c = main([*common, "--cohorts", "--tag", "cohort", "--out", str(tmp_path / "with")])
    assert with_c["failed"] == 0
    study = json.loads((tmp_path / "with" / "study.json").read_text())
    assert [len(c["members"]) for c in study["cohorts"]] == [2]
    assert "every member left" in (tmp_path / "with" / "logs" / "cohort0.log").read_text()
    without = main([*common, "--tag", "own", "--out", str(tmp_path / "without")])
    assert without["failed"] == 0
    a, b = _metrics(tmp_path, "cohort"), _metrics(tmp_path, "own")
    assert sorted(a) == sorted(b) and len(a) == 2
    for name in a:
        assert [r["step"] for r in a[name]] == [1, 2]
        for ra, rb in zip(a[name], b[name], strict=True):
            assert ra.keys() == rb.keys()
            for k in ra:
                if k.startswith("mismatch/") or k.startswith("correction/"):
                    assert ra[k] == pytest.approx(rb[k], abs=1e-4, rel=1e-3), (name, ra["step"], k)
                else:
                    assert ra[k] == rb[k], (name, ra["step"], k)


def test_server_options_without_cohorts_or_out_of_range_are_refused_before_anything_runs(tmp_path) -> None:
    from parity.commands.study import main

    common = ["--preset", "laptop", "--quick", "--arms", "w4a4+int4kv / none,w4a4+int4kv / dual / ", "--concurrency",
              "2", "--outputs-dir", str(tmp_path), "--out", str(tmp_path / "s")]
    with pytest.raises(ValueError, match="--cohort-sm-share is the rollout servers' SM share: it needs --cohorts"):
        main([*common, "--cohort-sm-share", "50"])
    with pytest.raises(ValueError, match="--cohort-sm-share 0: a percentage"):
        main([*common, "--cohorts", "--cohort-sm-share", "0"])
    with pytest.raises(ValueError, match="--cohort-max-runs is the size of a rollout server's cohort: it needs"):
        main([*common, "--cohort-max-runs", "4"])
    with pytest.raises(ValueError, match="--cohort-max-runs 1: a cohort is two or more runs"):
        main([*common, "--cohorts", "--cohort-max-runs", "1"])
    with pytest.raises(ValueError, match="--cohort-compile-threads is the rollout servers' compile workers: it needs"):
        main([*common, "--cohort-compile-threads", "4"])
    with pytest.raises(ValueError, match="--cohort-compile-threads: at least 1, got 0"):
        main([*common, "--cohorts", "--cohort-compile-threads", "0"])
    assert not (tmp_path / "models").exists() and not (tmp_path / "runs").exists()  # no warm start, no run
