"""The Prefect UI of the server `make run` starts (scripts/run_local.start_server, here the session's server on a
free port: tests/prefect_services.py), opened in Debian's headless chromium over the DevTools protocol: the
Deployments page lists the three deployments by name, linked to their own ids, with the nightly schedule,
and no "Can't connect to Server API". The UI finds its API through /ui-settings, which must name the
server's own port (it said Prefect's default 4200 whatever port the server had)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.prefect_services import api
from tests.test_dashboard_browser import CHROMIUM_FLAGS, Cdp, chromium, stop

pytestmark = pytest.mark.slow
DEPLOYMENTS = ["train-and-eval/local", "sweep/local", "benchmark-regression/nightly"]
LINKS_JS = "Array.from(document.querySelectorAll('a')).map(a => [a.getAttribute('href'), a.innerText.trim()])"
TEXT_JS = "document.body ? document.body.innerText : ''"


def test_ui_settings_name_the_servers_own_api(prefect_services):
    base = prefect_services["api"].removesuffix("/api")
    assert not base.endswith(":4200")  # a free port: the case that went wrong
    with urllib.request.urlopen(f"{base}/ui-settings", timeout=30) as r:
        settings = json.load(r)
    assert settings["api_url"] == prefect_services["api"]


def test_prefect_ui_lists_the_deployments(prefect_services, tmp_path):
    api_url = prefect_services["api"]
    base = api_url.removesuffix("/api")
    deps = {name: api(f"{api_url}/deployments/name/{name}") for name in DEPLOYMENTS}
    flows = {name: api(f"{api_url}/flows/{d['flow_id']}")["name"] for name, d in deps.items()}
    want = {name: (f"/deployments/deployment/{d['id']}", name.split("/")[1]) for name, d in deps.items()}
    flow_links = {name: (f"/flows/flow/{d['flow_id']}", flows[name]) for name, d in deps.items()}

    profile = tmp_path / "chromium-profile"
    chrome = subprocess.Popen([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        active = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not active.is_file() or not active.read_text().strip():
            assert time.monotonic() < deadline and chrome.poll() is None, "chromium did not open its DevTools port"
            time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{int(active.read_text().split()[0])}/json/list",
                                    timeout=10) as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        cdp = Cdp(page["webSocketDebuggerUrl"])
        try:
            cdp.call("Page.enable")
            cdp.call("Page.navigate", url=f"{base}/deployments")
            deadline = time.monotonic() + 180  # the UI's first load on a busy machine
            while True:
                links = [tuple(x) for x in cdp.eval(LINKS_JS) or []]
                text = cdp.eval(TEXT_JS) or ""
                # the deployments' links, and their flows' links beside them (drawn a moment later)
                if all(w in links for w in [*want.values(), *flow_links.values()]) or "Can't connect" in text:
                    break
                assert time.monotonic() < deadline, f"the deployments did not appear; the page reads:\n{text[:2000]}"
                time.sleep(1.0)
            shot = cdp.call("Page.captureScreenshot", format="png")["data"]
        finally:
            cdp.close()
    finally:
        stop(chrome)
    out = Path(os.environ.get("PARITY_SCREENSHOT_DIR", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefect-deployments.png").write_bytes(base64.b64decode(shot))
    assert "Can't connect to Server API" not in text, text[:2000]
    for name, link in want.items():
        assert link in links, (name, links)
        # the flow's own link beside it, by the flow's name
        assert flow_links[name] in links, (name, links)
    assert "At 02:00 AM every day" in text
