"""Parity dashboard: `streamlit run dashboards/app.py --server.address 127.0.0.1 --server.headless true`.

Reads the MLflow tracking store, the registry database and the reports under outputs/; never writes."""

from __future__ import annotations

import sys
from pathlib import Path

import streamlit as st

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # `streamlit run` puts dashboards/ on the path, the package needs its parent
    sys.path.insert(0, str(HERE.parent))

st.set_page_config(page_title="Parity", layout="wide")
PAGES = [
    st.Page(str(HERE / "views" / "runs.py"), title="Runs", default=True),
    st.Page(str(HERE / "views" / "compare.py"), title="Compare", url_path="compare"),
    st.Page(str(HERE / "views" / "benchmarks.py"), title="Benchmarks", url_path="benchmarks"),
    st.Page(str(HERE / "views" / "regression.py"), title="Regression", url_path="regression"),
    st.Page(str(HERE / "views" / "precision.py"), title="Precision", url_path="precision"),
]
st.navigation(PAGES).run()
