#!/usr/bin/env bash
# Multi-LoRA on one GPU: the GPU test against peft, then the same requests on the base model
# alone and with two random rank-16 adapters in turn in one engine (`loom bench offline
# --request-lora`, dummy weights, bf16). Steps with an adapter run eagerly, outside the CUDA
# graphs.
#
#   bash bench/gpu/lora.sh OUTDIR SECTION [FLAGS...]
#
# Needs: a CUDA GPU; peft for `test`; .whl (FlashInfer) for the default prefill (see
# bench/gpu/common.sh). The adapters are written by bench/make_lora.py under /tmp. Results:
# OUTDIR/results.jsonl and OUTDIR/log.txt. Sections:
#   test        tests/gpu/test_cuda_lora.py
#   ab [FLAGS]  SmolLM2 and Llama-3-8B, 64 x 128 in / 256 out, base model against adapters a, b
#               in turn; FLAGS pass on to `loom bench offline`
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"

case $section in
test)
  $py -m pytest -q -m gpu tests/gpu/test_cuda_lora.py -p no:cacheprovider --tb=short 2>&1 | tail -5 | tee -a "$log"
  ;;
ab)
  for m in $SM $L8; do
    t=$(basename $m .json)
    for s in 1 2; do $py bench/make_lora.py --model $m --out /tmp/lora-$t-$s --seed $s | tee -a "$log"; done
    offline "$t-lora-ab-b64" --model $m --num-prompts 64 --input-len 128 --output-len 256 \
      --lora-paths a=/tmp/lora-$t-1 b=/tmp/lora-$t-2 --request-lora a b "${@:3}"
  done
  ;;
*)
  unknown_section
  ;;
esac
