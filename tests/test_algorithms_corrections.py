"""TIS / IcePop / MIS weights and masks and the DC-GRPO dual variable against hand computations;
checkpoint round trip; the configuration errors."""

from __future__ import annotations

import io
import math

import pytest
import torch
from omegaconf import OmegaConf

from parity.algorithms import StepMetrics, build_corrections, loss_denominators
from parity.algorithms.corrections import CorrectionContext
from parity.algorithms.corrections.dual import dual_update
from parity.config.schema import AlgorithmConfig, CorrectionConfig
from parity.types import RolloutBatch
from tests.helpers import rl_objective
from tests.tolerances import first_order_bound, float32_prob_error

NAN = float("nan")


def correction_config(**kw: object) -> CorrectionConfig:
    """`algorithm.correction`: its keys, each correction's section a plain mapping of its defaults."""
    return CorrectionConfig(**kw)  # type: ignore[arg-type]


def close(t: torch.Tensor, expected: list[list[float]]) -> bool:
    """Weights from float32 log-ratios: the two logs rounded to float32 (u |log| each), the subtraction and the
    sequence's sum of <= 3 (u of each), exp (1 ulp: 2 u), a clamp (exact): for these ratios (|log r| <= 1.7, q = 0.5)
    at most ~8 u = 5e-7 relative to the hand values, under rtol 1e-6 (element-wise: no order a kernel can change)."""
    return torch.allclose(t.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-7)


def ctx_from_ratios(ratios: list[list[float]], q: float = 0.5) -> CorrectionContext:
    """Sampled-token ratios p_train/p_inf per row; NaN marks padding (whose log-probs are garbage)."""
    r = torch.tensor(ratios, dtype=torch.float64)
    mask = ~torch.isnan(r)
    rollout = torch.where(mask, torch.full_like(r, math.log(q)), torch.tensor(-1e4, dtype=torch.float64))
    train = torch.where(mask, torch.log(r.nan_to_num(1.0)) + math.log(q), torch.tensor(3.0, dtype=torch.float64))
    return CorrectionContext(mask=mask, logprobs=train.float(), train_logprobs=train.float(), rollout_logprobs=rollout.float())


def single(name: str, **section: object):
    cfg = correction_config(name=name)
    for k, v in section.items():
        getattr(cfg, name.replace("seq_", ""))[k] = v
    return build_corrections(cfg).corrections[0]


def test_tis_token_and_sequence_weights_by_hand() -> None:
    ctx = ctx_from_ratios([[0.5, 3.0, NAN], [1.5, 1.0, 2.5]])
    tok = single("tis").weights(ctx)
    assert close(tok, [[0.5, 2.0, 0.0], [1.5, 1.0, 2.0]])
    seq = single("tis", level="sequence").weights(ctx)
    # row 0: 0.5 * 3 = 1.5 (padding's garbage ratio e^1e4 excluded); row 1: 1.5 * 1 * 2.5 = 3.75 -> 2
    assert close(seq, [[1.5, 1.5, 0.0], [2.0, 2.0, 2.0]])
    assert close(single("seq_tis", C=3.0).weights(ctx), [[1.5, 1.5, 0.0], [3.0, 3.0, 3.0]])
    m = StepMetrics()
    single("tis").record(ctx, m)
    assert m.compute()["correction/clipped_frac"] == pytest.approx(2 / 5)  # counts: exact, 2/5 rounded once


def test_icepop_weights_by_hand() -> None:
    ctx = ctx_from_ratios([[0.4, 3.0, NAN], [5.5, 1.0, 0.5]])
    w = single("icepop").weights(ctx)
    assert close(w, [[0.0, 3.0, 0.0], [0.0, 1.0, 0.5]])
    m = StepMetrics()
    single("icepop").record(ctx, m)
    assert m.compute()["correction/icepop_masked_frac"] == pytest.approx(2 / 5)  # counts: exact


def test_mis_sequence_masks_by_hand() -> None:
    ratios = [[0.5, 3.0, NAN], [1.01, 0.99, 1.0], [3.0, 3.0, NAN], [0.2, NAN, NAN]]
    ctx = ctx_from_ratios(ratios)
    # k1 = mean(-log r): row0 -log(1.5)/2 = -0.2027, row1 ~0, row2 -log 3 = -1.0986, row3 log 5 = 1.609
    k1 = single("mis", statistic="k1", threshold=0.1).keep_mask(ctx)
    assert k1.any(-1).tolist() == [False, True, False, False]
    assert single("mis", statistic="k1", threshold=0.25).keep_mask(ctx).any(-1).tolist() == [True, True, False, False]
    # k3 = mean(r - 1 - log r): row0 (0.19315 + 0.90139) / 2 = 0.5473
    k3_row0 = ((0.5 - 1 - math.log(0.5)) + (3 - 1 - math.log(3))) / 2  # thresholds 1e-4 away: ~1e3 x its rounding
    assert single("mis", statistic="k3", threshold=k3_row0 + 1e-4).keep_mask(ctx).any(-1).tolist() == [True, True, False, False]
    assert single("mis", statistic="k3", threshold=k3_row0 - 1e-4).keep_mask(ctx).any(-1).tolist() == [False, True, False, False]
    # geo_mean = exp(mean log r): sqrt(1.5) = 1.2247, ~1, 3, 0.2
    geo = single("mis", statistic="geo_mean", lo=0.5, hi=2.0).keep_mask(ctx)
    assert geo.any(-1).tolist() == [True, True, False, False]
    assert (geo <= ctx.mask).all()  # never keeps padding
    m = StepMetrics()
    single("mis", statistic="geo_mean").record(ctx, m)
    assert m.compute()["correction/mis_seq_masked_frac"] == pytest.approx(2 / 4)  # counts: exact


def _dual_batch(p_train: list[list[float]], p_inf: list[list[float]], adv: list[float]):
    pt, pi = torch.tensor(p_train), torch.tensor(p_inf)
    mask = ~torch.isnan(pt)
    b, r = pt.shape
    batch = RolloutBatch(prompts=torch.zeros(b, 1, dtype=torch.long), prompt_mask=torch.ones(b, 1, dtype=torch.bool),
                         responses=torch.zeros(b, r, dtype=torch.long), response_mask=mask,
                         rollout_logprobs=torch.log(pi.nan_to_num(1.0)), rewards=torch.zeros(b),
                         truncated=torch.zeros(b, dtype=torch.bool), group_ids=torch.zeros(b, dtype=torch.long),
                         prompt_ids=torch.zeros(b, dtype=torch.long))
    return batch, torch.log(pt.nan_to_num(1.0)), torch.tensor(adv)


def _objective(stack, batch, old, adv, metrics):
    hidden = torch.zeros(*batch.responses.shape, 2, requires_grad=True)
    weight = torch.zeros(3, 2, requires_grad=True)
    cfg = AlgorithmConfig(policy_loss="reinforce")
    return rl_objective(hidden, weight, batch, adv, old, 1.0, stack, cfg, loss_denominators(batch.response_mask), metrics)


@pytest.mark.parametrize("discrepancy", ["seq_mean", "token_mean"])
def test_dual_advantage_shift_and_lambda_update_by_hand(discrepancy: str) -> None:
    cfg = correction_config(name="dual")
    cfg.dual["discrepancy"] = discrepancy
    stack = build_corrections(cfg)
    # delta = |p_train - p_inf|: [[0.1, 0.05], [0.0, pad]]
    batch, old, adv = _dual_batch([[0.5, 0.9], [0.2, NAN]], [[0.4, 0.95], [0.2, NAN]], [1.0, -1.0])
    m = StepMetrics()
    _objective(stack, batch, old, adv, m)
    shifted = [1 - 0.1 * 0.1, 1 - 0.1 * 0.05, -1.0]
    # delta = |p_train - p_inf| from float32 log-probs (tolerances.float32_prob_error: <= 6 u of p), times lambda
    # = 0.1, then A - shift rounded in float32 (u of |A| = 1): within 1.4e-7 of the hand value, under rel 1e-6 of 0.33
    assert m.compute()["actor/advantage_mean"] == pytest.approx(sum(shifted) / 3, rel=1e-6)
    assert m.compute()["correction/lambda"] == 0.1
    # a second micro-batch of the same step: delta 0.3 on one token
    batch2, old2, adv2 = _dual_batch([[0.7]], [[0.4]], [0.5])
    _objective(stack, batch2, old2, adv2, m)
    out = stack.end_step()
    # by hand, as float64 formulas of the probabilities: each p reaches the correction through float32 (its
    # rounding, log, exp: tolerances.float32_prob_error), so the means are within the first-order bound of that
    p_t = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in ([0.5, 0.9], [0.2], [0.7])]
    p_i = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in ([0.4, 0.95], [0.2], [0.4])]
    deltas = [(t - i).abs() for t, i in zip(p_t, p_i)]  # [[0.1, 0.05], [0.0], [0.3]]
    if discrepancy == "token_mean":  # over the step's 4 response tokens
        mean_delta = torch.cat(deltas).mean()
    else:  # the paper's: each of the 3 trajectories' own mean, averaged
        mean_delta = torch.stack([d.mean() for d in deltas]).mean()
    err = first_order_bound(mean_delta, p_t + p_i, [float32_prob_error(x) for x in p_t + p_i])  # ~2e-7
    assert abs(out["correction/dual_delta_mean"] - mean_delta.item()) <= err
    # dual.c unset: c is algorithm.correction.tolerance, 0.0037 by default (the paper's); lambda moves by eta = 1
    # times the mean's error, and float64 adds rounding of ~1e-17
    assert abs(out["correction/lambda_next"] - (0.1 + 1.0 * (mean_delta.item() - 0.0037))) <= err + 1e-15
    assert out["correction/dual_c"] == 0.0037
    assert stack.corrections[0].lam == out["correction/lambda_next"]


def test_dual_c_of_its_own_wins_over_the_tolerance() -> None:
    cfg = correction_config(name="dual", tolerance=0.05)
    stack = build_corrections(cfg)
    assert stack.corrections[0].c == 0.05 and stack.tolerance == 0.05
    cfg.dual["c"] = 0.0037
    assert build_corrections(cfg).corrections[0].c == 0.0037


def test_tolerance_auto_measures_the_first_steps_then_holds() -> None:
    cfg = correction_config(name="dual", tolerance="auto", tolerance_multiple=2.0, tolerance_steps=2)
    stack = build_corrections(cfg)
    dual = stack.corrections[0]
    assert stack.tolerance is None and dual.c is None
    # step 1 and 2: one trajectory each, delta 0.1 then 0.3; lambda waits until c is known
    for p_train, lam in ((0.5, 0.1), (0.7, 0.1)):
        batch, old, adv = _dual_batch([[p_train]], [[0.4]], [1.0])
        m = StepMetrics()
        _objective(stack, batch, old, adv, m)
        assert "mismatch/frac_over_tol" not in m.compute()  # no tolerance yet: no over-tolerance fraction
        out = stack.end_step(m.compute())
        assert dual.lam == pytest.approx(lam)  # held at lambda0: exact
    # c = 2 mean(delta) from two deltas, |0.5 - 0.4| and |0.7 - 0.4|; by hand as a float64 formula of the
    # probabilities, each of which reaches the correction through float32 (tolerances.float32_prob_error)
    p = {x: torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (0.4, 0.5, 0.7, 0.9)}
    c = 2.0 * ((p[0.5] - p[0.4]).abs() + (p[0.7] - p[0.4]).abs()) / 2
    nxt = 0.1 + ((p[0.9] - p[0.4]).abs() - c)  # step 3: delta 0.5 against the measured c, eta = 1
    errs = [float32_prob_error(x) for x in p.values()]
    c_err, nxt_err = (first_order_bound(v, list(p.values()), errs) for v in (c, nxt))  # ~5e-7, ~8e-7
    c = c.item()
    assert abs(stack.tolerance - c) <= c_err and abs(dual.c - c) <= c_err
    assert abs(out["correction/tolerance"] - c) <= c_err
    # step 3 updates lambda against the measured c; the state carries c over a resume
    batch, old, adv = _dual_batch([[0.9]], [[0.4]], [1.0])
    _objective(stack, batch, old, adv, StepMetrics())
    out = stack.end_step({})
    assert abs(out["correction/lambda_next"] - nxt.item()) <= nxt_err
    again = build_corrections(cfg)
    again.load_state_dict(stack.state_dict())
    assert again.tolerance == stack.tolerance and again.corrections[0].c == dual.c  # carried: exact


def test_tolerance_auto_takes_a_validated_discrepancy_and_refuses_nonsense() -> None:
    cfg = correction_config(name="dual", tolerance="auto", tolerance_multiple=1.5)
    stack = build_corrections(cfg, measured_discrepancy=0.004)
    # 1.5 * 0.004 in float64 against the decimal 0.006: one rounding
    assert stack.tolerance == pytest.approx(0.006) and stack.corrections[0].c == pytest.approx(0.006)
    with pytest.raises(ValueError, match="algorithm.correction.tolerance"):
        build_corrections(correction_config(name="dual", tolerance="often"))
    cfg = correction_config(name="dual")
    cfg.dual["discrepancy"] = "median"
    with pytest.raises(ValueError, match="algorithm.correction.dual.discrepancy"):
        build_corrections(cfg)


def test_dual_lambda_clamps() -> None:
    assert dual_update(0.1, mean_delta=0.0, c=0.5, eta=1.0, lambda_max=10.0) == 0.0
    assert dual_update(0.1, mean_delta=5.0, c=0.0, eta=1.0, lambda_max=0.2) == 0.2
    cfg = correction_config(name="dual")
    cfg.dual["c"], cfg.dual["lambda_max"] = 0.0, 0.25
    stack = build_corrections(cfg)
    batch, old, adv = _dual_batch([[0.9]], [[0.1]], [1.0])
    for _ in range(3):
        _objective(stack, batch, old, adv, StepMetrics())
        lam = stack.end_step()["correction/lambda_next"]
    assert lam == 0.25


def test_dual_state_survives_checkpoint_exactly() -> None:
    cfg = correction_config(name="tis+dual")
    cfg.dual["eta"] = 0.37
    stack = build_corrections(cfg)
    batch, old, adv = _dual_batch([[0.5, 0.9], [0.2, NAN]], [[0.41, 0.95], [0.23, NAN]], [1.0, -1.0])
    for _ in range(3):
        _objective(stack, batch, old, adv, StepMetrics())
        stack.end_step()
    _objective(stack, batch, old, adv, StepMetrics())  # a half-accumulated step is state too
    buf = io.BytesIO()
    torch.save(stack.state_dict(), buf)
    buf.seek(0)
    resumed = build_corrections(cfg)
    resumed.load_state_dict(torch.load(buf))
    assert resumed.corrections[1].lam == stack.corrections[1].lam
    assert resumed.end_step() == stack.end_step()
    with pytest.raises(ValueError, match="no state for correction 'dual'"):
        build_corrections(cfg).load_state_dict({"version": 1, "names": ["tis"], "corrections": {"tis": {}}})


def test_build_accepts_dictconfig_and_composes() -> None:
    dc = OmegaConf.structured(correction_config(name="score_centering + tis"))
    stack = build_corrections(dc, policy_loss="reinforce", topk_logprobs=8)
    assert stack.names == ["score_centering", "tis"] and stack.needs_topk and stack.is_weight is not None
    assert build_corrections(OmegaConf.create({"name": "none"})).names == ["none"]


@pytest.mark.parametrize(("cfg", "kwargs", "match"), [
    ({"name": "foo"}, {}, r"algorithm\.correction\.name: unknown correction 'foo'"),
    ({"name": "tis++dual"}, {}, r"algorithm\.correction\.name: empty part"),
    ({"name": "tis+tis"}, {}, r"algorithm\.correction\.name: a correction appears twice"),
    ({"name": "tis+icepop"}, {}, r"at most one importance-weight correction"),
    ({"name": "dual", "dual": {"c": -0.1}}, {}, r"algorithm\.correction\.dual\.c: the tolerance must be >= 0"),
    ({"name": "none", "tolerance": -1.0}, {}, r"algorithm\.correction\.tolerance"),
    ({"name": "tis", "tis": {"C": -2.0}}, {}, r"algorithm\.correction\.tis\.C"),
    ({"name": "tis", "tis": {"C": 2.0, "bogus": 1}}, {}, r"algorithm\.correction\.tis\.bogus`: unknown key"),
    ({"name": "tis", "tis": {"C": "lots"}}, {}, r"algorithm\.correction\.tis\.C`: Value 'lots' .* to Float"),
    ({"name": "icepop", "icepop": {"lo": 2.0, "hi": 1.0}}, {}, r"algorithm\.correction\.icepop\.hi"),
    ({"name": "mis", "mis": {"statistic": "k2"}}, {}, r"algorithm\.correction\.mis\.statistic"),
    ({"name": "score_centering"}, {"policy_loss": "ppo_clip"}, r"algorithm\.policy_loss: score_centering"),
    ({"name": "score_centering"}, {"topk_logprobs": 0}, r"rollout\.topk_logprobs"),
    ({"name": "score_centering+tis", "tis": {"level": "sequence"}}, {}, r"algorithm\.correction\.tis\.level"),
    ({"name": "score_centering+seq_tis"}, {}, r"seq_tis weights whole responses; use tis with "
                                             r"algorithm\.correction\.tis\.level=token"),
])
def test_bad_configs_name_the_key(cfg: dict, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_corrections(OmegaConf.create(cfg), **kwargs)


def test_score_centering_errors_at_run_time() -> None:
    batch, old, adv = _dual_batch([[0.5]], [[0.4]], [1.0])
    stack = build_corrections(correction_config(name="score_centering"))
    with pytest.raises(ValueError, match="score_centering but the batch has no top-K log-probs"):
        _objective(stack, batch, old, adv, StepMetrics())
    hidden = torch.zeros(1, 1, 2, requires_grad=True)
    with pytest.raises(ValueError, match="algorithm.policy_loss"):
        rl_objective(hidden, torch.zeros(3, 2), batch, adv, old, 1.0, stack, AlgorithmConfig(policy_loss="ppo_clip"),
                     loss_denominators(batch.response_mask), StepMetrics())


def _grouped_batch(p_train: list[list[float]], p_inf: list[list[float]], adv: list[float], groups: list[int]):
    batch, old, a = _dual_batch(p_train, p_inf, adv)
    batch.group_ids = torch.tensor(groups, dtype=torch.long)
    return batch, old, a


def test_dual_centered_shift_is_the_group_standardised_gap_by_hand() -> None:
    """A'_i = A_i - lambda z_i, z_i = (g_i - mean_group g) / (std_group g + 1e-6), g_i = the response's mean
    |p_train - p_inf|: computed in float64 by hand. The shift sums to zero over each group (no push on the sampled
    tokens on average), a response alone in its group is not shifted, and the logged ratio mean |shift| / mean |A|
    is the one of the hand computation."""
    cfg = correction_config(name="dual_centered")
    cfg.dual_centered["c"] = 0.05
    cfg.dual_centered["lambda0"] = 0.5
    stack = build_corrections(cfg)
    pt = [[0.5, 0.9, NAN], [0.2, 0.6, 0.3], [0.8, NAN, NAN], [0.7, 0.7, NAN]]
    pi = [[0.4, 0.95, NAN], [0.2, 0.3, 0.3], [0.5, NAN, NAN], [0.1, 0.7, NAN]]
    adv = [1.0, -1.0, 0.5, 2.0]
    groups = [0, 0, 0, 1]  # group 1 has one response: not centred
    batch, old, a = _grouped_batch(pt, pi, adv, groups)
    gaps = [(0.1 + 0.05) / 2, (0.0 + 0.3 + 0.0) / 3, 0.3 / 1, (0.6 + 0.0) / 2]
    g0 = gaps[:3]
    mu = sum(g0) / 3
    sd = math.sqrt(sum((x - mu) ** 2 for x in g0) / 3)
    z = [(x - mu) / (sd + 1e-6) for x in g0] + [0.0]
    m = StepMetrics()
    _objective(stack, batch, old, a, m)
    got = m.compute()
    lengths = [2, 3, 1, 2]
    shifted = sum((adv[i] - 0.5 * z[i]) * lengths[i] for i in range(4)) / sum(lengths)
    # Each p reaches the correction through float32 (tolerances.float32_prob_error). Propagated to first order
    # through the standardisation (tolerances.first_order_bound of these formulas written in torch) plus the float32
    # rounding of shift and A - shift (u of |A| + |shift| a token), the three metrics below are within 3.3e-7 of the
    # hand values and D within 1.93e-7: under rel 1e-5 (>= 1.2e-6 here) and rel 1e-6 of D = 0.194 (1.94e-7). No
    # order a kernel picks enters: the sums are float64.
    assert got["actor/advantage_mean"] == pytest.approx(shifted, rel=1e-5)
    assert sum(z[:3]) == pytest.approx(0.0, abs=1e-9)  # over a group's responses the shifts sum to zero (float64)
    shift_abs = sum(abs(0.5 * z[i]) * lengths[i] for i in range(4))
    adv_abs = sum(abs(adv[i]) * lengths[i] for i in range(4))
    assert got["correction/shift_over_adv"] == pytest.approx(shift_abs / adv_abs, rel=1e-5)
    assert got["correction/adv_shift_mean"] == pytest.approx(0.5 * sum(z[i] * lengths[i] for i in range(4)) / 8,
                                                               rel=1e-5)
    # lambda <- clip(lambda + eta (D - c) / c, 0, lambda_max), D = mean over responses of g
    out = stack.end_step()
    D = sum(gaps) / 4
    assert out["correction/dual_delta_mean"] == pytest.approx(D, rel=1e-6)
    assert out["correction/lambda_next"] == pytest.approx(min(max(0.5 + (D - 0.05) / 0.05, 0.0), 2.0), rel=1e-6)  # 2.0


def test_dual_centered_tolerance_is_a_quantile_of_the_first_steps_gaps() -> None:
    """c unset: the `quantile` of the per-response gaps of the first `calibration_steps` steps (from a histogram of
    log10 gaps: within its 0.02-decade bins of numpy's quantile), lambda held at lambda0 until then; then it moves
    against that c, and a resumed correction carries c and lambda."""
    import numpy as np

    cfg = correction_config(name="dual_centered")
    cfg.dual_centered["calibration_steps"] = 2
    cfg.dual_centered["quantile"] = 0.5
    stack = build_corrections(cfg)
    dual = stack.corrections[0]
    rng = np.random.default_rng(0)
    seen = []
    for _ in range(2):
        p_inf = rng.uniform(0.2, 0.8, size=(16, 1))
        p_train = p_inf + rng.choice([-1, 1], size=(16, 1)) * rng.uniform(1e-3, 0.1, size=(16, 1))
        seen.extend(np.abs(p_train - p_inf).ravel().tolist())
        batch, old, a = _grouped_batch(p_train.tolist(), p_inf.tolist(), [1.0] * 16, [k // 4 for k in range(16)])
        _objective(stack, batch, old, a, StepMetrics())
        stack.end_step()
        assert dual.lam == pytest.approx(0.1)
    assert dual.c == pytest.approx(float(np.quantile(seen, 0.5)), rel=0.05)
    batch, old, a = _grouped_batch([[0.9]], [[0.4]], [1.0], [0])
    _objective(stack, batch, old, a, StepMetrics())
    out = stack.end_step()
    assert out["correction/lambda_next"] == pytest.approx(min(0.1 + (0.5 - dual.c) / dual.c, 2.0), rel=1e-6)
    again = build_corrections(cfg)
    again.load_state_dict(stack.state_dict())
    assert again.corrections[0].c == dual.c and again.corrections[0].lam == dual.lam


def test_dual_centered_config_errors_name_the_key() -> None:
    for key, value in (("quantile", 1.5), ("c", -1.0), ("calibration_steps", 0), ("lambda0", 5.0)):
        cfg = correction_config(name="dual_centered")
        cfg.dual_centered[key] = value
        with pytest.raises(ValueError, match=f"algorithm.correction.dual_centered.{key}"):
            build_corrections(cfg)


def test_composition_rules_come_from_what_each_partner_declares() -> None:
    """Score centering refuses any partner that weights tokens without a token-level IS rule, by what the partner
    declares (weights_tokens, provides_token_is_weight, token_level_setting), not by its name."""
    from parity.algorithms import Correction, CorrectionStack

    class ResponseWeight(Correction):  # weights whole responses, and no setting makes it token-level
        name = "response_weight"

        def weights(self, ctx: CorrectionContext) -> torch.Tensor:
            return ctx.mask.float()

    sc = single("score_centering")
    assert ResponseWeight().weights_tokens and not ResponseWeight().provides_token_is_weight
    with pytest.raises(ValueError, match=r"^algorithm\.correction: score_centering composes only with token-level IS "
                                         r"weights, and response_weight weights whole responses$"):
        CorrectionStack([sc, ResponseWeight()], 0.0).check("reinforce", 8)
    CorrectionStack([sc, single("icepop")], 0.0).check("reinforce", 8)  # a token-level rule composes
    CorrectionStack([sc, single("dual")], 0.0).check("reinforce", 8)  # a partner that weights nothing composes


def test_tolerance_and_top_k_are_part_of_every_correction() -> None:
    stack = build_corrections(OmegaConf.create({"name": "score_centering+tis+dual", "tolerance": "auto",
                                                "score_centering": {"top_k": 5}}),
                              policy_loss="reinforce", topk_logprobs=8)
    assert [c.top_k for c in stack] == [5, 0, 0] and stack.top_k == 5
    assert stack.tolerance is None and all(c.tolerance is None for c in stack)  # auto: not measured yet
    stack.set_tolerance(0.01)
    assert all(c.tolerance == 0.01 for c in stack) and stack.corrections[2].c == 0.01  # the dual takes it up
