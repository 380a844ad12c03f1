"""Schedules on a real Prefect server (the session's, tests/prefect_services.py): the server's scheduler creates
the flow runs of `benchmark-regression/nightly` (listed by the API, one a day at 02:00 in the schedule's time
zone), a deployment on a 10-second interval is run from its schedule by its serving process until a run the
scheduler created is Completed, and the server's log holds no scheduler error. With SQLAlchemy 2.1 the
scheduler failed on every pass (requirements.in says why) and none of this happened."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import time
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest
from prefect.runner import Runner

from scripts.run_local import REPO, prefect_env, stop_process, wait_deployment
from tests.prefect_probe import PROBE_LINE
from tests.prefect_services import api, flow_run_line

pytestmark = pytest.mark.slow


def _runs(api_url: str, deployment_id: str, states: list[str]) -> list[dict]:
    return api(f"{api_url}/flow_runs/filter", "POST",
               {"flow_runs": {"deployment_id": {"any_": [deployment_id]}, "state": {"type": {"any_": states}}},
                "sort": "EXPECTED_START_TIME_ASC", "limit": 50})


def _wait_for(what: str, get, timeout_s: float, interval_s: float = 2.0):
    deadline = time.monotonic() + timeout_s
    while not (found := get()):
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s"
        time.sleep(interval_s)
    return found


def test_nightly_regression_gets_scheduled_runs(prefect_services):
    api_url = prefect_services["api"]
    dep = api(f"{api_url}/deployments/name/benchmark-regression/nightly")
    (sched,) = [s["schedule"] for s in dep["schedules"] if s["active"]]
    assert sched["cron"] == "0 2 * * *"
    runs = _wait_for("scheduled runs of benchmark-regression/nightly",
                     lambda: _runs(api_url, dep["id"], ["SCHEDULED"]), timeout_s=150)
    tz = ZoneInfo(sched.get("timezone") or "UTC")
    starts = [datetime.fromisoformat(r["expected_start_time"]).astimezone(tz) for r in runs]
    assert all(r["auto_scheduled"] and r["created_by"]["type"] == "SCHEDULE" for r in runs), runs
    assert all((s.hour, s.minute, s.second) == (2, 0, 0) for s in starts), starts
    assert len({s.date() for s in starts}) == len(starts)  # one a day
    assert min(starts) > datetime.now(tz)
    assert all(r["parameters"] == dep["parameters"] for r in runs)


def test_interval_deployment_runs_from_its_schedule(prefect_services, tmp_path):
    """The scheduler creates the runs, the serving process's runner picks them up and runs them to Completed."""
    api_url = prefect_services["api"]
    log = tmp_path / "probe-serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "tests.prefect_probe", "10"],
                            env=prefect_env(prefect_services["root"] / "home", api_url), stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=str(REPO))
    dep_id = None
    try:
        wait_deployment(api_url, "schedule-probe/every-10s", proc, timeout_s=180)
        dep_id = api(f"{api_url}/deployments/name/schedule-probe/every-10s")["id"]
        done = _wait_for("a Completed run created by the scheduler",
                         lambda: [r for r in _runs(api_url, dep_id, ["COMPLETED"]) if r["auto_scheduled"]],
                         timeout_s=240)
        # read its log while the serving process still runs: the run's last log batch is shipped after it ends,
        # and stopping the process group first can drop it
        logs, line = flow_run_line(api_url, done[0]["id"], PROBE_LINE, timeout_s=120)
    finally:
        stop_process(proc.pid)
        if dep_id is not None:  # its future runs would never be picked up now
            api(f"{api_url}/deployments/{dep_id}", "DELETE")
    fr = done[0]
    assert fr["created_by"]["type"] == "SCHEDULE"  # nobody asked for it: the schedule did
    assert fr["state"]["name"] == "Completed"
    # the serving runner takes runs scheduled up to its prefetch window ahead (prefect.runner.Runner's
    # prefetch_seconds, 10 by default) and starts them at once, so a run may start up to that much early
    early = datetime.fromisoformat(fr["expected_start_time"]) - datetime.fromisoformat(fr["start_time"])
    assert early.total_seconds() <= RUNNER_PREFETCH_S, (fr["start_time"], fr["expected_start_time"])
    assert line is not None, logs


RUNNER_PREFETCH_S = inspect.signature(Runner.__init__).parameters["prefetch_seconds"].default


STAMP = re.compile(r"^\d\d:\d\d:\d\d\.\d+ \| ")


def _error_records(text: str) -> list[str]:
    """Each ERROR record of a Prefect server log with its traceback (up to the next time-stamped line)."""
    records, current = [], None
    for line in text.splitlines():
        if STAMP.match(line):
            if current is not None:
                records.append("\n".join(current))
            current = [line] if "| ERROR" in line else None
        elif current is not None:
            current.append(line)
    return records + (["\n".join(current)] if current is not None else [])


def test_server_log_has_no_scheduler_error(prefect_services):
    """Run after the two above (file order): the scheduler has had its passes over both schedules by then. A pass
    that met SQLite's write lock (a busy 2-core machine) is retried on the next one and is not counted; any other
    error of a scheduler pass is."""
    text = (prefect_services["root"] / "server.log").read_text(errors="replace")
    assert "Can't evaluate bulk DML" not in text
    bad = [r for r in _error_records(text) if ("schedul" in r.lower() or "services/scheduler.py" in r)
           and "database is locked" not in r]
    assert not bad, "\n\n".join(bad)[:6000]
