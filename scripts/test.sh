#!/usr/bin/env bash
# Set up, then run the test suite; extra arguments go to pytest: `-m unit` (about five minutes), `-m launch`,
# `-m multihost` (markers in pyproject.toml), `-k config`, a file.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
# -rs: every skip with its reason; the 25 slowest set-ups and tests close the report.
exec python -m pytest -q -rs --durations=25 "$@"
