"""Prefect tasks: thin wrappers that call one parity library function each and return small,
serialisable results (tasks/stages.py), and the bookkeeping every stage shares (tasks/recording.py)."""
