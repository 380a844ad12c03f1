"""One module per CLI command: `run(cfg) -> dict` (Hydra) or `main(argv) -> dict` (flags)."""
