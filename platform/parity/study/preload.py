"""A preloaded launcher: one process imports what every run imports (torch, transformers, Triton, the config
libraries; nothing of CUDA is touched) and forks a child for each run, which starts with those imports done.

Why: a study starts its runs and cohort servers at once, twenty processes each importing torch and transformers
for 17-25 s on a 16-core host (docs/PERFORMANCE.md), while the first processes to finish importing are already
compiling on the same cores. Forked from one preloaded process, a run's own imports are its parity modules.

    with Preloader(env) as pre:
        p = pre.popen(["-m", "parity", "train", ...], env=env, log=path, cwd=root)
        p.poll(); p.wait(timeout); p.kill()      # as subprocess.Popen's

The server (`python -m parity.study.preload SOCKET`) answers each launch request on its Unix socket with the
child's pid, and when the child exits, with its exit code on the same connection. A child gets the request's
environment (PYTHONPATH must be the server's: its imports came from there), working directory, argv and log file
(stdout and stderr), stdin from /dev/null, and settings that the preloaded modules read at import time are read
again from its environment (torch's thread count, Inductor's compile workers); OpenMP's wait policy is the
launcher's (PASSIVE unless its environment says otherwise, as `python -m parity` sets it). Python's `random` is
reseeded in every child (os.register_at_fork); a run seeds torch and numpy itself from its config."""

from __future__ import annotations

import argparse
import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

# what a run imports that costs seconds; parity's own modules are left to the child (a second or two, and they load
# with the child's environment in place)
MODULES = ("torch", "torch._dynamo", "torch._inductor.config", "transformers", "transformers.modeling_utils",
           "transformers.models.qwen3.modeling_qwen3", "safetensors.torch", "numpy", "omegaconf", "hydra", "triton")


class PreloadError(RuntimeError):
    pass


# ---- the server ----

def _preload(modules) -> dict:
    """Import `modules` (a missing optional one is skipped) and check that CUDA was not initialised (a child could
    not use it then). Returns {module: seconds or the ImportError}."""
    import importlib
    # torch.cuda.is_available() (which a module may call at import) then asks NVML instead of initialising the
    # CUDA driver, which a forked child could not use after its parent had
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    # what `python -m parity` sets before torch loads OpenMP (parity.__main__): OpenMP loads here, for every child
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    took = {}
    for m in modules:
        t0 = time.perf_counter()
        try:
            importlib.import_module(m)
            took[m] = round(time.perf_counter() - t0, 2)
        except ImportError as e:
            took[m] = f"not imported: {e}"[:200]
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise PreloadError("CUDA was initialised while preloading; a forked child could not use it")
    return took


def _child(req: dict, fds_to_close: list[int]) -> None:
    """In the forked child: become the requested run, then exit with its code (never returns)."""
    code = 1
    try:
        for fd in fds_to_close:
            os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log), os.close(null)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        if os.environ.get("PYTHONUNBUFFERED"):
            sys.stdout.reconfigure(line_buffering=True)
            sys.stderr.reconfigure(line_buffering=True)
        _settings_from_env()
        argv = list(req["argv"])
        if argv[:1] != ["-m"] or len(argv) < 2:
            raise PreloadError(f"argv must start with -m MODULE, got {argv[:2]}")
        import runpy
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = req["cwd"]  # `python -m` puts the working directory first
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the run's error goes to its log, as an interpreter would print it
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush(), sys.stderr.flush()
        finally:
            os._exit(code)


def _settings_from_env() -> None:
    """What the preloaded modules read from the environment at import time, read again from the child's."""
    torch = sys.modules.get("torch")
    if torch is not None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    cfg = sys.modules.get("torch._inductor.config")
    if cfg is not None and os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "").isdigit():
        cfg.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])


def _forked_cuda_check() -> str | None:
    """Where NVML sees a GPU: a forked child initialises CUDA and sums on it. None when it could; else why not."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():  # NVML's answer: the driver stays uninitialised here
        return None
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
            code = 0 if float(torch.ones(2, device="cuda").sum()) == 2.0 else 1
        except BaseException:  # noqa: BLE001 - printed to the launcher's log; the exit code says it failed
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return None if code == 0 else f"a forked child could not use CUDA (exit {code})"


def _threads() -> list[str]:
    """The names of this process's threads (Linux), the main one first."""
    task = "/proc/self/task"
    if not os.path.isdir(task):
        return []
    names = []
    for tid in sorted(os.listdir(task), key=int):
        try:
            names.append(Path(task, tid, "comm").read_text().strip())
        except OSError:
            continue
    return names


def quiet_fork_warning() -> None:
    """Python 3.12 warns at every fork of a process that has threads. The launcher has a few once the libraries are
    imported (OpenMP's and the allocator's helpers, idle: nothing runs in them while it forks; their names are in its
    log's first line), and forking is its whole purpose: one line in its log, not one per run."""
    warnings.filterwarnings("ignore", message=r".*multi-threaded, use of fork\(\) may lead to deadlocks",
                            category=DeprecationWarning)


def serve(address: str, modules=MODULES, ready: str | None = None) -> None:
    """Preload, check that a forked child can use CUDA (where there is a GPU), listen on `address`, fork a child
    per request until SIGTERM. Where the check fails, the ready file says why and the server exits: the client then
    starts plain processes."""
    took = _preload(modules)
    quiet_fork_warning()
    why = _forked_cuda_check()
    if why is not None:
        print(json.dumps({"preload": took, "usable": False, "why": why}), flush=True)
        if ready:
            Path(ready).write_text(json.dumps({"usable": False, "why": why}))
        return
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(address)
    srv.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}  # pid -> the connection that asked for it
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    names = _threads()
    print(json.dumps({"preload": took, "pid": os.getpid(), "threads": len(names) or None, "thread_names": names,
                      "pythonpath": os.environ.get("PYTHONPATH", "")}), flush=True)
    if ready:
        Path(ready).write_text(json.dumps({"usable": True, "preload": took}))
    while not stop:
        for _ in sel.select(timeout=0.1):
            conn, _ = srv.accept()
            try:
                req = json.loads(_read_line(conn))
                if req["env"].get("PYTHONPATH", "") != os.environ.get("PYTHONPATH", ""):
                    raise PreloadError(f"PYTHONPATH {req['env'].get('PYTHONPATH')!r} is not the launcher's "
                                       f"{os.environ.get('PYTHONPATH')!r} (its modules came from there)")
            except (ValueError, KeyError, OSError, PreloadError) as e:
                _send(conn, {"error": f"{type(e).__name__}: {e}"})
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                _child(req, [srv.fileno(), conn.fileno(), *(c.fileno() for c in children.values())])
            children[pid] = conn
            _send(conn, {"pid": pid})
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()
    srv.close()


def _read_line(conn: socket.socket) -> str:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf.decode()


def _send(conn: socket.socket, msg: dict) -> None:
    try:
        conn.sendall((json.dumps(msg) + "\n").encode())
    except OSError:
        pass  # the client went away; its child runs on


# ---- the client ----

class PreloadedProcess:
    """A child of the launcher, as much of subprocess.Popen as a study uses: pid, poll, wait, kill, terminate,
    returncode (-SIGNAL when killed by a signal, as Popen's)."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self._conn, self.pid, self.returncode = conn, pid, None
        self._buf = b""

    def _take(self, timeout: float | None) -> None:
        self._conn.settimeout(timeout)
        try:
            chunk = self._conn.recv(4096)
        except (TimeoutError, BlockingIOError):
            return
        if not chunk:  # the launcher went away: the child's code is lost; alive or not, by its pid
            if not _alive(self.pid):
                self.returncode = 255
            return
        self._buf += chunk
        if self._buf.endswith(b"\n"):
            self.returncode = int(json.loads(self._buf.decode().splitlines()[-1])["exit"])
            self._conn.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._take(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"preloaded pid {self.pid}", timeout)
            self._take(1.0 if left is None else min(left, 1.0))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Preloader:
    """The launcher's server process for one study or phase (a context manager): started with `env` (its
    PYTHONPATH the runs'), it imports while the caller goes on; `popen` waits for it to listen. Where the launcher
    cannot serve (it died, did not listen in time, or its forked child could not use CUDA), `popen` starts plain
    `python` processes instead and `fallback` says why (printed once)."""

    def __init__(self, env: dict, log: str | Path | None = None, modules=MODULES, timeout_s: float = 300.0) -> None:
        self._dir = tempfile.mkdtemp(prefix="parity-preload-")
        self.address = os.path.join(self._dir, "launch.sock")
        self._ready = os.path.join(self._dir, "ready")
        self.env, self.timeout_s = dict(env), timeout_s
        if log:
            Path(log).parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - closed in close()
        self._log = out
        self.proc = subprocess.Popen([sys.executable, "-m", "parity.study.preload", self.address, "--ready",
                                      self._ready, "--modules", ",".join(modules)], env=self.env, stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.t0 = time.time()
        self.preload_s: float | None = None
        self.fallback: str | None = None

    def _wait_ready(self) -> None:
        while not os.path.exists(self._ready):
            if self.proc.poll() is not None:
                raise PreloadError(f"the preloaded launcher exited with {self.proc.returncode} before listening")
            if time.time() - self.t0 > self.timeout_s:
                raise PreloadError(f"the preloaded launcher did not listen within {self.timeout_s} s")
            time.sleep(0.05)
        if self.preload_s is None:
            self.preload_s = round(time.time() - self.t0, 2)
            state = json.loads(Path(self._ready).read_text() or "{}")
            if not state.get("usable", False):
                raise PreloadError(state.get("why", "the preloaded launcher is not usable"))

    def popen(self, argv: list[str], env: dict, log: str | Path, cwd: str | Path):
        """Launch `python ARGV` (ARGV = -m MODULE ...) as a child of the launcher, stdout and stderr to `log`
        (a PreloadedProcess), or as a plain subprocess.Popen where the launcher cannot serve."""
        if self.fallback is None:
            try:
                self._wait_ready()
            except PreloadError as e:
                self.fallback = str(e)
                print(f"preload: {self.fallback}; runs start as plain processes", file=sys.stderr, flush=True)
        if self.fallback is not None:
            return start(argv, env, log, cwd)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.address)
        conn.sendall((json.dumps({"argv": list(argv), "env": dict(env), "cwd": str(cwd), "log": str(log)}) + "\n")
                     .encode())
        msg = json.loads(_read_line(conn) or "{}")
        if "pid" not in msg:
            conn.close()
            raise PreloadError(msg.get("error", "the preloaded launcher closed the connection"))
        return PreloadedProcess(conn, int(msg["pid"]))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        for f in (self.address, self._ready):
            Path(f).unlink(missing_ok=True)
        os.rmdir(self._dir) if os.path.isdir(self._dir) and not os.listdir(self._dir) else None

    def __enter__(self) -> Preloader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start(argv: list[str], env: dict, log: str | Path, cwd: str | Path, preloader: Preloader | None = None):
    """`python ARGV` (ARGV = -m MODULE ...) with stdout and stderr to `log`: forked from `preloader` when given
    (a PreloadedProcess), else a new interpreter (subprocess.Popen)."""
    if preloader is not None:
        return preloader.popen(argv, env=env, log=log, cwd=cwd)
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, *argv], env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=str(cwd))


def main() -> None:
    ap = argparse.ArgumentParser(description="the preloaded launcher's server (parity.study.preload)")
    ap.add_argument("address", help="Unix socket to listen on")
    ap.add_argument("--ready", help="file written once it listens")
    ap.add_argument("--modules", default=",".join(MODULES), help="modules to import first, comma-separated")
    a = ap.parse_args()
    serve(a.address, [m for m in a.modules.split(",") if m], a.ready)


__all__ = ["MODULES", "Preloader", "PreloadedProcess", "PreloadError", "serve", "start"]


if __name__ == "__main__":
    main()
