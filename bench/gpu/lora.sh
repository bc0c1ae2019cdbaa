#!/usr/bin/env bash
# Multi-LoRA on one GPU: the GPU test against peft; the base model against rank-16 adapters on
# all seven projections in the same engine (`loom bench offline --request-lora`, dummy weights,
# bf16, 64 x 128 in / 256 out unless a section says otherwise); time to first token by where
# the adapter is (`loom bench lora`).
#
#   bash bench/gpu/lora.sh OUTDIR SECTION [FLAGS...]
#
# Needs: a CUDA GPU; peft for `test`; .whl (FlashInfer) for the default prefill (see
# bench/gpu/common.sh). The adapters are written by bench/make_lora.py under /tmp. Results:
# OUTDIR/results.jsonl and OUTDIR/log.txt. Sections:
#   test        tests/gpu/test_cuda_lora.py
#   ab [FLAGS]  SmolLM2 and Llama-3-8B, adapters a, b in turn; FLAGS pass on
#   ab8         SmolLM2 and Llama-3-8B (or the configs in $MODELS), 8 distinct adapters in turn
#   scale       Llama-3-8B, 1, 8, 32 and 64 ($COUNTS) distinct adapters in turn (64 slots; 8 adapter
#               files, each served under several names)
#   b1          Llama-3-8B, one request (128 in / 256 out) on one adapter
#   ttft        Llama-3-8B, `loom bench lora`: 3 adapters, 1 slot, all in host memory; then
#               only one in host memory
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"

adapters() {  # MODEL_CONFIG COUNT: write COUNT adapters for it under /tmp (once)
  local t; t=$(basename "$1" .json)
  for s in $(seq 1 "$2"); do
    [ -f /tmp/lora-$t-$s/adapter_config.json ] ||
      $py bench/make_lora.py --model "$1" --out /tmp/lora-$t-$s --seed $s | tail -1 >>"$log"
  done
}
names() {  # MODEL_CONFIG COUNT FILES: COUNT names a1.. over FILES adapter files, as NAME=PATH
  local t; t=$(basename "$1" .json)
  for i in $(seq 1 "$2"); do echo "a$i=/tmp/lora-$t-$(( (i - 1) % $3 + 1 ))"; done
}

case $section in
test)
  $py -m pytest -q -m gpu tests/gpu/test_cuda_lora.py -p no:cacheprovider --tb=short 2>&1 | tail -5 | tee -a "$log"
  ;;
ab)
  for m in $SM $L8; do
    t=$(basename $m .json)
    adapters $m 2
    offline "$t-lora-ab-b64" --model $m --num-prompts 64 --input-len 128 --output-len 256 \
      --lora-paths a=/tmp/lora-$t-1 b=/tmp/lora-$t-2 --request-lora a b "${@:3}"
  done
  ;;
ab8)
  for m in ${MODELS:-$SM $L8}; do
    t=$(basename $m .json)
    adapters $m 8
    offline "$t-lora-8-b64" --model $m --num-prompts 64 --input-len 128 --output-len 256 \
      --lora-paths $(names $m 8 8) --request-lora $(seq -f "a%g" 1 8) "${@:3}"
  done
  ;;
scale)
  adapters $L8 8
  for n in ${COUNTS:-1 8 32 64}; do
    offline "llama-3-8b-lora-scale-$n" --model $L8 --num-prompts 64 --input-len 128 \
      --output-len 256 --max-loras-per-batch 64 --lora-paths $(names $L8 $n 8) \
      --request-lora $(seq -f "a%g" 1 $n) "${@:3}"
  done
  ;;
b1)
  adapters $L8 1
  offline "llama-3-8b-lora-b1" --model $L8 --num-prompts 1 --input-len 128 --output-len 256 \
    --lora-paths a=/tmp/lora-llama-3-8b-1 --request-lora a "${@:3}"
  ;;
ttft)
  adapters $L8 3
  for h in 3 1; do
    echo "== llama-3-8b-lora-ttft-host$h" | tee -a "$log"
    $py -m loom.cli bench lora --model $L8 --load-format dummy --skip-tokenizer-init \
      --lora-paths $(names $L8 3 3) --max-loras-per-batch 1 --max-loaded-loras $h \
      --result-file "$out/results.jsonl" "${@:3}" 2>&1 | grep -v "^Loading" | tail -5 | tee -a "$log"
  done
  ;;
*)
  unknown_section
  ;;
esac
