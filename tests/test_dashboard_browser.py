"""The dashboard in a real browser: `streamlit run` on 127.0.0.1 (a free port), Debian's chromium headless
(installed with apt-get when missing), driven over the DevTools protocol: wait for the Compare page's
chart to render, save a screenshot, check the chart exists and the page shows no error."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_dashboard_pages import build_stores  # noqa: E402  (the same session-wide stores)

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,1800", "--remote-debugging-port=0", "--remote-allow-origins=*"]
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


@pytest.fixture(scope="session")
def stores(quick_cfg, outputs_dir: Path, prepared_model) -> dict:
    return build_stores(quick_cfg, outputs_dir)


def test_compare_page_renders_chart_in_chromium(stores, tmp_path):
    browser = chromium()
    port = free_port()
    env = {**os.environ, "PARITY_TRACKING_URI": stores["tracking_uri"], "PARITY_REGISTRY_URL": stores["registry_url"],
           "PARITY_OUTPUTS": stores["outputs_dir"], "OMP_NUM_THREADS": "1"}
    app = subprocess.Popen([str(REPO / ".venv" / "bin" / "streamlit"), "run", str(REPO / "dashboards" / "app.py"),
                            "--server.address", "127.0.0.1", "--server.port", str(port), "--server.headless", "true",
                            "--browser.gatherUsageStats", "false"], env=env, cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    profile = tmp_path / "chromium-profile"
    chrome = None
    try:
        wait_http(f"http://127.0.0.1:{port}/_stcore/health", 120, app)
        chrome = subprocess.Popen([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        active = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not active.is_file() or not active.read_text().strip():
            assert time.monotonic() < deadline and chrome.poll() is None, "chromium did not open its DevTools port"
            time.sleep(0.2)
        cdp_port = int(active.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{cdp_port}/json/list", timeout=10) as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        cdp = Cdp(page["webSocketDebuggerUrl"])
        try:
            cdp.call("Page.enable")
            cdp.call("Page.navigate", url=f"http://127.0.0.1:{port}/compare")
            deadline = time.monotonic() + 240  # first render imports mlflow and altair: slow on a loaded machine
            while (cdp.eval(CHART_JS) or 0) < 4 or (cdp.eval(WIDGETS_JS) or 0) < 3:
                assert time.monotonic() < deadline, "the Compare page's chart did not render"
                time.sleep(0.5)
            time.sleep(1.0)  # let vega finish drawing before the screenshot
            shot = base64.b64decode(cdp.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"])
            charts, errors = cdp.eval(CHART_JS), cdp.eval(ERROR_JS)
            title = cdp.eval("document.querySelector('h1') && document.querySelector('h1').innerText")
        finally:
            cdp.close()
    finally:
        if chrome is not None:
            stop(chrome)
        stop(app)
    out = Path(os.environ.get("PARITY_SCREENSHOT_DIR", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    (out / "dashboard_compare.png").write_bytes(shot)
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 20_000
    assert charts >= 4  # reward, accuracy and the two mismatch curves the page opens with
    assert errors == 0, "the page shows an error or warning element"
    assert title == "Compare runs"
