#!/usr/bin/env bash
# Attention and decode on one GPU: batch-1 decode, what CUDA graphs and overlap gain, decode
# attention alone, the batch-1 GEMV, per-kernel profiles, a fresh engine's first requests.
# Dummy weights of configs/llama-3-8b.json and configs/smollm2-135m.json, bf16.
#
#   bash bench/gpu/attention.sh OUTDIR SECTION [ARGS...]
#
# Needs: a CUDA GPU; .whl (FlashInfer) for FlashInfer prefill, the default on CUDA, and for the
# FlashInfer columns of attn / attnsweep (see bench/gpu/common.sh). Results: OUTDIR/results.jsonl
# and OUTDIR/log.txt. Sections:
#   batch1 [FLAGS]  Llama-3-8B batch 1 (`loom bench latency`, 128 in / 256 out) and SmolLM2 batch 1
#                   (`loom bench offline`, 2 requests, one at a time); FLAGS go to both, e.g.
#                   --disable-overlap-schedule or --disable-cuda-graph
#   backends1       Llama-3-8B batch 1 with --attention-backend triton, then flashinfer
#   firstreq [MODEL]  bench/first_request.py with an empty Triton cache: a fresh engine's first
#                   batch-1 requests, timed, with the kernels compiled inside each
#   attn            bench/attn_micro.py: Triton decode (KV splits, tiles, KV heads a program)
#                   against FlashInfer, bf16 and fp8_e4m3 caches, batch 1 to 1,000
#   attnsweep       bench/attn_micro.py --sweep: launch options at 512 requests x 850 tokens
#   attnfp8         bench/attn_micro.py --sweep-fp8: fp8 tiles and KV heads a program, same shape
#   gemv            bench/gemv_micro.py: cuBLAS against Loom's Triton GEMV per weight shape
#   kprofpre        per-kernel profile of Llama-3-8B prefill: 8 x 1,024 and 32 x 1,024 tokens
#   kprofdec [k=v]  per-kernel profile of Llama-3-8B decode steps alone at 512 x 900 tokens;
#                   k=v engine arguments pass on (e.g. kv_cache_dtype=fp8_e4m3)
#   stepprof        bench/gpu_step_profile.py: Llama-3-8B batch 1, graph replay against the step
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"

case $section in
batch1)
  latency "8b-b1 ${*:3}" --model $L8 --batch-size 1 --input-len 128 --output-len 256 "${@:3}"
  offline "smol-b1 ${*:3}" --model $SM --num-prompts 2 --input-len 128 --output-len 256 --max-running-requests 1 "${@:3}"
  ;;
backends1)
  for be in triton flashinfer; do
    latency "8b-b1-$be" --model $L8 --batch-size 1 --input-len 128 --output-len 256 --attention-backend $be
  done
  ;;
firstreq)
  tc=/tmp/tc-first-$RANDOM && rm -rf $tc
  TRITON_CACHE_DIR=$tc $py bench/first_request.py --model "${3:-$SM}" --result-file "$out/results.jsonl" 2>&1 |
    grep "^request" | tee -a "$log"
  ;;
attn)
  $py bench/attn_micro.py "$out/results.jsonl" 2>&1 | grep -E "^bs|rror" | tee -a "$log"
  ;;
attnsweep)
  $py bench/attn_micro.py --sweep "$out/results.jsonl" 2>&1 | grep -E "^bs|rror" | tee -a "$log"
  ;;
attnfp8)
  $py bench/attn_micro.py --sweep-fp8 "$out/results.jsonl" 2>&1 | grep -E "^bs|rror" | tee -a "$log"
  ;;
gemv)
  $py bench/gemv_micro.py "$out/results.jsonl" 2>&1 | tail -40 | tee -a "$log"
  ;;
kprofpre)
  gpu_kernel_profile $L8 8 1024 1
  gpu_kernel_profile $L8 32 1024 1
  ;;
kprofdec)
  gpu_kernel_profile $L8 512 900 17 --decode-only "${@:3}"
  ;;
stepprof)
  $py bench/gpu_step_profile.py $L8 1 2>&1 | tail -1 | tee -a "$log"
  ;;
*)
  unknown_section
  ;;
esac
