#!/usr/bin/env bash
# The GPU run, on a machine without network (the device tool: carry ["benchmarks/gpu/carry"], made here by
# benchmarks/gpu/prepare.sh), from the checkout's root with $OUT set:
#   bash benchmarks/gpu/run.sh            correctness, kvcompress, throughput, kvpress at 8192 and 32768 (~7 min)
#   bash benchmarks/gpu/run.sh --quick    the same at 8192 only, fewer methods, no throughput (~3 min)
# Each phase runs under a time limit of its own (a soft deadline inside the script, a hard `timeout` around it) and
# whatever the phase before it did; results land in $OUT (log.txt, check.json, speed_*.json/md, throughput_*.json,
# peer_kvpress_*.json/md), to be committed under results/gpu/.
# Environment overrides serve a smoke test on CPU (about a minute):
#   DEVICE=cpu MODEL=tiny-llama LENGTHS=256 THROUGHPUT_LENGTH=256 MEMORY_GIB=1.1 CHECK_PLAN=tiny-llama:256:float32 \
#   PY=.venv/bin/python PEER_PY=/work/peer-venv/bin/python OUT=/tmp/gpu-out bash benchmarks/gpu/run.sh
set -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 1
OUT="${OUT:-/tmp/gpu-out}"
mkdir -p "$OUT"
CARRY="$ROOT/benchmarks/gpu/carry"
PY="${PY:-python3}"
PEER_PY="${PEER_PY:-$PY}"  # the CPU smoke test gives the peer's own virtualenv here
DEVICE="${DEVICE:-cuda}"
MODEL="${MODEL:-llama3-8b-shape}"
SITE_OURS="${SITE_OURS:-/tmp/site-ours}"
SITE_PEER="${SITE_PEER:-/tmp/site-peer}"
if [ "${1:-}" = "--quick" ]; then
    LENGTHS="${LENGTHS:-8192}"; METHODS="${METHODS:-snapkv h2o kvzip kvzip-layers kvzap expected_attention}"
    CHECK_S=60; OURS_S=100; THROUGHPUT_S=0; PEER_S=60; REPEATS=1
else
    LENGTHS="${LENGTHS:-8192 32768}"
    METHODS="${METHODS:-snapkv h2o kvzip kvzip-layers kvzap expected_attention tova keydiff knorm streaming}"
    CHECK_S=60; OURS_S=170; THROUGHPUT_S=80; PEER_S=120; REPEATS=2
fi
THROUGHPUT_LENGTH="${THROUGHPUT_LENGTH:-32768}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TRANSFORMERS_VERBOSITY=error KVCOMPRESS_NATIVE=0  # the compiled kernel serves CPU tensors only: no build
T0=$SECONDS

phase() {  # NAME SECONDS COMMAND...: run under a hard limit a little past the soft one given to the script
    local name="$1" limit="$2"; shift 2
    echo "== $name (limit ${limit} s) at $((SECONDS - T0)) s"
    timeout -k 5 $((limit + 30)) "$@"
    echo "== $name exit $? at $((SECONDS - T0)) s"
}

main() {
    echo "== benchmarks/gpu/run.sh device=$DEVICE model=$MODEL lengths=[$LENGTHS] $(date -u +%FT%TZ)"
    git -C "$ROOT" log -1 --format='project %H %s' 2>/dev/null | cut -c1-160
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)"
    "$PY" -c "import triton; print('triton', triton.__version__)" || echo "!! no triton: the torch path serves"
    rm -rf "$SITE_OURS" "$SITE_PEER"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE_OURS" "$CARRY"/whl_ours/*.whl \
        || echo "!! install into $SITE_OURS failed"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE_PEER" "$CARRY"/whl_peer/*.whl \
        || echo "!! install into $SITE_PEER failed"
    local ours="$SITE_OURS:$ROOT" stem
    stem="$(echo "$MODEL" | sed 's/-shape$//')"

    PYTHONPATH="$ours" phase check "$CHECK_S" "$PY" benchmarks/gpu/check.py --device "$DEVICE" \
        --plan "${CHECK_PLAN:-tiny-llama:512:float32,llama3-8b-shape:2048:float32}" --deadline-s "$CHECK_S" \
        --out "$OUT/check.json"
    if [ "$DEVICE" != cpu ]; then
        # shellcheck disable=SC2086
        PYTHONPATH="$ours" phase kernels 40 "$PY" benchmarks/gpu/kernel_timing.py --lengths $LENGTHS --out "$OUT/kernels.json"
    fi
    # shellcheck disable=SC2086
    PYTHONPATH="$ours" phase kvcompress "$OURS_S" "$PY" benchmarks/speed_memory.py --device "$DEVICE" \
        --model "$MODEL" --dtype bfloat16 --lengths $LENGTHS --methods $METHODS --budget 0.2 --new-tokens 16 \
        --repeats "$REPEATS" --threads 1 --deadline-s "$OURS_S" --out "$OUT/speed_$stem"
    if [ "$THROUGHPUT_S" -gt 0 ]; then
        PYTHONPATH="$ours" phase throughput "$THROUGHPUT_S" "$PY" benchmarks/throughput.py --device "$DEVICE" \
            --model "$MODEL" --length "$THROUGHPUT_LENGTH" --budget 0.2 --methods none snapkv kvzip \
            --memory-gib "${MEMORY_GIB:-100}" --out "$OUT/throughput_$stem"
    fi
    # shellcheck disable=SC2086
    PYTHONPATH="$SITE_PEER" phase kvpress "$PEER_S" "$PEER_PY" benchmarks/peer_kvpress_speed.py --device "$DEVICE" \
        --model "$MODEL" --lengths $LENGTHS --all-presses --repeats 1 --new-tokens 16 \
        --out "$OUT/peer_kvpress_$stem"
    PYTHONPATH="$ours" "$PY" benchmarks/gpu/report.py "$OUT" || true
    echo "== done in $((SECONDS - T0)) s"
}

main 2>&1 | tee "$OUT/log.txt"
