"""The collapse-and-rescue study: presets of arms (parity.study.presets), running them (parity.study.runs),
and the table and figures of their results (parity.study.report). `python -m parity study` drives it."""
