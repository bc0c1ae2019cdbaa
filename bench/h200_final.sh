#!/usr/bin/env bash
# Session 2's last GPU call: bash bench/h200_final.sh OUTDIR
# 8B batch-1 decode with the per-shape GEMV choice (auto) and Triton attention, SmolLM2 batch 1
# with graphs/overlap on and off (Triton attention), the GPU tests, and the 1000-request
# random-length Llama-3-8B workload on Triton attention (FlashInfer's was measured before).
set -uo pipefail
out=${1:?usage: bench/h200_final.sh OUTDIR}
source bench/h200_more.sh "$out" env
latency "8b-b1-triton-gemv-auto" --model $L8 --batch-size 1 --input-len 128 --output-len 256 --attention-backend triton
LOOM_GEMV=cublas latency "8b-b1-triton-cublas" --model $L8 --batch-size 1 --input-len 128 --output-len 256 --attention-backend triton
for f in "" "--disable-overlap-schedule" "--disable-cuda-graph"; do
  offline "smol-b1-triton $f" --model $SM --num-prompts 2 --input-len 128 --output-len 256 --max-running-requests 1 --attention-backend triton $f
done
$py -m pytest -q -m gpu tests/gpu tests/test_conformance.py tests/test_triton_backend.py \
  tests/test_gemv.py -p no:cacheprovider 2>&1 | tail -15 | tee -a "$log"
offline "8b-1000-random-triton" --model $L8 --num-prompts 1000 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977 --attention-backend triton
