"""A cohort's rollout server: the runs of one rollout format, each in its own process with its own trainer, sampling
through one CohortEngine (parity.rollout.cohort) in this one.

    python -m parity.rollout.cohort_server --address SOCKET --members N --model-dir MODEL [--ready FILE] -- OVERRIDES...

builds N engines of the configuration OVERRIDES on MODEL (every member's rollout engine as its own run would build
it) and listens on the Unix socket SOCKET for the N members, which join while it runs (calls wait until all have
joined or --join-timeout has passed: a run that failed before it connected does not hold the others forever). A
member is a run whose config sets `rollout.cohort=SOCKET#i`: `build_engine` then gives it a `CohortClient`, which
stands where its engine stood
(generate, update_weights, describe, close). The server answers a weight sync at once (into that member's engine;
the stacks are refreshed before the next decode) and holds a generate call until every connected member has one
waiting; then it decodes them as one cohort call (calls of different shapes or sampling, such as a held-out
evaluation beside a rollout, as one cohort call each, the members without such a call standing in with a copy of
another's and their rows dropped) and answers each member with its own batch. A member that exits leaves the
cohort; the server ends when none is left.

Messages are pickled by value (batches, CPU tensors), except a member's CUDA weights, which go as CUDA IPC handles
(multiprocessing's pickler with torch's reductions: the server reads the trainer's tensors on the device, no copy
through the host; the member keeps them alive until the server has answered). CPU tensors are not sent through
shared memory: torch shares those through multiprocessing's resource sharer, which only a parent and its children
can reach. The socket is local to the machine, its folder the study's; the connection is authenticated with a fixed
key against accidental cross-talk between studies, not against a hostile local user.
"""

from __future__ import annotations

import argparse
import pickle
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener, wait
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions with multiprocessing's pickler)

from parity.core.sampling import SamplingSpec
from parity.types import RolloutBatch

AUTHKEY = b"parity-cohort"
_T_START = time.perf_counter()  # this module imported (torch with it): the server's log counts its set-up from here


def parse_member(value: str) -> tuple[str, int]:
    """`rollout.cohort`'s value SOCKET#i -> (socket path, member index)."""
    address, sep, member = str(value).rpartition("#")
    if not sep or not address or not member.isdigit():
        raise ValueError(f"rollout.cohort: expected SOCKET#MEMBER (a socket path and a member index), got {value!r}")
    return address, int(member)


def _send(conn: Connection, obj: Any) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _signature(spec: SamplingSpec, rows: int) -> tuple:
    return (rows, spec.temperature, spec.top_p, spec.max_new_tokens, spec.topk_logprobs)


class CohortClient:
    """A run's rollout engine when its run is a cohort member: its calls go to the cohort's server."""

    name = "torch-cohort-member"

    def __init__(self, address: str, member: int, connect_timeout_s: float = 600.0) -> None:
        self.address, self.member = address, int(member)
        deadline = time.time() + connect_timeout_s
        failed = Path(address).with_suffix(".failed")
        while True:
            try:
                self.conn: Connection = Client(address, family="AF_UNIX", authkey=AUTHKEY)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if failed.is_file():  # the server could not start (parity.study.cohorts.serving starts the runs with it)
                    raise RuntimeError(f"rollout.cohort: the cohort server at {address} failed to start:\n"
                                       f"{failed.read_text()[-3000:]}") from None
                if time.time() > deadline:
                    raise TimeoutError(f"rollout.cohort: no cohort server at {address} after "
                                       f"{connect_timeout_s:.0f} s") from None
                time.sleep(0.2)
        _send(self.conn, {"member": self.member})
        self._describe = self._answer()
        self.ipc, self.ipc_error = True, None  # CUDA weights as IPC handles until the driver refuses one
        self._in_flight = False  # a generate call sent and its answer not yet read

    def _answer(self) -> Any:
        try:
            out = _recv(self.conn)
        except EOFError:
            raise RuntimeError(f"rollout.cohort: the cohort server at {self.address} closed the connection "
                               f"(member {self.member}); its log says why") from None
        if isinstance(out, dict) and "error" in out:
            raise RuntimeError(f"rollout.cohort: the cohort server failed on member {self.member}'s call:\n"
                               f"{out['error']}")
        return out

    def generate(self, prompt_token_ids: list[list[int]], spec: SamplingSpec,
                 prompt_ids: list[int] | None = None) -> RolloutBatch:
        return self.send_generate(prompt_token_ids, spec, prompt_ids)()

    def send_generate(self, prompt_token_ids: list[list[int]], spec: SamplingSpec,
                      prompt_ids: list[int] | None = None) -> Callable[[], RolloutBatch]:
        """Send a generate call and return at once; the returned function reads its batch (waiting for the server
        if it has not answered yet). The server holds one call of a member at a time: another call before the
        answer is read is refused here."""
        if self._in_flight:
            raise RuntimeError(f"rollout.cohort: member {self.member} sent a call before reading the answer to its "
                               "last one (the server holds one call of a member at a time)")
        _send(self.conn, ("generate", prompt_token_ids, spec, prompt_ids))
        self._in_flight = True
        answer: list = []

        def receive() -> RolloutBatch:
            if not answer:
                try:
                    answer.append(self._answer())
                finally:
                    self._in_flight = False
            return answer[0]

        return receive

    def update_weights(self, named_tensors: Any) -> float:
        if self._in_flight:
            raise RuntimeError(f"rollout.cohort: member {self.member} sent weights before reading the answer to its "
                               "generate call (that call samples the weights it was sent under)")
        tensors = [(k, v.detach()) for k, v in named_tensors]  # kept alive until the server has read them
        on_device = [(k, v) for k, v in tensors if v.is_cuda]
        blob = b""
        if on_device and self.ipc:
            try:
                blob = bytes(ForkingPickler.dumps(on_device))  # CUDA IPC handles
            except RuntimeError as e:  # memory the driver cannot share (some allocator settings): by value instead
                self.ipc, self.ipc_error = False, f"{type(e).__name__}: {e}"[:300]
        by_value = [(k, v) for k, v in tensors if not v.is_cuda or not blob]
        _send(self.conn, ("weights", by_value, blob))
        return float(self._answer())

    def describe(self) -> dict:
        return {**self._describe, "cohort_member": self.member,
                **({"cohort_weights_by_value": self.ipc_error} if self.ipc_error else {})}

    def close(self) -> None:
        try:
            _send(self.conn, ("bye",))
            self.conn.close()
        except OSError:
            pass


class CohortServer:
    """The server's state: the cohort, the members' connections, their waiting calls. Members join while the
    server runs (`listen` accepts them on a thread of its own); until every member has joined, or `join_timeout_s`
    has passed since `serve` began (a member whose run failed before it connected never will), calls wait."""

    def __init__(self, engines: list[Any], join_timeout_s: float = 600.0) -> None:
        from parity.rollout.cohort import CohortEngine

        self.engines = engines
        self.members = len(engines)
        self.cohort = CohortEngine(engines)
        self.conns: dict[int, Connection] = {}
        self.joined: set[int] = set()  # members that connected at some point
        self.arrivals: queue.Queue = queue.Queue()  # (member, connection) from the listening thread
        self.waiting: dict[int, tuple] = {}
        self.stale = False  # a member's weights changed since the stacks were copied
        self.join_timeout_s = join_timeout_s
        self.t0 = time.time()
        self.calls = 0  # cohort calls decoded

    def listen(self, listener: Listener) -> None:
        """Accept members until the listener closes (a thread's loop)."""
        while True:
            try:
                conn = listener.accept()
                hello = _recv(conn)
            except (OSError, EOFError):
                return
            m = hello.get("member") if isinstance(hello, dict) else None
            if not isinstance(m, int) or not 0 <= m < self.members:
                _send(conn, {"error": f"member {m!r}: expected an index in 0..{self.members - 1}"})
                conn.close()
                continue
            self.arrivals.put((m, conn))

    def _admit(self) -> None:
        while not self.arrivals.empty():
            m, conn = self.arrivals.get_nowait()
            if m in self.joined:
                _send(conn, {"error": f"member {m} has joined already"})
                conn.close()
                continue
            _send(conn, self.cohort.describe())
            self.conns[m] = conn
            self.joined.add(m)

    def everyone_in(self) -> bool:
        """Every member joined, or the time to join is over."""
        return len(self.joined) == self.members or time.time() - self.t0 > self.join_timeout_s

    def serve(self) -> None:
        self.t0 = time.time()
        while True:
            self._admit()
            if not self.conns and self.everyone_in():
                return  # the members that joined have left, and no other is coming
            ready = wait(list(self.conns.values()), timeout=0.5) if self.conns else []
            if not self.conns:
                time.sleep(0.1)
            for conn in ready:
                m = next(k for k, c in self.conns.items() if c is conn)
                try:
                    msg = _recv(conn)
                except (EOFError, OSError):
                    self._leave(m)
                    continue
                if msg[0] == "weights":
                    try:
                        named = msg[1] + (pickle.loads(msg[2]) if msg[2] else [])
                        seconds = self.engines[m].update_weights(named)
                        del named  # the member's CUDA tensors: released before it goes on
                        self.stale = True
                        _send(conn, seconds)
                    except Exception:  # noqa: BLE001 - the member's run fails with the server's traceback
                        _send(conn, {"error": traceback.format_exc()})
                elif msg[0] == "generate":
                    self.waiting[m] = msg[1:]
                else:
                    self._leave(m)
            if self.conns and set(self.waiting) >= set(self.conns) and self.everyone_in():
                self.decode()

    def _leave(self, m: int) -> None:
        self.conns.pop(m).close()
        self.waiting.pop(m, None)

    def decode(self) -> None:
        """Every live member has a call waiting: one cohort call per shape and sampling."""
        if self.stale:
            self.cohort.sync()
            self.stale = False
        groups: dict[tuple, list[int]] = {}
        for m, (ids, spec, _) in sorted(self.waiting.items()):
            groups.setdefault(_signature(spec, len(ids) * spec.n), []).append(m)
        for ms in groups.values():
            calls = [self.waiting.get(i) if i in ms else self.waiting[ms[0]] for i in range(self.cohort.runs)]
            try:
                t0 = time.perf_counter()
                batches = self.cohort.generate(calls)
                answers: dict[int, Any] = {m: batches[m] for m in ms}
                self.calls += 1
                tail, setup = batches[0].meta.get("decode_tail_rows"), batches[0].meta.get("decode_setup_s")
                # the server's own account of where a run's rollout time goes (the first calls compile and capture)
                print(f"cohort server: call {self.calls}: {len(ms)} of {self.cohort.runs} members, "
                      f"{batches[0].responses.shape[0]} rows each, "
                      f"{max(int(b.response_mask.sum(-1).max()) for b in batches)} steps, "
                      f"{time.perf_counter() - t0:.2f} s" + (f", tail rows {tail}" if tail else "")
                      + (f", set-up {setup}" if setup else ""), flush=True)
            except Exception:  # noqa: BLE001 - every member of the call fails with the traceback
                answers = {m: {"error": traceback.format_exc()} for m in ms}
            for m in ms:
                _send(self.conns[m], answers[m])
        self.waiting.clear()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    own, overrides = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(prog="python -m parity.rollout.cohort_server", description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", required=True, help="the Unix socket to listen on")
    ap.add_argument("--members", type=int, required=True)
    ap.add_argument("--model-dir", required=True, help="the members' starting weights (their warm start)")
    ap.add_argument("--ready", default=None, help="a file written once the socket listens")
    ap.add_argument("--join-timeout", type=float, default=600.0,
                    help="seconds the members have to join; calls wait for the missing ones until then")
    a = ap.parse_args(own)
    if a.members < 1:
        ap.error("--members: at least 1")
    from parity.config import load_config
    from parity.core.device import blocking_sync_from_env
    from parity.rollout import build_engine, is_perturbed, rollout_precision

    blocking_sync_from_env()
    cfg = load_config([*overrides, "rollout.cohort="])
    if is_perturbed(rollout_precision(cfg)):
        raise SystemExit("cohort server: a perturbed rollout draws its own Delta per run; it is not a cohort")
    t0 = time.perf_counter()
    engines, each = [], []
    for _ in range(a.members):
        t = time.perf_counter()
        engines.append(build_engine(cfg, a.model_dir, reference_dir=a.model_dir))
        each.append(round(time.perf_counter() - t, 1))
    t = time.perf_counter()
    server = CohortServer(engines, join_timeout_s=a.join_timeout)
    print(f"cohort server: {a.members} engines built in {time.perf_counter() - t0:.1f} s (each {each} s, the cohort's "
          f"stacks {time.perf_counter() - t:.1f} s; {time.perf_counter() - _T_START:.1f} s after this module's import)",
          flush=True)
    Path(a.address).parent.mkdir(parents=True, exist_ok=True)
    with Listener(a.address, family="AF_UNIX", authkey=AUTHKEY) as listener:
        threading.Thread(target=server.listen, args=(listener,), daemon=True).start()
        if a.ready:
            Path(a.ready).write_text(a.address)
        print(f"cohort server: {a.members} members of {server.cohort.describe()} on {a.address}", flush=True)
        server.serve()
    missing = sorted(set(range(a.members)) - server.joined)
    print("cohort server: every member left" + (f" (members {missing} never joined)" if missing else ""), flush=True)


def _main_or_record_failure() -> None:
    """main(); a failure before or while serving is also written to SOCKET's `.failed` file, where members waiting
    to connect read it (parity.study.cohorts.serving starts the runs while the servers build their engines)."""
    try:
        main()
    except BaseException as e:
        if not isinstance(e, SystemExit) or e.code not in (0, None):
            argv = sys.argv[1:]
            if "--address" in argv and argv.index("--address") + 1 < len(argv):
                failed = Path(argv[argv.index("--address") + 1]).with_suffix(".failed")
                failed.parent.mkdir(parents=True, exist_ok=True)
                failed.write_text(traceback.format_exc()[-4000:] if not isinstance(e, SystemExit) else str(e.code))
        raise


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    _main_or_record_failure()
