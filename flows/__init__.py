"""Prefect flows (train_and_eval, benchmark_regression, sweep) and their deployments (deployments.py)."""
