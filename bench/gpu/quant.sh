#!/usr/bin/env bash
# Quantized weights on the H200.
#
#   bash bench/gpu/quant.sh OUTDIR SECTION
#
# Sections:
#   test   the GPU tests of the quantization methods and of the Triton GGUF / LoRA kernels
#   fp8    batch-1 decode of the Llama-3-8B shape, bf16 against --quantization fp8, and the
#          1000-request random-length workload with fp8 weights + the fp8 KV cache against bf16
#   gemv   the fp8 kernels' GPU tests, then bench/fp8_gemv.py at 1, 4, 8 and 16 rows
#   small  decode of the Llama-3-8B shape at batch 1 and 8, bf16 against --quantization fp8
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"

case $section in
test)
  $py -m pytest -q -m gpu tests/gpu/test_cuda_quantization.py tests/gpu/test_cuda_lora.py \
    tests/test_gguf_triton.py tests/test_lora_triton.py -p no:cacheprovider --tb=short 2>&1 |
    tail -15 | tee -a "$log"
  ;;
gemv)
  $py -m pytest -q -m gpu tests/test_fp8_triton.py -p no:cacheprovider --tb=short 2>&1 |
    tail -8 | tee -a "$log"
  $py bench/fp8_gemv.py --m 1 4 8 16 "${@:3}" 2>&1 | tee -a "$log"
  ;;
small)
  for b in 1 8; do
    latency "8b-bf16-b$b" --model $L8 --batch-size $b --input-len 128 --output-len 256
    latency "8b-fp8-b$b" --model $L8 --batch-size $b --input-len 128 --output-len 256 \
      --quantization fp8
  done
  ;;
fp8)
  latency "8b-bf16-b1" --model $L8 --batch-size 1 --input-len 128 --output-len 256
  latency "8b-fp8-b1" --model $L8 --batch-size 1 --input-len 128 --output-len 256 --quantization fp8
  wl=(--num-prompts 1000 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977)
  offline "8b-bf16-1000" --model $L8 "${wl[@]}" "${@:3}"
  offline "8b-fp8-kvfp8-1000" --model $L8 "${wl[@]}" --quantization fp8 \
    --kv-cache-dtype fp8_e4m3 "${@:3}"
  ;;
*)
  unknown_section
  ;;
esac
