#!/usr/bin/env bash
# GPU comparisons, one command: bash bench/h200.sh OUTDIR
# Runs the GPU test suite, then `loom bench offline` on dummy weights of SmolLM2's and
# Llama-3-8B's shapes (bf16), with CUDA graphs and eagerly, and HF generate() where cheap.
# Every result is appended as a JSON line to OUTDIR/results.jsonl; the log is OUTDIR/log.txt
# (few files: the device tool returns at most 8).
set -uo pipefail
out=${1:?usage: bench/h200.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"

$py -m pytest -q -m gpu tests/gpu tests/test_conformance.py tests/test_triton_backend.py \
  -p no:cacheprovider 2>&1 | tail -25 | tee -a "$out/log.txt"

bench() {  # name, then loom bench offline flags
  echo "== $1" | tee -a "$out/log.txt"; shift
  $py -m loom.cli bench offline --load-format dummy --skip-tokenizer-init \
    --result-file "$out/results.jsonl" "$@" 2>&1 | grep -v "^Loading" | tail -4 | tee -a "$out/log.txt"
}
bench smollm2-b64-hf   --model configs/smollm2-135m.json --num-prompts 64 --input-len 128 --output-len 256 --compare-hf --hf-batch-size 64
bench smollm2-b1-hf    --model configs/smollm2-135m.json --num-prompts 2 --input-len 128 --output-len 256 --max-running-requests 1 --compare-hf --hf-batch-size 1
bench llama8b-b1       --model configs/llama-3-8b.json --num-prompts 2 --input-len 128 --output-len 256 --max-running-requests 1
bench llama8b-b1-eager --model configs/llama-3-8b.json --num-prompts 1 --input-len 128 --output-len 64 --max-running-requests 1 --disable-cuda-graph
bench llama8b-b64      --model configs/llama-3-8b.json --num-prompts 64 --input-len 128 --output-len 256

for bs in 1 64; do
  $py -m loom.cli bench latency --model configs/llama-3-8b.json --load-format dummy \
    --skip-tokenizer-init --batch-size $bs --input-len 128 --output-len 256 \
    --result-file "$out/results.jsonl" 2>&1 | grep -v "^Loading" | tail -2 | tee -a "$out/log.txt"
done
$py bench/gpu_step_profile.py configs/llama-3-8b.json 1 2>&1 | tail -1 | tee -a "$out/log.txt"
