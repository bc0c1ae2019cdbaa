#!/usr/bin/env bash
# Correctness on one GPU: the GPU-marked tests, and top-1 agreement with HF transformers at real
# shapes (random weights) and on trained weights (the default model's GGUF).
#
#   bash bench/gpu/correctness.sh OUTDIR SECTION [ARGS...]
#
# Needs: a CUDA GPU, transformers; .whl (FlashInfer) for its tests and its parity column; .whl2
# for the grammar tests; for bf16parity the GGUF joined by `bash bench/gpu/carry.sh OUTDIR
# ggufpart` and .whl3 (gguf) (see bench/gpu/common.sh). Results: OUTDIR/results.jsonl and
# OUTDIR/log.txt. Sections:
#   tests [PYTEST ARGS]  pytest -m gpu over tests/gpu, tests/test_conformance.py,
#                        tests/test_triton_backend.py and tests/test_gemv.py (extra arguments,
#                        e.g. -k EXPR, pass on), then tests/test_fused_ops.py on CUDA
#   parity [--init-range X]  bench/gpu_parity.py on SmolLM2's and Llama-3-8B's shapes: every
#                        backend in fp32 against torch_native, and bf16 against HF's top-1
#   bf16parity [GGUF] [FLAGS]  bench/bf16_parity.py --device cuda on the default model's GGUF
#                        (default /tmp/gguf/smollm2.gguf); FLAGS pass on, e.g.
#                        --attention-backend flash_attention
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"

case $section in
tests)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$log"
  $py -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1 | tee -a "$log"
  $py -m pytest -q -m gpu tests/gpu tests/test_conformance.py tests/test_triton_backend.py \
    tests/test_gemv.py -p no:cacheprovider --tb=short -rfE "${@:3}" 2>&1 | tail -40 | tee -a "$log"
  $py -m pytest -q tests/test_fused_ops.py -p no:cacheprovider 2>&1 | tail -5 | tee -a "$log"
  ;;
parity)
  $py bench/gpu_parity.py "${@:3}" $SM $L8 2>&1 | tail -4 | tee -a "$log" "$out/parity.jsonl"
  ;;
bf16parity)
  gguf=${3:-/tmp/gguf/smollm2.gguf}
  $py bench/bf16_parity.py --model "$gguf" --device cuda --result-file "$out/results.jsonl" "${@:4}" 2>&1 |
    tail -3 | tee -a "$log"
  ;;
*)
  unknown_section
  ;;
esac
