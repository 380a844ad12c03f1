"""Parity's Streamlit dashboard (read-only views of MLflow, the registry and outputs/)."""
