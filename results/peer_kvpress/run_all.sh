#!/bin/bash
# Prioritised peer run: kept 0.2 everything; then kvzip+snapkv at 0.1/0.4; then the rest.
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd /work/main
PY=/work/peer-venv/bin/python
DATA="out/ruler/niah_single_1_2048/validation.jsonl out/ruler/niah_single_2_2048/validation.jsonl"
OUT=benchmarks/results/peer_kvpress
$PY benchmarks/peer_kvpress.py --data $DATA --limit 10 --kept 0.2 --max-new-tokens 32 --out $OUT
$PY benchmarks/peer_kvpress.py --data $DATA --limit 10 --kept 0.1 0.4 --methods kvzip snapkv --max-new-tokens 32 --out $OUT
$PY benchmarks/peer_kvpress.py --data $DATA --limit 10 --kept 0.1 0.2 0.4 --max-new-tokens 32 --out $OUT
echo ALL DONE
