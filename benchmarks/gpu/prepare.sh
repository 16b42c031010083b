#!/usr/bin/env bash
# Prepares what benchmarks/gpu/run.sh needs on a GPU machine without network: run here, where PyPI is reachable.
#   benchmarks/gpu/carry/whl_ours/  transformers 5.24.0 (the project's pin; a GPU image may hold another)
#   benchmarks/gpu/carry/whl_peer/  kvpress 0.5.5 with transformers 5.2.0 (the newest below its "<5.3"),
#                                   tokenizers 0.22.2 (transformers 5.2 checks <=0.23.0) and what `import kvpress`
#                                   needs beyond a PyTorch image: cachetools, datasets, dill, multiprocess, fire,
#                                   termcolor
# Wheels for CPython 3.12 on x86-64 Linux (the GPU image's python3), whatever python3 is here. carry/ is ignored
# by git and travels as the device call's `carry` ["benchmarks/gpu/carry"].
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CARRY="$HERE/carry"
PY="${PYTHON:-python3}"
PLATFORM=(--python-version "${WHEEL_PYTHON:-3.12}" --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
rm -rf "$CARRY"
mkdir -p "$CARRY/whl_ours" "$CARRY/whl_peer"
download() {  # DIR REQUIREMENT...
    local dir="$1"; shift
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: "${PLATFORM[@]}" -d "$dir" "$@" \
        2>&1 | { grep -v "^WARNING: Location '" || true; }
    return "${PIPESTATUS[0]}"
}
download "$CARRY/whl_ours" transformers==5.24.0
download "$CARRY/whl_peer" kvpress==0.5.5 transformers==5.2.0 tokenizers==0.22.2 cachetools==5.5.2 datasets==5.2.0 \
    dill==0.4.1 multiprocess==0.70.19 termcolor==3.3.0
# fire 0.6.0 (kvpress pins fire<0.7) is published as a source archive only: build its pure-Python wheel here
BUILD="$(mktemp -d)"
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$BUILD" fire==0.6.0 2>&1 | { grep -v "^WARNING: Location '" || true; }
cp "$BUILD"/fire-0.6.0-*.whl "$CARRY/whl_peer/"
rm -rf "$BUILD"
du -sh "$CARRY"/* "$CARRY"
