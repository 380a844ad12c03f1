"""The collapse-and-rescue study: presets of arms (parity.study.presets), the members of a sweep, every arm once
per seed (parity.study.members, which the Prefect sweep uses too), running them (parity.study.runs), and the table
and figures of their results (parity.study.report). `python -m parity study` drives it."""
