"""The decode path's long tail (rollout.compact_tail; parity.rollout.decode_state, `next_tail`): once at most half of a
call's rows (of every run, in a cohort) are still sampling, they go on in a state of half as many rows. Each row's
tokens are the whole batch's, its log-probs within float32's rounding of a product over fewer rows, on the decode
path's logic run eagerly on CPU (graphs off; the graphs are the device's to check): plain float32, simulated W4A4
with the packed INT4 cache (torch backend), the packed FP8 cache (its codes gathered as bytes), INT8 W8A8, and a
cohort of three runs."""

from __future__ import annotations

import pytest
import torch

from parity.config.schema import PrecisionConfig
from parity.core.sampling import SamplingSpec
from parity.rollout import cuda_decode, decode_state
from parity.rollout.cohort import CohortEngine
from tests.test_cohort import W4A4, W8A8, _calls, _engines
from tests.test_cpu_lanes import _threads

FIELDS = ("responses", "response_mask", "truncated", "topk_ids")


@pytest.fixture
def small_tail(monkeypatch):
    """Tail states down to 2 rows a run (a sixteenth of 32), up to 4 a call, the done flags looked at every 4 steps: the small test
    calls (32 rows a run, 64 tokens) go through several."""
    monkeypatch.setattr(cuda_decode, "_TAIL_MIN_ROWS", 2)
    monkeypatch.setattr(cuda_decode, "_TAIL_SHARE", 16)
    monkeypatch.setattr(cuda_decode, "_TAIL_LEVELS", 4)
    monkeypatch.setattr(cuda_decode, "_DONE_CHECK", 4)


def _long_calls(model_dir, n: int) -> list[tuple]:
    """`_calls`'s prompts, 8 samples each up to 64 tokens: the rows end at many different steps."""
    return [(c[0], SamplingSpec(temperature=1.0, max_new_tokens=64, n=8, topk_logprobs=3, seed=c[1].seed,
                                pad_prompts_to=c[1].pad_prompts_to), c[2]) for c in _calls(model_dir, n)]


def _same(got, ref) -> None:
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    # float32: a product over fewer rows may sum its K terms in another order (about K * 2^-24 relative)
    torch.testing.assert_close(got.rollout_logprobs, ref.rollout_logprobs, rtol=0, atol=1e-4)
    torch.testing.assert_close(got.topk_logprobs, ref.topk_logprobs, rtol=0, atol=1e-4)


FP8KV = PrecisionConfig(kv_cache="fp8_per_token_head")


@pytest.mark.parametrize("precision", [None, W4A4, W8A8, FP8KV],
                         ids=["fp32", "w4a4-packed-int4kv", "w8a8-int8", "packed-fp8kv"])
def test_the_tail_on_fewer_rows_gives_the_whole_batchs_tokens(small_tail, prepared_model, precision) -> None:
    (eng,) = _engines(prepared_model, precision, n=1)
    if precision in (W4A4, FP8KV):
        eng.kv_packed = True  # the packed cache on CPU (torch backend): its codes and scales move with the rows
    call = _long_calls(prepared_model, 1)[0]
    with _threads(1):
        ref = eng.cuda_decoder.generate(*call, use_graphs=False)
        eng.compact_tail = True
        got = eng.cuda_decoder.generate(*call, use_graphs=False)
        again = eng.cuda_decoder.generate(*call, use_graphs=False)  # the kept tail states, reused
    assert "decode_tail_rows" not in ref.meta and "+tail" not in ref.meta["decode_path"]
    assert got.meta["decode_path"] == "static_cache_eager+tail"  # the run's rollout path records the route
    rows = got.meta["decode_tail_rows"]
    assert rows and rows == sorted(rows, reverse=True) and rows[0] <= 16  # 32 rows: 16, then fewer
    _same(got, ref)
    _same(again, ref)
    assert again.meta["decode_tail_rows"] == rows
    if precision in (W4A4, FP8KV):
        assert got.meta["kv_cache_layout"] == "packed"
    # the rows really ended at different steps, some at the length limit: the tail had work to do
    lengths = ref.response_mask.sum(1)
    assert int(lengths.min()) < 16 and int(lengths.max()) > 32


def test_a_cohorts_tail_keeps_each_runs_rows_with_its_weights(small_tail, prepared_model) -> None:
    """Three runs of 32 rows: the tail state holds the same number of rows of every run (the batched products take
    run i's rows with run i's weights), as many as the run with the most unfinished rows needs."""
    engines = _engines(prepared_model, W4A4)
    calls = _long_calls(prepared_model, 3)
    calls = [(c[0], SamplingSpec(**{**c[1].__dict__, "pad_prompts_to": max(len(p) for x in calls for p in x[0])}),
              c[2]) for c in calls]
    with _threads(1):
        cohort = CohortEngine(engines)
        ref = cohort.generate(calls, fast=True, use_graphs=False)
        for e in engines:
            e.compact_tail = True
        cohort = CohortEngine(engines)
        got = cohort.generate(calls, fast=True, use_graphs=False)
    rows = got[0].meta["decode_tail_rows"]
    assert rows and all(r % 3 == 0 and r <= 48 for r in rows)
    for g, r in zip(got, ref, strict=True):
        _same(g, r)
    assert not torch.equal(got[0].responses, got[1].responses)


def test_no_tail_when_every_row_runs_to_the_end(small_tail, prepared_model) -> None:
    """Forced tokens without an end (a replay): no row finishes early, nothing moves."""
    (eng,) = _engines(prepared_model, None, n=1)
    eng.compact_tail = True
    call = _long_calls(prepared_model, 1)[0]
    with _threads(1):
        first = eng.cuda_decoder.generate(*call, use_graphs=False)
        forced = torch.full_like(first.responses, 6 if eng.eos_id == 5 else 5)
        replay = eng.cuda_decoder.replay(call[0], call[1], forced, call[2], use_graphs=False)
    assert "decode_tail_rows" not in replay.meta
    assert bool(replay.response_mask.all())



def test_the_tail_stops_after_its_levels(small_tail, prepared_model, monkeypatch) -> None:
    """_TAIL_LEVELS caps the smaller states a call goes through (each row count compiles the layers once more on
    the device)."""
    (eng,) = _engines(prepared_model, None, n=1)
    eng.compact_tail = True
    call = _long_calls(prepared_model, 1)[0]
    with _threads(1):
        rows = {lv: (monkeypatch.setattr(cuda_decode, "_TAIL_LEVELS", lv),
                     eng.cuda_decoder.generate(*call, use_graphs=False))[1] for lv in (1, 4)}
    assert len(rows[1].meta["decode_tail_rows"]) == 1 and len(rows[4].meta["decode_tail_rows"]) > 1
    _same(rows[1], rows[4])


def test_the_tail_keeps_a_quarter_of_a_runs_rows(small_tail, prepared_model, monkeypatch) -> None:
    """By default a tail state holds at least a quarter of a run's rows (_TAIL_SHARE 4): the row counts a call can
    go through are half and a quarter, which a run's first calls meet, not an eighth first met many steps later
    (each new row count compiles the layer functions again on the device, while the run, or a whole cohort, waits)."""
    monkeypatch.setattr(cuda_decode, "_TAIL_SHARE", 4)
    (eng,) = _engines(prepared_model, None, n=1)
    eng.compact_tail = True
    call = _long_calls(prepared_model, 1)[0]
    with _threads(1):
        ref = eng.cuda_decoder.generate(*call, use_graphs=False)
        monkeypatch.setattr(cuda_decode, "_TAIL_SHARE", 16)
        deeper = eng.cuda_decoder.generate(*call, use_graphs=False)
    rows = ref.response_mask.shape[0]
    assert ref.meta["decode_tail_rows"] and min(ref.meta["decode_tail_rows"]) == rows // 4
    assert min(deeper.meta["decode_tail_rows"]) < rows // 4  # the same call would have gone further down
    _same(ref, deeper)


def test_a_call_accounts_for_its_set_up(prepared_model) -> None:
    """The call that makes a state records its set-up seconds (the state, the prefill: on the device, the INT8
    tiles timed, the compile, and each graph captured), a run's summary keeps its first rollout's
    (`startup_detail.rollout0_setup_s`); a later call of the same shape, which replays, records none."""
    (eng,) = _engines(prepared_model, None, n=1)
    call = _long_calls(prepared_model, 1)[0]
    with _threads(1):
        first = eng.cuda_decoder.generate(*call, use_graphs=False)
        second = eng.cuda_decoder.generate(*call, use_graphs=False)
    setup = first.meta["decode_setup_s"]
    assert sorted(setup) == ["prefill", "state"] and all(v >= 0 for v in setup.values())  # no graphs on CPU
    assert "decode_setup_s" not in second.meta


@pytest.mark.parametrize("where", ["gather", "tail-step"])
def test_a_failing_tail_turns_itself_off_and_the_call_runs_on_the_whole_batch(small_tail, prepared_model, monkeypatch,
                                                                               where) -> None:
    """A tail state that fails (its gather, or a step on it) costs the call a second run on the whole batch, not
    the run: the engine's tail is turned off, the reason kept in every later batch's meta."""
    (eng,) = _engines(prepared_model, None, n=1)
    call = _long_calls(prepared_model, 1)[0]
    with _threads(1):
        ref = eng.cuda_decoder.generate(*call, use_graphs=False)
        if where == "gather":
            def gather(*_a, **_k):
                raise RuntimeError("no gather here")
            monkeypatch.setattr(decode_state, "gather_rows", gather)
        else:
            step = cuda_decode.CudaDecoder.step

            def failing_step(self, st, spec, L):
                if st.done.shape[0] < 32:
                    raise RuntimeError("no step on a tail state")
                return step(self, st, spec, L)
            monkeypatch.setattr(cuda_decode.CudaDecoder, "step", failing_step)
        eng.compact_tail = True
        got = eng.cuda_decoder.generate(*call, use_graphs=False)
    assert eng.compact_tail is False and "no " in got.meta["decode_tail_error"]
    assert "decode_tail_rows" not in got.meta and "+tail" not in got.meta["decode_path"]
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    assert torch.equal(got.rollout_logprobs, ref.rollout_logprobs)
