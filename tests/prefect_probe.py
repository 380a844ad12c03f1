"""A flow served on a short interval schedule, for the scheduler test (tests/test_prefect_schedule.py):
`python -m tests.prefect_probe SECONDS` serves `schedule-probe/every-<SECONDS>s` against $PREFECT_API_URL until
stopped. Every run the server's scheduler creates is executed by this process's runner, as the deployments
of flows/deployments.py are."""

from __future__ import annotations

import sys

from prefect import flow, serve

PROBE_LINE = "schedule probe ran"


@flow(name="schedule-probe", log_prints=True)
def schedule_probe() -> str:
    print(PROBE_LINE)
    return PROBE_LINE


def main(argv: list[str]) -> None:
    seconds = int(argv[0]) if argv else 10
    # one run at a time, as flows/deployments.py serves: runs that fall due meanwhile wait their turn
    serve(schedule_probe.to_deployment(name=f"every-{seconds}s", interval=seconds), limit=1)


if __name__ == "__main__":
    main(sys.argv[1:])
