"""Tracking: MLflow logging (parity.tracking.mlflow_log) and the registry DB (parity.tracking.registry).
Imported only by tasks/, flows/ and the pipeline command, never by the numerical core."""
