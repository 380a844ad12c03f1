"""The controlled mismatch dial (rollout.precision.perturbation): Delta = sigma * eps * |theta_0|, fixed or
redrawn at every weight sync, applied to the rollout engine only; and the drift probe cos(theta_t - theta_0, Delta)
against a float64 hand computation."""

from __future__ import annotations

import torch

from parity.config.schema import TinyModelConfig
from parity.core.sampling import SamplingSpec
from parity.models.tiny import build_tiny_model
from parity.models.tokenizer import save_char_tokenizer
from parity.precision.perturbation import DriftProbe, Perturbation, load_reference

SMALL = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16, max_position_embeddings=64)


def _model_dir(tmp_path):
    d = tmp_path / "m"
    save_char_tokenizer(d)
    build_tiny_model("qwen3", SMALL, seed=3).save_pretrained(str(d))
    return d


def _cfg(quick_cfg, sigma: float, mode: str = "fixed", *extra: str):
    return quick_cfg("model.dtype=float32", "trainer.device=cpu", f"rollout.precision.perturbation.sigma={sigma}",
                     f"rollout.precision.perturbation.mode={mode}", *extra)


def test_delta_is_sigma_scaled_fixed_or_redrawn(tmp_path) -> None:
    ref = load_reference(_model_dir(tmp_path))
    name = "model.layers.0.mlp.up_proj.weight"
    fixed = Perturbation(ref, 0.05, "fixed", seed=7)
    assert torch.equal(fixed.delta(name, 0), fixed.delta(name, 9))  # the same Delta after any number of syncs
    assert torch.equal(fixed.delta(name, 0), Perturbation(ref, 0.05, "fixed", seed=7).delta(name, 0))  # from seed
    assert not torch.equal(fixed.delta(name, 0), Perturbation(ref, 0.05, "fixed", seed=8).delta(name, 0))
    redraw = Perturbation(ref, 0.05, "redraw", seed=7)
    assert torch.equal(redraw.delta(name, 0), fixed.delta(name, 0))  # draw 0 is the starting one
    assert not torch.equal(redraw.delta(name, 1), redraw.delta(name, 0))
    assert torch.equal(redraw.delta(name, 1), Perturbation(ref, 0.05, "redraw", seed=7).delta(name, 1))
    # Delta / (sigma |theta_0|) is standard normal
    eps = torch.cat([(fixed.delta(n, 0) / (0.05 * t.abs())).reshape(-1)[t.reshape(-1) != 0] for n, t in ref.items()])
    assert abs(float(eps.mean())) < 0.02 and abs(float(eps.std()) - 1.0) < 0.02


def test_engine_samples_with_theta_plus_delta_after_every_sync(tmp_path, quick_cfg) -> None:
    from parity.rollout import build_engine

    d = _model_dir(tmp_path)
    ref = load_reference(d)
    p = Perturbation(ref, 0.02, "fixed", seed=0)
    engine = build_engine(_cfg(quick_cfg, 0.02), d, reference_dir=d)
    assert engine.describe()["perturbation"] == {"sigma": 0.02, "mode": "fixed", "seed": 0, "syncs": 0}
    params = dict(engine.model.named_parameters())
    for n, t in ref.items():
        assert torch.equal(params[n], t + p.delta(n, 0)), n
    new = {n: t * 1.01 for n, t in ref.items()}  # the trainer's next weights
    engine.update_weights(new.items())
    for n, t in new.items():
        assert torch.equal(params[n], t + p.delta(n, 0)), n  # the same Delta, re-applied
    redraw = build_engine(_cfg(quick_cfg, 0.02, "redraw"), d, reference_dir=d)
    pr = Perturbation(ref, 0.02, "redraw", seed=0)
    redraw.update_weights(new.items())
    rp = dict(redraw.model.named_parameters())
    for n, t in new.items():
        assert torch.equal(rp[n], t + pr.delta(n, 1)), n  # a new Delta at the sync
    assert not torch.equal(pr.delta("lm_head.weight", 1), pr.delta("lm_head.weight", 0))


def test_sigma_zero_is_bit_identical_to_no_perturbation(tmp_path, quick_cfg) -> None:
    from parity.rollout import build_engine
    from parity.rollout.torch_engine import TorchEngine

    d = _model_dir(tmp_path)
    plain = build_engine(_cfg(quick_cfg, 0.0), d)
    dialled = build_engine(_cfg(quick_cfg, 0.0), d, reference_dir=d)
    assert type(dialled) is TorchEngine and "perturbation" not in dialled.describe()
    spec = SamplingSpec(temperature=1.0, max_new_tokens=8, n=3, seed=5)
    a, b = plain.generate([[5, 6, 7], [8, 9]], spec), dialled.generate([[5, 6, 7], [8, 9]], spec)
    assert torch.equal(a.responses, b.responses) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    perturbed = build_engine(_cfg(quick_cfg, 0.05), d, reference_dir=d).generate([[5, 6, 7], [8, 9]], spec)
    assert not torch.equal(perturbed.rollout_logprobs, a.rollout_logprobs)


def test_perturbation_composes_with_a_quantized_engine(tmp_path, quick_cfg) -> None:
    """theta + Delta is what the quantized engine quantizes: the same codes as quantizing theta + Delta directly."""
    from parity.precision.linear import QuantLinear
    from parity.rollout import build_engine

    d = _model_dir(tmp_path)
    ref = load_reference(d)
    p = Perturbation(ref, 0.03, "fixed", seed=0)
    engine = build_engine(_cfg(quick_cfg, 0.03, "fixed", "+precision=w8a8_int8"), d, reference_dir=d)
    layer = engine.model.model.layers[0].mlp.up_proj
    assert isinstance(layer, QuantLinear)
    expect = QuantLinear.from_linear(torch.nn.Linear(32, 64, bias=False), "int8", "int8")
    expect.set_weight(ref["model.layers.0.mlp.up_proj.weight"] + p.delta("model.layers.0.mlp.up_proj.weight", 0))
    assert torch.equal(layer.weight, expect.weight) and torch.equal(layer.weight_scale, expect.weight_scale)


def test_drift_cosine_against_float64_by_hand(tmp_path) -> None:
    ref = load_reference(_model_dir(tmp_path))
    p = Perturbation(ref, 0.1, "fixed", seed=1)
    probe = DriftProbe(p, ref, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    theta = {n: t + 0.3 * p.delta(n, 0) + 0.01 * torch.randn(t.shape, generator=g) for n, t in ref.items()}
    step = torch.cat([(theta[n].double() - ref[n].double()).reshape(-1) for n in ref])
    delta = torch.cat([p.delta(n, 0).double().reshape(-1) for n in ref])
    expect = float(step @ delta / (step.norm() * delta.norm()))
    assert 0.1 < expect < 1.0
    assert abs(probe.cosine(theta.items(), draw=0) - expect) < 1e-12  # both float64 dot products: ~n 2^-53
    assert abs(probe.cosine(ref.items(), draw=0)) == 0.0  # no step taken


def test_a_short_perturbed_run_reports_the_dial_and_its_drift(quick_cfg) -> None:
    from parity.commands.train import train

    cfg = quick_cfg("model.dtype=float32", "rollout.precision.perturbation.sigma=0.05", "trainer.run_name=dial",
                    "trainer.eval_every=2")
    summary = train(cfg)
    assert summary["engine"]["perturbation"]["sigma"] == 0.05
    import json
    from pathlib import Path

    rows = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert all(-1.0 <= r["drift/delta_cosine"] <= 1.0 for r in steps)
    assert all(r["mismatch/abs_prob_diff_mean"] > 1e-4 for r in steps)  # the sampler really differs
    assert all(r["train/collapsed"] == 0.0 for r in steps) and summary["collapse_step"] is None
    # a perturbed rollout is evaluated beside the same weights unperturbed
    assert "eval/accuracy_unquantized" in rows[0] and "final_accuracy_unquantized" in summary


def test_delta_follows_the_run_seed_unless_fixed(tmp_path, quick_cfg) -> None:
    """perturbation.seed unset: each trainer.seed draws its own Delta (a study's seeds are independent draws of the
    bias, not one bias with several RL noises); set, every run shares it. The engine built from the config holds
    theta_0 + that Delta."""
    from parity.rollout import build_engine, rollout_precision

    d = _model_dir(tmp_path)
    ref = load_reference(d)
    name = "model.layers.0.mlp.up_proj.weight"

    def engine_delta(*extra: str) -> torch.Tensor:
        cfg = _cfg(quick_cfg, 0.05, "fixed", *extra)
        engine = build_engine(cfg, d, reference_dir=d)
        return dict(engine.model.named_parameters())[name].detach().float() - ref[name]

    assert rollout_precision(_cfg(quick_cfg, 0.05, "fixed", "trainer.seed=4")).perturbation.seed == 4
    s1, s2 = engine_delta("trainer.seed=1"), engine_delta("trainer.seed=2")
    # the engine holds theta_0 + Delta in float32: (theta_0 + Delta) - theta_0 is Delta up to one rounding of
    # theta_0 + Delta, u |theta_0 + Delta|: under 1e-6 while the weights stay below 16
    assert torch.allclose(s1, Perturbation(ref, 0.05, "fixed", seed=1).delta(name, 0), atol=1e-6)
    assert torch.allclose(s2, Perturbation(ref, 0.05, "fixed", seed=2).delta(name, 0), atol=1e-6)
    assert (s1 - s2).abs().max() > 1e-3
    pinned = [engine_delta(f"trainer.seed={s}", "rollout.precision.perturbation.seed=9") for s in (1, 2)]
    assert torch.equal(pinned[0], pinned[1])
    assert torch.allclose(pinned[0], Perturbation(ref, 0.05, "fixed", seed=9).delta(name, 0), atol=1e-6)
