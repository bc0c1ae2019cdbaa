#!/usr/bin/env bash
# Sampling on one GPU: batch 32 greedy against top_p 0.9 + temperature 0.8 + frequency,
# presence and repetition penalties + a 16-token logit_bias (`loom bench offline --sampling
# {greedy,penalties}`, dummy weights, bf16), the fused Triton sampling kernels' host and device
# time per call, and which kernels a penalised step adds.
#
#   bash bench/gpu/sampling.sh OUTDIR SECTION
#
# Needs: a CUDA GPU; .whl (FlashInfer) for the default prefill; .whl2 for xgrammar's mask kernel
# in `host` (optional) and py-spy in `pyspy` (see bench/gpu/common.sh). Results:
# OUTDIR/results.jsonl and OUTDIR/log.txt. A run's first penalised batch compiles the sampling
# kernels; compare the runs after it. Sections:
#   smol     SmolLM2, 32 requests x 128 in / 512 out: one penalties run to compile, then greedy,
#            penalties, greedy, penalties
#   llama8b  Llama-3-8B, 32 requests x 128 in / 128 out: greedy, penalties, greedy, penalties
#   host     bench/sampling_host.py: host us to enqueue a call and device us per call, per variant
#   kprof    bench/gpu_kernel_profile.py on SmolLM2's decode steps alone at batch 32, greedy
#            then penalties
#   pyspy    py-spy (500 Hz) over the scheduler thread of SmolLM2's penalised batch-32 run;
#            the raw profile comes back as OUTDIR/spy-sampling.txt.gz
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"

case $section in
smol)
  offline "smol-b32-penalties-warmup" --model $SM --num-prompts 32 --input-len 128 --output-len 64 --max-running-requests 32 --sampling penalties
  for s in greedy penalties greedy penalties; do
    offline "smol-b32-$s" --model $SM --num-prompts 32 --input-len 128 --output-len 512 --max-running-requests 32 --sampling $s
  done
  ;;
llama8b)
  for s in greedy penalties greedy penalties; do
    offline "8b-b32-$s" --model $L8 --num-prompts 32 --input-len 128 --output-len 128 --max-running-requests 32 --sampling $s
  done
  ;;
host)
  $py bench/sampling_host.py "$out/results.jsonl" 2>&1 | grep -v "^Loading" | tail -30 | tee -a "$log"
  ;;
kprof)
  for s in greedy penalties; do
    $py bench/gpu_kernel_profile.py $SM 32 128 128 --decode-only --sampling $s 2>&1 |
      grep -v "^Loading" | grep -A24 '^configs' | tee -a "$log"
  done
  ;;
pyspy)
  spy=/tmp/site2/bin/py-spy
  $py -m loom.cli bench offline --model $SM --load-format dummy --skip-tokenizer-init --num-prompts 32 \
    --input-len 128 --output-len 64 --max-running-requests 32 --sampling penalties >/dev/null 2>&1  # compile
  $spy record -r 500 -f raw -o "$out/spy-sampling.txt" -- $py -m loom.cli bench offline \
    --model $SM --load-format dummy --skip-tokenizer-init --num-prompts 32 --input-len 128 \
    --output-len 512 --max-running-requests 32 --sampling penalties 2>&1 | grep "^Loom" | tee -a "$log"
  $py bench/pyspy_top.py "$out/spy-sampling.txt" 45 | tee -a "$log"
  gzip -f "$out/spy-sampling.txt"
  ;;
*)
  unknown_section
  ;;
esac
