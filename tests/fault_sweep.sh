#!/bin/bash
# Issue 13's sweep of faults and bad input, tried as a user would meet them: every case the
# issue names and more, across dc-collect, dc-plan, dc-run, dc-trace and dc-calibrate. Each case
# runs in a directory of its own with a private TMPDIR, bounded in time, and is classified as
# clear, unclear, partial, silently wrong, crashed or hung (tests/fault_sweep.py says how).
#
#   tests/fault_sweep.sh [BUILD_DIR] [--only SUBSTRING] [--json OUT.json] [--keep]
#
# Prints one line per case and the counts; takes a few minutes on 2 cores. Not part of ctest:
# the cases it found are rows of tests/bad_input_test.cc, which CI runs.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="${1:-$here/../build}"
[ $# -gt 0 ] && shift
exec python3 "$here/fault_sweep.py" --build "$build" "$@"
