"""The dashboard in a real browser: `streamlit run` on 127.0.0.1 (a free port) over the stores of the session's
tiny sweep (two corrections x two seeds through `sweep/local`, tests/prefect_services.py), Debian's
chromium headless (installed with apt-get when missing), driven over the DevTools protocol. The Compare
page opened with the link the sweep printed renders its charts with the legend labels the sweep's
configs differ by ("none", "tis"); Runs, Benchmarks, Regression (after the nightly check of the sweep's model)
and Precision (the members' INT8 + INT4 KV validation reports) render too, without an exception or an error.
Screenshots of the five pages are saved (PARITY_SCREENSHOT_DIR keeps them: docs/dashboard/ holds committed ones)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

REPO = Path(__file__).resolve().parents[1]

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,1500", "--remote-debugging-port=0", "--remote-allow-origins=*"]
ERROR_JS = ("document.querySelectorAll('[data-testid=\"stException\"], [data-testid=\"stAlertContentError\"], "
            "[data-testid=\"stAlertContentWarning\"]').length")
WIDGETS_JS = ("document.querySelectorAll('[data-testid=\"stMultiSelect\"], [data-testid=\"stSlider\"], "
              "[data-testid=\"stCheckbox\"]').length")
CHART_JS = "document.querySelectorAll('[data-testid=\"stVegaLiteChart\"] canvas, [data-testid=\"stVegaLiteChart\"] svg').length"


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    # the test set-up: Debian's chromium (~16 s); a machine without apt or network skips with the reason
    try:
        subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "chromium"], check=True,
                       capture_output=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"chromium is not installed and `apt-get install -y chromium` failed: {e}")
    return shutil.which("chromium") or pytest.skip("chromium not found after apt-get install")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{url} did not answer within {timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


class Cdp:
    """Minimal DevTools client: one page target, request/response by id, events ignored."""

    def __init__(self, ws_url: str) -> None:
        from websockets.sync.client import connect

        self.ws = connect(ws_url, max_size=64 * 2**20, open_timeout=30)
        self.next_id = 0

    def call(self, method: str, timeout_s: float = 60.0, **params) -> dict:
        self.next_id += 1
        my_id = self.next_id
        self.ws.send(json.dumps({"id": my_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("id") == my_id:
                if "error" in msg:
                    raise AssertionError(f"CDP {method}: {msg['error']}")
                return msg["result"]

    def eval(self, expr: str):
        return self.call("Runtime.evaluate", expression=expr, returnByValue=True)["result"].get("value")

    def close(self) -> None:
        self.ws.close()


def open_chromium(browser: str, profile: Path, window: str = "1400,1500") -> tuple[subprocess.Popen, Cdp]:
    """Chromium headless on a fresh profile, and a DevTools connection to its page."""
    flags = [f for f in CHROMIUM_FLAGS if not f.startswith("--window-size")] + [f"--window-size={window}"]
    chrome = subprocess.Popen([browser, *flags, f"--user-data-dir={profile}", "about:blank"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    active = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 60
    while not active.is_file() or not active.read_text().strip():
        if time.monotonic() > deadline or chrome.poll() is not None:
            stop(chrome)
            raise AssertionError("chromium did not open its DevTools port")
        time.sleep(0.2)
    with urllib.request.urlopen(f"http://127.0.0.1:{int(active.read_text().split()[0])}/json/list", timeout=10) as r:
        page = next(t for t in json.load(r) if t["type"] == "page")
    return chrome, Cdp(page["webSocketDebuggerUrl"])


LEGEND_JS = ("Array.from(document.querySelectorAll('[data-testid=\"stVegaLiteChart\"] .role-legend-label text'))"
             ".map(t => t.textContent)")
TITLE_JS = "document.querySelector('h1') && document.querySelector('h1').innerText"
# the legend labels' boxes against their chart's: a label drawn whole lies inside it, and Vega cuts a label that
# would not fit with an ellipsis
LEGEND_FIT_JS = """Array.from(document.querySelectorAll('[data-testid="stVegaLiteChart"] svg')).flatMap(svg => {
  const box = svg.getBoundingClientRect();
  return Array.from(svg.querySelectorAll('.role-legend-label text')).map(t => {
    const r = t.getBoundingClientRect();
    return {text: t.textContent, inside: r.left >= box.left - 1 && r.right <= box.right + 1}; }); })"""
AXIS_JS = ("Array.from(document.querySelectorAll('[data-testid=\"stVegaLiteChart\"] .role-axis-label text'))"
           ".map(t => t.textContent)")
# Streamlit's toolbar: its menu, and the Deploy button a developer sees on localhost
TOOLBAR_JS = ("({menu: document.querySelectorAll('[data-testid=\"stMainMenu\"]').length, "
              "deploy: document.querySelectorAll('[data-testid=\"stAppDeployButton\"]').length, "
              "toolbar: document.querySelectorAll('[data-testid=\"stToolbar\"]').length})")
TABLE_JS = "document.querySelectorAll('[data-testid=\"stDataFrame\"] canvas').length"


def _wait(cdp: Cdp, ready, what: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s  # the first render imports mlflow and altair: slow on a loaded machine
    while not ready():
        assert time.monotonic() < deadline, f"{what} did not render"
        time.sleep(0.5)
    time.sleep(1.5)  # let vega and the table canvas finish drawing before the screenshot


def _shot(cdp: Cdp) -> bytes:
    shot = base64.b64decode(cdp.call("Page.captureScreenshot", format="png")["data"])
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 20_000
    return shot


def test_sweep_pages_render_in_chromium(sweep_store, sweep_regression, tmp_path):
    browser = chromium()
    port = free_port()
    env = {**os.environ, "PARITY_TRACKING_URI": sweep_store["tracking_uri"],
           "PARITY_REGISTRY_URL": sweep_store["registry_url"], "PARITY_OUTPUTS": sweep_store["outputs_dir"],
           "OMP_NUM_THREADS": "1"}
    # the link the sweep flow printed, on this test's port (read before the server starts: nothing to leave behind)
    link = urlsplit(sweep_store["compare_url"])
    compare_url = urlunsplit(link._replace(netloc=f"127.0.0.1:{port}"))
    app = subprocess.Popen([str(REPO / ".venv" / "bin" / "streamlit"), "run", str(REPO / "dashboards" / "app.py"),
                            "--server.address", "127.0.0.1", "--server.port", str(port), "--server.headless", "true",
                            "--browser.gatherUsageStats", "false"], env=env, cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    profile = tmp_path / "chromium-profile"
    chrome = None
    shots, seen = {}, {}
    try:
        wait_http(f"http://127.0.0.1:{port}/_stcore/health", 120, app)
        chrome, cdp = open_chromium(browser, profile)
        try:
            cdp.call("Page.enable")
            cdp.call("Page.navigate", url=compare_url)
            _wait(cdp, lambda: (cdp.eval(CHART_JS) or 0) >= 4 and (cdp.eval(WIDGETS_JS) or 0) >= 3
                  and len(cdp.eval(LEGEND_JS) or []) >= 8, "the Compare page's charts")
            shots["compare"] = _shot(cdp)
            seen["compare"] = {"title": cdp.eval(TITLE_JS), "errors": cdp.eval(ERROR_JS), "charts": cdp.eval(CHART_JS),
                               "legend": cdp.eval(LEGEND_JS), "fit": cdp.eval(LEGEND_FIT_JS),
                               "toolbar": cdp.eval(TOOLBAR_JS)}
            cdp.call("Page.navigate", url=f"http://127.0.0.1:{port}/")
            _wait(cdp, lambda: cdp.eval(TITLE_JS) == "Runs" and (cdp.eval(TABLE_JS) or 0) >= 1, "the Runs page")
            shots["runs"] = _shot(cdp)
            seen["runs"] = {"errors": cdp.eval(ERROR_JS)}
            cdp.call("Page.navigate", url=f"http://127.0.0.1:{port}/benchmarks")
            _wait(cdp, lambda: cdp.eval(TITLE_JS) == "Benchmarks" and (cdp.eval(CHART_JS) or 0) >= 1
                  and len(cdp.eval(LEGEND_JS) or []) >= 4, "the Benchmarks page")
            shots["benchmarks"] = _shot(cdp)
            seen["benchmarks"] = {"errors": cdp.eval(ERROR_JS), "legend": cdp.eval(LEGEND_JS),
                                  "fit": cdp.eval(LEGEND_FIT_JS)}
            # the quantized sweep's regression check and its validation reports
            for page, title in (("regression", "Benchmark regression checks"), ("precision", "Precision validation")):
                cdp.call("Page.navigate", url=f"http://127.0.0.1:{port}/{page}")
                _wait(cdp, lambda title=title: cdp.eval(TITLE_JS) == title and (cdp.eval(TABLE_JS) or 0) >= 1,
                      f"the {title} page")
                if page == "regression":  # its chart of the deltas over time, the axis drawn
                    _wait(cdp, lambda: len(cdp.eval(AXIS_JS) or []) >= 2, "the Regression page's chart")
                shots[page] = _shot(cdp)
                seen[page] = {"errors": cdp.eval(ERROR_JS), "text": cdp.eval("document.body.innerText"),
                              "axis": cdp.eval(AXIS_JS)}
        finally:
            cdp.close()
    finally:
        if chrome is not None:
            stop(chrome)
        stop(app)
    out = Path(os.environ.get("PARITY_SCREENSHOT_DIR", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    for name, shot in shots.items():
        (out / f"{name}.png").write_bytes(shot)
    c = seen["compare"]
    assert c["title"] == "Compare runs" and c["errors"] == 0, c
    assert c["charts"] >= 4  # reward, held-out accuracy and two mismatch measures
    # every chart's legend names the two corrections: the config key the sweep's members differ by, seeds grouped
    assert set(c["legend"]) == {"none", "tis"} and len(c["legend"]) == 2 * c["charts"], c["legend"]
    # each label drawn whole inside its chart
    assert c["fit"] and all(f["inside"] and not f["text"].endswith("…") for f in c["fit"]), c["fit"]
    # a read-only dashboard: Streamlit's toolbar without the Deploy button, even on localhost
    assert c["toolbar"]["toolbar"] >= 1 and c["toolbar"]["deploy"] == 0, c["toolbar"]
    assert seen["runs"]["errors"] == 0 and seen["benchmarks"]["errors"] == 0
    assert seen["regression"]["errors"] == 0 and "All 1 checks passed." in seen["regression"]["text"]
    # one check: its time axis in dates and minutes, not a millisecond tick such as '.389'
    times = [t for t in seen["regression"]["axis"] if re.fullmatch(r"\d\d-\d\d \d\d:\d\d", t)]
    assert len(times) >= 2 and not any(t.startswith(".") or t.startswith(":") for t in seen["regression"]["axis"]), \
        seen["regression"]["axis"]
    assert seen["precision"]["errors"] == 0 and "passed" in seen["precision"]["text"]
    assert {f"arith_tiny / int8+int4kv / {corr} / seed {s} @ step 2" for corr, s in (("none", 1), ("tis", 0))} | {
        f"arith_tiny / int8+int4kv / {corr} / seed {s} @ step 2 [{p}]" for corr, s in (("none", 0), ("tis", 1))
        for p in ("int8+int4kv", "bf16")} <= \
        set(seen["benchmarks"]["legend"])
    assert all(f["inside"] and not f["text"].endswith("…") for f in seen["benchmarks"]["fit"]), seen["benchmarks"]
