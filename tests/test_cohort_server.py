"""A cohort's rollout server (parity.rollout.cohort_server) as a real process on a Unix socket, its members as
clients: each member gets the batch its own engine gives (before and after its own weight sync, which travels
through shared memory), a member that leaves leaves the others going, and the server ends when none is left.
Members are threads of this process here (a real run is a process of its own; the protocol is the same)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from parity.config.schema import PrecisionConfig
from parity.core.sampling import SamplingSpec
from parity.rollout.cohort_server import CohortClient, parse_member
from parity.rollout.torch_engine import TorchEngine
from tests.conftest import QUICK

W4A4 = ["rollout.precision.weights=int4", "rollout.precision.activations=int4",
        "rollout.precision.kv_cache=int4_per_token_head"]
ROOT = Path(__file__).resolve().parents[1]


def _start(tmp_path: Path, model_dir: Path, members: int, *extra: str) -> tuple[subprocess.Popen, str]:
    sock, ready = str(tmp_path / "c.sock"), tmp_path / "ready"
    cmd = [sys.executable, "-m", "parity.rollout.cohort_server", "--address", sock, "--members", str(members),
           "--model-dir", str(model_dir), "--ready", str(ready), *extra, "--",
           f"outputs_dir={tmp_path}", *QUICK, "model.dtype=float32", "trainer.device=cpu", *W4A4]
    proc = subprocess.Popen(cmd, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() - t0 < 300, "cohort server did not start"
        time.sleep(0.2)
    return proc, sock


def _calls(model_dir: Path) -> list[tuple]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    calls = []
    for i in range(2):
        prompts = [tok(f"{a}+{b}{'+1' * i}=")["input_ids"] for a, b in ((3 + i, 50), (20, 41 - i), (37, 32))]
        calls.append((prompts, SamplingSpec(temperature=1.0, max_new_tokens=12, n=2, seed=5 + i, pad_prompts_to=12),
                      [7 * i + j for j in range(3)]))
    return calls


def _together(clients: list[CohortClient], calls: list[tuple]) -> list:
    out: list = [None] * len(clients)

    def go(i: int) -> None:
        out[i] = clients[i].generate(*calls[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


def _same(batch, ref) -> None:
    for f in ("responses", "response_mask", "truncated", "prompts", "group_ids"):
        assert torch.equal(getattr(batch, f), getattr(ref, f)), f
    # float32: a batched product against the run's own (see tests/test_cohort.py)
    torch.testing.assert_close(batch.rollout_logprobs, ref.rollout_logprobs, rtol=0, atol=1e-4)


def test_members_get_their_own_engines_batches_through_the_server(prepared_model, tmp_path) -> None:
    proc, sock = _start(tmp_path, prepared_model, 2)
    try:
        clients = [CohortClient(sock, i, connect_timeout_s=60) for i in range(2)]
        assert clients[1].describe()["cohort"] == 2 and clients[1].describe()["cohort_member"] == 1
        calls = _calls(prepared_model)
        own = [TorchEngine(prepared_model, precision=PrecisionConfig(weights="int4", activations="int4",
                                                                     kv_cache="int4_per_token_head"),
                           dtype=torch.float32, share_prefill=False) for _ in range(2)]
        for batch, eng, call in zip(_together(clients, calls), own, calls, strict=True):
            _same(batch, eng.generate(*call))
        # member 1's trainer moves its weights: they reach the server's engine 1 only
        ref = TorchEngine(prepared_model, dtype=torch.float32)
        g = torch.Generator().manual_seed(3)
        new = [(k, v + 0.05 * v.abs().mean() * torch.randn(v.shape, generator=g))
               for k, v in ref.model.state_dict().items() if v.is_floating_point()]
        assert clients[1].update_weights(new) >= 0.0
        own[1].update_weights(new)
        second = _together(clients, calls)
        for batch, eng, call in zip(second, own, calls, strict=True):
            _same(batch, eng.generate(*call))
        # a member leaves: the other still samples (its call no longer waits for it)
        clients[0].close()
        _same(clients[1].generate(*calls[1]), own[1].generate(*calls[1]))
        clients[1].close()
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "every member left" in out
        # its log's account: the engines' build, then each call's members, rows, steps and seconds
        assert "2 engines built in" in out and "call 1: 2 of 2 members, 6 rows each" in out, out[-2000:]
        assert "call 3: 1 of 2 members" in out  # after member 0 left
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_begun_rollout_samples_on_the_server_while_its_run_works(prepared_model, tmp_path) -> None:
    """The loop begins its first rollout before the warm start's evaluation: a member's LocalRollout sends the call
    and returns, the run goes on in its own process (here: its plain engine's evaluation-sized work), and `collect`
    reads the batch the server sampled meanwhile, the member's own engine's. The server holds one call of a member
    at a time, so a second call or a weight sync before the answer is read is refused, and the rollout side's own
    `generate` (a held-out evaluation through the rollout) first reads the begun call's answer."""
    from parity.training.local import LocalRollout
    proc, sock = _start(tmp_path, prepared_model, 2)
    try:
        sides = [LocalRollout(CohortClient(sock, i, connect_timeout_s=60), 0) for i in range(2)]
        calls = _calls(prepared_model)
        own = [TorchEngine(prepared_model, precision=PrecisionConfig(weights="int4", activations="int4",
                                                                     kv_cache="int4_per_token_head"),
                           dtype=torch.float32, share_prefill=False) for _ in range(2)]
        handles = [side.submit(c[0], c[1]) for side, c in zip(sides, calls, strict=True)]
        t0 = time.perf_counter()
        for side, h in zip(sides, handles, strict=True):
            side.begin(h)  # sent: returns without the batch (the server samples once both calls are in)
        assert time.perf_counter() - t0 < 5 and all(h.result is None and h.receive is not None for h in handles)
        with pytest.raises(RuntimeError, match="before reading the answer"):
            sides[0].engine.send_generate(*calls[0])
        with pytest.raises(RuntimeError, match="before reading the answer"):
            sides[0].engine.update_weights(list(own[0].model.state_dict().items())[:1])
        expected = [eng.generate(c[0], c[1], prompt_ids=list(range(len(c[0])))) for eng, c in zip(own, calls,
                                                                                                  strict=True)]
        for side, h, ref in zip(sides, handles, expected, strict=True):
            _same(side.collect(h).batch, ref)
        # begun again, then each member's rollout side asked for another call: the begun answer is read first
        handles = [side.submit(c[0], c[1]) for side, c in zip(sides, calls, strict=True)]
        for side, h in zip(sides, handles, strict=True):
            side.begin(h)
        out: list = [None, None]

        def evaluate(i: int) -> None:
            out[i] = sides[i].generate(*calls[i])

        threads = [threading.Thread(target=evaluate, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        for i in range(2):
            assert handles[i].result is not None  # read before the second call went out
            _same(out[i], own[i].generate(*calls[i]))
            _same(sides[i].collect(handles[i]).batch, expected[i])
        for side in sides:
            side.engine.close()
        out_text, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "every member left" in out_text
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_member_that_never_joins_holds_the_others_only_until_the_join_timeout(prepared_model, tmp_path) -> None:
    """Three members, of which one never connects (its run failed before it did): the two that joined wait for it
    until --join-timeout, then are served without it; a second member 1 is refused naming the index."""
    proc, sock = _start(tmp_path, prepared_model, 3, "--join-timeout", "4")
    try:
        clients = [CohortClient(sock, i, connect_timeout_s=60) for i in range(2)]
        with pytest.raises(RuntimeError, match="member 1 has joined already"):
            CohortClient(sock, 1, connect_timeout_s=60)
        calls = _calls(prepared_model)
        got = _together(clients, calls)
        assert all(b is not None for b in got)  # they waited for member 2 until the timeout, then went on
        own = TorchEngine(prepared_model, precision=PrecisionConfig(weights="int4", activations="int4",
                                                                    kv_cache="int4_per_token_head"),
                          dtype=torch.float32, share_prefill=False)
        _same(got[0], own.generate(*calls[0]))
        for c in clients:
            c.close()
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "members [2] never joined" in out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_bad_member_value_is_refused_naming_the_key() -> None:
    assert parse_member("/tmp/a.sock#3") == ("/tmp/a.sock", 3)
    for bad in ("/tmp/a.sock", "#1", "/tmp/a.sock#x"):
        with pytest.raises(ValueError, match="rollout.cohort: expected SOCKET#MEMBER"):
            parse_member(bad)
    with pytest.raises(TimeoutError, match="no cohort server at"):
        CohortClient("/nonexistent/dir/c.sock", 0, connect_timeout_s=0.5)


def test_servers_get_their_own_sm_share_and_a_bad_one_is_refused(prepared_model, tmp_path) -> None:
    """`serving(..., sm_share=P)` (--cohort-sm-share): the server's process starts with P as its MPS SM share while
    the runs keep theirs; a share outside 1-100 is refused before any server starts."""
    import os

    from parity.study.cohorts import Cohort, serving

    overrides = [f"outputs_dir={tmp_path}", *QUICK, "model.dtype=float32", "trainer.device=cpu", *W4A4]
    env = dict(os.environ, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="25", PYTHONPATH=f"{ROOT / 'platform'}:{ROOT}")
    cohort = Cohort(members=["a", "b"], overrides=overrides, model_dir=str(prepared_model),
                    address=str(tmp_path / "s.sock"))
    with pytest.raises(ValueError, match="--cohort-sm-share"):
        with serving([cohort], env, tmp_path / "logs", sm_share=0):
            pass
    assert cohort.proc is None
    with serving([cohort], env, tmp_path / "logs", sm_share=60, compile_threads=4) as (c,):
        environ = dict(kv.split("=", 1) for kv in Path(f"/proc/{c.proc.pid}/environ").read_text().split("\0") if kv)
        assert environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "60"
        assert environ["TORCHINDUCTOR_COMPILE_THREADS"] == "4"  # --cohort-compile-threads
    assert c.proc.poll() is not None  # stopped with the block
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"  # the runs' environment is left as it was
    assert env.get("TORCHINDUCTOR_COMPILE_THREADS") == os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    with pytest.raises(ValueError, match="--cohort-compile-threads: at least 1"):
        with serving([cohort], env, tmp_path / "logs", compile_threads=0):
            pass


def test_runs_start_while_their_servers_build_and_a_server_that_cannot_start_is_reported(prepared_model,
                                                                                           tmp_path) -> None:
    """`serving(..., wait=False)` (what `parity study --cohorts` does): every server starts at once and the block
    is entered before any listens, so the runs import and build their trainers while the servers build their
    engines; a member connects when its server listens. A server that cannot start writes why beside its socket,
    and a member waiting for it fails with that at once instead of waiting out its connect timeout."""
    import os

    from parity.study.cohorts import Cohort, serving

    overrides = [f"outputs_dir={tmp_path}", *QUICK, "model.dtype=float32", "trainer.device=cpu", *W4A4]
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'platform'}:{ROOT}")
    good = Cohort(members=["a", "b"], overrides=overrides, model_dir=str(prepared_model),
                  address=str(tmp_path / "good.sock"))
    bad = Cohort(members=["c", "d"], overrides=overrides, model_dir=str(tmp_path / "no_such_model"),
                 address=str(tmp_path / "bad.sock"))
    t0 = time.time()
    with serving([good, bad], env, tmp_path / "logs", wait=False):
        assert time.time() - t0 < 5 and not Path(good.address).with_suffix(".ready").exists()
        assert good.proc.poll() is None and bad.proc.poll() is None  # both started, neither waited for
        members = [CohortClient(good.address, i, connect_timeout_s=300) for i in range(2)]
        assert members[1].describe()["cohort_member"] == 1
        t1 = time.time()
        with pytest.raises(RuntimeError, match="failed to start") as err:
            CohortClient(bad.address, 0, connect_timeout_s=300)
        assert "no_such_model" in str(err.value) and time.time() - t1 < 120
        for m in members:
            m.close()
    assert good.proc.poll() is not None and bad.proc.poll() is not None
