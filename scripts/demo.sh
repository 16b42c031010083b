#!/usr/bin/env bash
# The main job: the default model (SmolLM2-135M-Instruct, embedded) answers a question about a long built-in
# document with and without KV-cache compression, and prints a report. Creates or reuses .venv first.
# Extra arguments go to `kvcompress demo`, e.g. `bash scripts/demo.sh --method h2o --budget 400`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec kvcompress demo "$@"
