"""A pytest plugin: with SUITE_REPORT=PATH set, the session ends by writing its report there (docs/bench/suite.md,
the figures the README quotes): the outcome counts, the session's wall time and the slowest tests, under the
environment header every benchmark report carries."""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections import Counter

SLOWEST = 25


class SuiteReport:
    """Registered by conftest.pytest_configure when SUITE_REPORT is set."""

    def __init__(self, path: str):
        self.path = path
        self.times: dict[str, float] = {}  # nodeid -> set-up + call + teardown seconds
        self.outcomes: Counter = Counter()
        self.started = time.monotonic()

    def pytest_runtest_logreport(self, report) -> None:
        self.times[report.nodeid] = self.times.get(report.nodeid, 0.0) + report.duration
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.outcomes[report.outcome] += 1
        elif report.when == "teardown" and report.outcome == "failed":
            self.outcomes["error"] += 1

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        from deepseek_ds.bench.report import write_process_report
        from deepseek_ds.utils.fmt import markdown_table

        wall = time.monotonic() - self.started
        counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(self.outcomes.items()))
        slowest = sorted(self.times.items(), key=lambda kv: -kv[1])[:SLOWEST]
        table = markdown_table([[f"{s:.1f}", f"`{nodeid}`"] for nodeid, s in slowest], ["seconds", "test"],
                               align=["right", "left"])
        write_process_report(self.path, "The test suite (bash scripts/test.sh)", (
            "Every collected test on this machine, the session's wall time from its start to its end (the set-up by "
            "scripts/setup.sh before it not counted), and the slowest tests, each its set-up, call and teardown "
            "(a shared fixture's first use is counted in the test that built it)."),
            [f"**{counts} in {int(wall // 60)} min {wall % 60:.0f} s** (pytest exit status {int(exitstatus)}; "
             f"CI={os.environ.get('CI') or 'unset'}: with CI=true, as .ci/run sets it, a multi-host test that cannot "
             "build its namespace cluster fails instead of skipping)",
             f"The {len(slowest)} slowest:\n\n{table}"],
            command=f"SUITE_REPORT={self.path} python -m pytest {shlex.join(sys.argv[1:])}")
