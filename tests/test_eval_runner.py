"""evaluate() end to end with the real torch engine on a tiny model trained to always answer
\\boxed{7}: the grades, the metrics, the JSONL and the prompt truncation are all known in advance."""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from parity.config.schema import DataConfig, EvalConfig, TinyModelConfig
from parity.data.benchmarks import load_benchmark
from parity.errors import ParityError
from parity.evaluation.runner import evaluate
from parity.rewards.grader import GraderPool, grade_answer

TEMPLATE = "{problem} Answer in \\boxed{{}}.\n"
CONTEXT = 256  # the tiny model's max_position_embeddings


def _train_constant_answer_model(path: Path):
    """A 2-layer tiny Qwen3 fitted (seconds) to reply `\\boxed{7}<eos>` to any prompt ending in the template."""
    from parity.models.tiny import build_tiny_model
    from parity.models.tokenizer import save_char_tokenizer

    model = build_tiny_model("qwen3", TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32))
    tok = save_char_tokenizer(path)
    texts = [TEMPLATE.format(problem=p.problem)[-120:] for p in load_benchmark("amc23")[:16]]
    texts += [TEMPLATE.format(problem=f"{a}+{3 * a}") for a in range(16)]
    target = tok("\\boxed{7}")["input_ids"] + [tok.eos_token_id]
    opt = torch.optim.AdamW(model.parameters(), lr=4e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(45):
        seqs = [tok(texts[i])["input_ids"] + target for i in torch.randint(0, len(texts), (8,), generator=gen).tolist()]
        width = max(map(len, seqs))
        ids = torch.full((8, width), tok.pad_token_id)
        att = torch.zeros((8, width), dtype=torch.long)
        labels = torch.full((8, width), -100)
        for r, s in enumerate(seqs):
            ids[r, :len(s)], att[r, :len(s)] = torch.tensor(s), 1
            labels[r, len(s) - len(target):len(s)] = torch.tensor(target)
        loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(str(path))
    return tok


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from parity.rollout.torch_engine import TorchEngine

    path = tmp_path_factory.mktemp("const7")
    tok = _train_constant_answer_model(path)
    engine = TorchEngine(path)
    with GraderPool(workers=2, timeout_s=5.0) as pool:
        yield engine, tok, pool
    engine.close()


def _cfg(**kw):
    return OmegaConf.structured(EvalConfig(**{"bootstrap": 200, **kw}))


DATA = OmegaConf.structured(DataConfig(prompt_template=TEMPLATE))


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_greedy_constant_answer_gives_known_metrics(setup, tmp_path):
    engine, tok, pool = setup
    suite = ["amc23", "aime24", "arithmetic"]
    cfg = _cfg(suite=suite, k=2, temperature=0.0, max_new_tokens=16, benchmarks={"amc23": {"k": 3}})
    data = OmegaConf.merge(DATA, {"arithmetic": {"n_test": 40, "max_level": 2}})
    s = evaluate(engine, tok, suite, cfg, tmp_path, data_cfg=data, grader=pool, progress=False)
    recs = _records(tmp_path)
    probs = {"amc23": load_benchmark("amc23"), "aime24": load_benchmark("aime24"),
             "arithmetic": load_benchmark("arithmetic", arithmetic_cfg=data.arithmetic)}
    k = {"amc23": 3, "aime24": 2, "arithmetic": 2}
    assert len(recs) == sum(len(probs[n]) * k[n] for n in suite)
    assert all(r["extracted"] == "7" and r["status"] in ("correct", "wrong") for r in recs)
    assert all(r["score"] == float(r["reference"] == "7") for r in recs)
    for name in suite:
        expected = sum(p.answer == "7" for p in probs[name]) / len(probs[name])
        row = s["benchmarks"][name]
        assert row["k"] == k[name] and row["problems"] == len(probs[name])
        for metric in ("avg@k", "pass@1", "pass@k", "maj@k"):  # greedy: every sample is the same
            assert row["metrics"][metric]["value"] == pytest.approx(expected), (name, metric)
        # prompts longer than the context minus the response budget were left-truncated, and counted
        too_long = sum(len(tok(TEMPLATE.format(problem=p.problem))["input_ids"]) > CONTEXT - 16 for p in probs[name])
        assert row["prompts_truncated"] == too_long
    assert s["benchmarks"]["amc23"]["metrics"]["avg@k"]["value"] == 4 / 40  # four AMC23 answers are 7.0
    assert s["benchmarks"]["amc23"]["prompts_truncated"] > 0
    assert s["macro"]["avg@k"]["value"] == pytest.approx(
        sum(s["benchmarks"][n]["metrics"]["avg@k"]["value"] for n in suite) / 3)
    assert s["grading"]["graded"] == len(recs) and s["grading"]["timeouts"] == 0
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["benchmarks"]["amc23"]["metrics"] == s["benchmarks"]["amc23"]["metrics"]
    assert "| amc23 | 40 | 3 | 10.0 [" in (tmp_path / "table.md").read_text()


def test_sampled_run_is_reproducible_and_matches_its_jsonl(setup, tmp_path):
    engine, tok, pool = setup
    suite = ["math500", "minerva_math"]
    cfg = _cfg(suite=suite, k=4, temperature=1.0, top_p=1.0, max_new_tokens=16, limit=6, seed=3)
    s1 = evaluate(engine, tok, suite, cfg, tmp_path / "a", data_cfg=DATA, grader=pool, progress=False)
    evaluate(engine, tok, suite, cfg, tmp_path / "b", data_cfg=DATA, grader=pool, progress=False)
    a, b = _records(tmp_path / "a"), _records(tmp_path / "b")
    assert a == b
    for name in suite:
        rows = [r for r in a if r["benchmark"] == name]
        assert len(rows) == 24
        mean = sum(r["score"] for r in rows) / len(rows)
        assert s1["benchmarks"][name]["metrics"]["avg@k"]["value"] == pytest.approx(mean)
    for r in a:  # every stored grade is what the single-process grader says about the stored response
        if not r["response_truncated"]:
            assert grade_answer(r["response"], r["reference"])[0] == r["score"]
        else:
            assert r["score"] == 0.0


def test_budget_larger_than_the_context_is_clamped_not_a_crash(setup, tmp_path):
    engine, tok, pool = setup
    cfg = _cfg(suite=["olympiadbench"], limit=3, max_new_tokens=32768, temperature=0.0)
    s = evaluate(engine, tok, ["olympiadbench"], cfg, tmp_path, data_cfg=DATA, grader=pool, progress=False)
    row = s["benchmarks"]["olympiadbench"]
    assert row["sampling"]["max_new_tokens_used"] == CONTEXT // 2 and row["sampling"]["prompt_budget"] == CONTEXT // 2
    assert row["prompts_truncated"] == 3
    cfg = _cfg(suite=["aime25"], limit=2, max_new_tokens=8, max_model_len=48)
    s = evaluate(engine, tok, ["aime25"], cfg, tmp_path / "b", data_cfg=DATA, grader=pool, progress=False)
    assert s["benchmarks"]["aime25"]["sampling"]["prompt_budget"] == 40


@pytest.mark.parametrize(("kw", "match"), [
    ({"suite": ["aime26"]}, r"`eval.suite`: unknown benchmark 'aime26'"),
    ({"suite": []}, r"`eval.suite`: empty"),
    ({"benchmarks": {"amc23": {"tempreature": 0.7}}}, r"`eval.benchmarks.amc23.tempreature`: unknown"),
    ({"benchmarks": {"amc24": {"k": 2}}}, r"`eval.benchmarks.amc24`: unknown benchmark"),
    ({"k": 0}, r"`eval.k`: must be >= 1"),
    ({"benchmarks": {"amc23": {"top_p": 1.5}}}, r"`eval.benchmarks.amc23.top_p`: must be in \(0, 1\]"),
    ({"prompt_template": "no placeholder"}, r"`eval.prompt_template`: must contain \{problem\}"),
    ({"ci_level": 1.0}, r"`eval.ci_level`"),
])
def test_bad_eval_config_names_the_key(setup, tmp_path, kw, match):
    engine, tok, pool = setup
    cfg = _cfg(**{"suite": ["amc23"], **kw})
    with pytest.raises(ParityError, match=match):
        evaluate(engine, tok, list(cfg.suite), cfg, tmp_path, data_cfg=DATA, grader=pool, progress=False)
