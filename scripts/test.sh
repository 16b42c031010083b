#!/usr/bin/env bash
# Runs the whole test suite (unit tests on tiny random models, LongBench runner, end-to-end on the default
# model). Creates or reuses .venv first. Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
python -m pytest -q -p no:cacheprovider "$@"
