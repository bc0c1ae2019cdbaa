#!/usr/bin/env bash
# End-to-end workloads on one GPU, `loom bench offline` on dummy weights (bf16): the 1000-request
# random-length Llama-3-8B workload, SmolLM2's 256-request one, and Loom against HF
# transformers' generate() in the same process.
#
#   bash bench/gpu/workloads.sh OUTDIR SECTION [FLAGS...]
#
# Needs: a CUDA GPU; .whl (FlashInfer) for the default FlashInfer prefill (see
# bench/gpu/common.sh); transformers for the HF sections. Results: OUTDIR/results.jsonl and
# OUTDIR/log.txt. Sections:
#   wl8b [FLAGS]     Llama-3-8B, 1000 requests, input and output lengths uniform in [100, 1024]
#                    (seed 0, ignore_eos); FLAGS pass on, e.g. --kv-cache-dtype fp8_e4m3,
#                    --engine-backend process, --disable-overlap-schedule,
#                    --decode-attention-backend flashinfer, --chunked-prefill-size 16384,
#                    --enable-mixed-chunk. One run takes ~1-2 minutes.
#   smol256 [FLAGS]  SmolLM2, 256 requests, the same length distribution; FLAGS as above
#   hf64             Llama-3-8B, 64 x 128 / 256: Loom, then HF generate() at batch 64
#   hfsmol           SmolLM2, 64 x 128 / 256 (HF at batch 64) and batch 1 (HF at batch 1)
#   arch CONFIG      any architecture's shape (e.g. configs/qwen3-8b.json, configs/mixtral-8x7b.json):
#                    `loom bench latency` at batch 1 (128 / 256), then 1 x 128 / 256 and
#                    64 x 128 / 256 beside HF generate() at batch 1 and 64 (the scheduler in
#                    its own process, which has returned all its memory when HF starts)
#   archwl CONFIG    the 1000-request random-length workload on CONFIG, HF generate() at batch
#                    64 on its first 64 requests
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"

case $section in
wl8b)
  offline "8b-1000-random ${*:3}" --model $L8 --num-prompts 1000 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977 "${@:3}"
  ;;
smol256)
  offline "smol-256-random ${*:3}" --model $SM --num-prompts 256 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977 "${@:3}"
  ;;
hf64)
  offline "8b-b64-vs-hf" --model $L8 --num-prompts 64 --input-len 128 --output-len 256 --compare-hf --hf-batch-size 64 --mem-fraction-static 0.5
  ;;
hfsmol)
  offline "smol-b64-vs-hf" --model $SM --num-prompts 64 --input-len 128 --output-len 256 --compare-hf --hf-batch-size 64
  offline "smol-b1-vs-hf" --model $SM --num-prompts 2 --input-len 128 --output-len 256 --max-running-requests 1 --compare-hf --hf-batch-size 1
  ;;
arch)
  cfg=${3:?usage: bash $0 OUTDIR arch CONFIG}
  latency "$cfg b1 latency" --model "$cfg" --batch-size 1 --input-len 128 --output-len 256
  offline "$cfg b1 vs hf" --model "$cfg" --num-prompts 1 --input-len 128 --output-len 256 --max-running-requests 1 --compare-hf --hf-batch-size 1 --engine-backend process
  offline "$cfg b64 vs hf" --model "$cfg" --num-prompts 64 --input-len 128 --output-len 256 --compare-hf --hf-batch-size 64 --engine-backend process
  ;;
archwl)
  cfg=${3:?usage: bash $0 OUTDIR archwl CONFIG}
  offline "$cfg 1000-random vs hf" --model "$cfg" --num-prompts 1000 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977 --compare-hf --hf-batch-size 64 --hf-num-prompts 64 --engine-backend process
  ;;
*)
  unknown_section
  ;;
esac
