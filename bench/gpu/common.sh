#!/usr/bin/env bash
# Shared set-up for the GPU benchmark scripts in bench/gpu/; each of them sources this file as
#   source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"
# and is run from the repository root as `bash bench/gpu/TOPIC.sh OUTDIR SECTION [ARGS...]`.
#
# Arguments: OUTDIR (created if missing) receives results.jsonl (one JSON line per run) and
# log.txt (each run's summary lines); SECTION picks what to run; ARGS pass on to the section.
#
# What the device machine needs, carried with the working tree (it has no network):
#   .whl/    FlashInfer as a stripped tarball (fi-stripped.txz or .tgz) and apache_tvm_ffi-*.whl;
#            optional fi-jit.txz: FlashInfer modules JIT-compiled on an earlier machine
#            (`bash bench/gpu/carry.sh OUTDIR ficache` packs them), loaded as AOT artifacts.
#            Without .whl, `--attention-backend auto` runs Triton for prefill and decode.
#   .whl2/   wheels for structured output and profiling: xgrammar, llguidance, pydantic, py-spy
#   .tok/    the SmolLM2 tokenizer (saved with save_pretrained), for `loom bench structured`
#   .whl3/   gguf, for the parity runs on the default model's GGUF
# One call carries at most 64 MiB: .whl in one call, .whl2 + .tok in the next; what a call
# installs under /tmp stays while the machine is warm.
# Environment: PYTHON (default python3).
set -uo pipefail
out=${1:?usage: bash $0 OUTDIR SECTION [ARGS...]}
section=${2:?usage: bash $0 OUTDIR SECTION [ARGS...]}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
log="$out/log.txt"
L8=configs/llama-3-8b.json
SM=configs/smollm2-135m.json
L8SMOLVOCAB=bench/configs/llama-3-8b-smolvocab.json  # Llama-3-8B's body, SmolLM2's vocabulary

# FlashInfer from .whl, into /tmp/fisite
fi_tar=$(ls .whl/fi-stripped.t?z 2>/dev/null | head -1)
if [ -n "$fi_tar" ] && [ ! -d /tmp/fisite/flashinfer ]; then
  mkdir -p /tmp/fisite &&
    $py -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$fi_tar" /tmp/fisite &&
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fisite \
      .whl/apache_tvm_ffi-*.whl 2>&1 | tail -2 | tee -a "$log"
fi
if [ -f .whl/fi-jit.txz ] && [ -d /tmp/fisite/flashinfer ] && [ ! -d /tmp/fisite/flashinfer/data/aot ]; then
  mkdir -p /tmp/fisite/flashinfer/data/aot &&
    $py -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" .whl/fi-jit.txz /tmp/fisite/flashinfer/data/aot &&
    ls /tmp/fisite/flashinfer/data/aot | tee -a "$log"
fi
if [ -d /tmp/fisite/flashinfer ]; then
  export PYTHONPATH="$PYTHONPATH:/tmp/fisite"
  nvcc_path=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
  export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$nvcc_path")")}
  export FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 FLASHINFER_WORKSPACE_BASE="$PWD/.cache/fi"
fi
# grammar libraries and py-spy from .whl2, into /tmp/site2
if [ -d .whl2 ] && [ ! -d /tmp/site2/xgrammar ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 \
    .whl2/*.whl $(ls .whl/apache_tvm_ffi-*.whl 2>/dev/null) 2>&1 | tail -2 | tee -a "$log"
fi
[ -d /tmp/site2/xgrammar ] && export PYTHONPATH="/tmp/site2:$PYTHONPATH"
# gguf from .whl3, into /tmp/site3
if [ -d .whl3 ] && [ ! -d /tmp/site3/gguf ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site3 \
    .whl3/*.whl 2>&1 | tail -2 | tee -a "$log"
fi
[ -d /tmp/site3/gguf ] && export PYTHONPATH="/tmp/site3:$PYTHONPATH"

offline() {  # TAG, then `loom bench offline` flags (dummy weights)
  echo "== $1" | tee -a "$log"; shift
  $py -m loom.cli bench offline --load-format dummy --skip-tokenizer-init \
    --result-file "$out/results.jsonl" "$@" 2>&1 | grep -v "^Loading" | tail -7 | tee -a "$log"
}
latency() {  # TAG, then `loom bench latency` flags (dummy weights)
  echo "== $1" | tee -a "$log"; shift
  $py -m loom.cli bench latency --load-format dummy --skip-tokenizer-init \
    --result-file "$out/results.jsonl" "$@" 2>&1 | grep -v "^Loading" | tail -3 | tee -a "$log"
}
structured() {  # TAG, then `loom bench structured` flags (dummy weights, .tok, 64 new tokens)
  echo "== $1" | tee -a "$log"; shift
  $py -m loom.cli bench structured --load-format dummy --tokenizer-path .tok \
    --max-new-tokens 64 --result-file "$out/results.jsonl" "$@" 2>&1 | grep -v "^Loading" |
    tail -4 | tee -a "$log"
}
gpu_kernel_profile() {  # bench/gpu_kernel_profile.py arguments
  $py bench/gpu_kernel_profile.py "$@" 2>&1 | grep -v "^Loading" | tail -32 | tee -a "$log"
}
unknown_section() {  # the script's usage header, then a failing status
  echo "unknown section: $section" >&2
  awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0" >&2
  exit 2
}
