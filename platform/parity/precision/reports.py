"""Validation reports on disk, without torch (the dashboard reads them): where `python -m parity validate` keeps
them and how a report file is told from the quantized checkpoint's other JSON files beside it.

    <checkpoint>/validations/<precision spec>-<YYYYmmdd-HHMMSS>.json + .md   one per validation, never overwritten
    <checkpoint>/validation.json + .md                                        the latest one again
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPORT_KIND = "parity.precision_validation"  # the `report` field that marks a file as a validation report
HISTORY_DIR = "validations"
LATEST_STEM = "validation"


def is_report(data: Any) -> bool:
    """A validation report of any version: the marked ones, and the unmarked ones written before reports were
    kept (a `metrics` object and a verdict)."""
    if not isinstance(data, dict):
        return False
    if data.get("report") == REPORT_KIND:
        return True
    return "report" not in data and isinstance(data.get("metrics"), dict) and "passed" in data


def reports_of(checkpoint_dir: str | Path) -> list[tuple[Path, dict]]:
    """(path, report) of every validation of a checkpoint folder, oldest first: the kept ones under
    validations/, or, in a folder from before they were kept, its one validation.json. Files that are not
    readable reports are left out (the dashboard reports them itself)."""
    folder = Path(checkpoint_dir)
    hist = folder / HISTORY_DIR
    paths = sorted(hist.glob("*.json")) if hist.is_dir() else [folder / f"{LATEST_STEM}.json"]
    out = []
    for p in paths:
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if is_report(data):
            out.append((p, data))
    return sorted(out, key=lambda pr: (str(pr[1].get("created_at") or ""), pr[0].name))
