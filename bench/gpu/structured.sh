#!/usr/bin/env bash
# Structured output on one GPU: `loom bench structured` compiles the 25 JSON schemas of
# loom/bench/json_schemas.py, then decodes the same prompts constrained (one schema each, greedy)
# and free with the same output lengths, and reports the overhead of the decode steps alone and
# end to end. Dummy weights, bf16, 64 new tokens, SmolLM2's tokenizer.
#
#   bash bench/gpu/structured.sh OUTDIR SECTION [ARGS...]
#
# Needs: a CUDA GPU; .whl2 (xgrammar, llguidance, pydantic; py-spy for `pyspy`) and .tok (the
# SmolLM2 tokenizer); .whl (FlashInfer) for the default prefill (see bench/gpu/common.sh).
# Results: OUTDIR/results.jsonl and OUTDIR/log.txt. Sections:
#   smol        SmolLM2, xgrammar, 64 prompts at batch 16: the scheduler in its own process
#               (--engine-backend process) twice, on the engine's thread once; then batch 1 over
#               16 prompts in its own process
#   llguidance  the same with --grammar-backend llguidance, in its own process: batch 16 over 64
#               prompts, batch 1 over 16
#   llama8b     Llama-3-8B's body with SmolLM2's vocabulary (bench/configs/llama-3-8b-smolvocab.json),
#               xgrammar then llguidance, batch 1 over 8 prompts and batch 16 over 32
#   kprof [k=v] bench/structured_kprof.py: one constrained SmolLM2 batch of 16 on the device
#               (busy time, idle gaps, kernels) against the same batch free
#   pyspy       py-spy (1 kHz, by function) over SmolLM2's constrained batch-16 run of 64 prompts,
#               after a warm-up run; the raw profile comes back as OUTDIR/spy-struct.txt
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"

case $section in
smol)
  for i in 1 2; do
    structured "smol xgrammar process batch 16" --model $SM --num-prompts 64 --engine-backend process --batch-size 16
  done
  structured "smol xgrammar thread batch 16" --model $SM --num-prompts 64 --batch-size 16
  structured "smol xgrammar process batch 1" --model $SM --num-prompts 16 --engine-backend process --batch-size 1
  ;;
llguidance)
  structured "smol llguidance process batch 16" --model $SM --grammar-backend llguidance --engine-backend process --batch-size 16 --num-prompts 64
  structured "smol llguidance process batch 1" --model $SM --grammar-backend llguidance --engine-backend process --batch-size 1 --num-prompts 16
  ;;
llama8b)
  for be in xgrammar llguidance; do
    structured "8b-body $be batch 1" --model $L8SMOLVOCAB --grammar-backend $be --batch-size 1 --num-prompts 8
    structured "8b-body $be batch 16" --model $L8SMOLVOCAB --grammar-backend $be --batch-size 16 --num-prompts 32
  done
  ;;
kprof)
  $py bench/structured_kprof.py $SM .tok 16 64 "${@:3}" 2>&1 | grep -v "^Loading\|USDT" | tail -40 | tee -a "$log"
  ;;
pyspy)
  structured "warm-up" --model $SM --batch-size 16 --num-prompts 16
  /tmp/site2/bin/py-spy record -r 1000 --function --nonblocking -f raw -o "$out/spy-struct.txt" \
    -- $py -m loom.cli bench structured --model $SM --load-format dummy --tokenizer-path .tok \
    --batch-size 16 --max-new-tokens 64 --num-prompts 64 2>&1 | grep -A2 "Loom structured" | tee -a "$log"
  $py bench/pyspy_top.py "$out/spy-struct.txt" 40 | tee -a "$log"
  $py bench/pyspy_top.py "$out/spy-struct.txt" 40 _sample_device | tee -a "$log"
  $py bench/pyspy_top.py "$out/spy-struct.txt" 25 run_structured | tee -a "$log"
  ;;
*)
  unknown_section
  ;;
esac
