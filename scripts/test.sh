#!/usr/bin/env bash
# Set up, then run the whole test suite (extra arguments go to pytest, e.g. -k config).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
exec python -m pytest -q tests "$@"
