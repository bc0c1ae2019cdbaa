#!/usr/bin/env bash
# More GPU comparisons (issue 4's remaining figures), one section per device call (each call is
# capped at 10 minutes): bash bench/h200_more.sh OUTDIR {tests|gemv|b1|workloads|parity|structured|sampling}
#   tests      GPU tests, including FlashInfer (if .whl/fi-stripped.tgz was carried) and the GEMV
#   gemv       cuBLAS vs Loom's Triton GEMV per weight shape (bench/gemv_micro.py)
#   b1         batch 1 decode: attention backends, GEMV, CUDA graphs and overlap on/off
#   workloads  the random-length workloads (8B: 1000 requests; SmolLM2: 256) and HF at batch 64
#   parity     bench/gpu_parity.py with peaked random weights (--init-range 0.1), every backend
#   structured constrained vs free decoding (needs .whl2: xgrammar, llguidance, pydantic; and
#              .tok: the SmolLM2 tokenizer saved with save_pretrained)
#   sampling   batch 32 greedy vs top_p + penalties + logit_bias (SmolLM2 shape, 512 out)
#   structuredx SmolLM2 structured, xgrammar only; structuredab: the fused grammar mask vs the
#              library's kernel (LOOM_GRAMMAR_MASK), SmolLM2 batch 16
#   tritondot  Loom's Triton decode: LOOM_TRITON_DECODE=plain vs dot (the fp16/bf16 default)
#   wl8b [flags]  the 1000-request 8B workload alone; wltriton: the same on Triton attention;
#              wlkvp: fp8 cache, Triton decode, 1 / 4 KV heads per program (LOOM_TRITON_KVP);
#              wlfp8: the same with --kv-cache-dtype fp8_e4m3
#   attn       decode attention alone (bench/attn_micro.py): Triton variants vs FlashInfer
#   b1lite     8B batch 1: Triton (16 / 8 splits) and FlashInfer
#   kprof, kprof512, kprofpre  per-kernel profiles (bench/gpu_kernel_profile.py; kprofpre: prefill;
#              kprofdec [k=v ...]: the decode steps alone at batch 512)
#   quicktests the GPU tests of the newest kernels; quickfused: the fused sampling ones
#   samplinghost  host / device us per sampling call (bench/sampling_host.py)
#   pyspy      py-spy profiles of the host in the structured and sampling runs (needs .whl2)
#   structured8b, sampling8b  issue 6 / 7 figures on Llama-3-8B's body (GPU-bound steps)
#   bf16parity [GGUF]  bench/bf16_parity.py on the default model's weights (default: the one
#              ggufpart joined from two calls' carried halves)
#   wlsplits   the 1000-request workload with LOOM_TRITON_SPLITS=1, 2, 4
#   defaults   8B and SmolLM2 batch 1 with the default backends; wl8bfi: the 1000-request workload
#              with FlashInfer decode; smol256: SmolLM2's 256-request workload; structured8bx: the
#              8B-body structured figures, xgrammar only
#   ficache    pack FlashInfer's JIT-compiled modules into OUTDIR/fi-jit.txz (carry it back as
#              .whl/fi-jit.txz: later machines load them as AOT modules, no rebuild)
# The wheels do not all fit one call's 64 MiB: carry .whl (FlashInfer) in one call and
# .whl2 + .tok in the next; what a call installs under /tmp stays while the machine is warm.
# Results: OUTDIR/results.jsonl (one JSON line per run) and OUTDIR/log.txt.
#   lora       the multi-LoRA GPU test, then SmolLM2 and Llama-3-8B at batch 64 with two
#              adapters in turn against the base model in the same engine (--request-lora)
#   hf64       Llama-3-8B, 64 x 128 / 256: Loom and HF generate() at batch 64 in one process
#   firstreq [MODEL]  bench/first_request.py: a fresh engine's first batch-1 requests, timed,
#              with the Triton kernels each compiled (an empty Triton cache)
# Session 12's plan (carry .whl + .whl2 + .tok; ~1 min of device time per machine start):
#   call 1: lora (multi-LoRA: the GPU test, then LoRA / base at batch 64 on both shapes), then
#           quick10 and the FlashInfer engine tests once more (allow 60 s for FlashInfer's first
#           load on a fresh machine)
# Session 11's plan (done) (carry .whl + .whl2 + .tok; ~1 min of device time per machine start):
#   call 1: defaults (8B and SmolLM2 batch 1: last measured in session 4, 224.1 / 1,140.6
#           tok/s against 220 / 500; decode kernels, graphs, sampling and overlap have changed
#           since), then wl8b and wl8b --kv-cache-dtype fp8_e4m3 once more (session 10 call 4:
#           12,398 / 13,522 tok/s) and smol256 (a batch's outputs now reach the caller as
#           one list a step: SmolLM2's host-bound steps should gain; not measured yet)
#   call 2: what overlap and CUDA graphs gain on today's code: wl8b --kv-cache-dtype fp8_e4m3
#           with --disable-overlap-schedule, and smol256 with --disable-overlap-schedule and
#           with --disable-cuda-graph (the on/off ratios in the tables are from session 2)
# Session 10, call 4: wl8b fp8 and bf16, each with the thread and the process engine backend
#   (chained steps evict cached pages for room; batch outputs consumed as they arrive)
# Session 10, call 3: quick10 (prefill overlap, FlashInfer plan events, decode programs
#   longest first), wl8b fp8 (default: all of it, collector frozen), wl8b fp8 with
#   LOOM_TRITON_ORDER=0, wl8b fp8 --engine-backend process, wl8b bf16
# Session 10's plan, call 2 (done in session 10): quick10, then wl8b (bf16: admission by
#   the bounded peak; all 1,000 requests should be admitted in ~70 prefills) and wl8b
#   --kv-cache-dtype fp8_e4m3 (the device's idle time before chained steps, now printed)
# Session 10's plan (carry .whl + .whl2 + .tok; ~1 min of device time per machine start):
#   call 1: quick9b first (the start-up warm-up now runs in every GPU engine: built after the
#           last call of session 9, never run on a GPU), then wl8b (bf16: the chain while
#           requests wait, built after the last call; session 9 chained 518 of 1,203 steps),
#           wl8b --kv-cache-dtype fp8_e4m3 twice (12,214 and 11,897 in session 9), defaults
#           (batch-1 figures after the overlap changes)
#   call 2: structfinal again; the warm-up's own time (loom serve's log: "warm-up took")
# Session 9's plan (done) (carry .whl + .whl2 + .tok; ~1 min of device time per machine start):
#   call 1: wlchunk (the fp8 workload with 16,384-token prefill chunks against 8,192: its 70
#           prefills run back to back, each ~14 ms of wall over its kernels in kprofpre, and
#           12,000 tok/s needs ~1 s less in all), structured64 (SmolLM2 batch 16 over 64
#           prompts, twice: less noise than 32)
#   call 2: attnsweep again after any fp8 decode kernel change (the fp8 kernel reads 2.6 TB/s
#           at best against bf16's 4.0); quick8 if kernels changed
# Session 8's plan (done) (carry .whl + .whl2 + .tok; ~1 min of device time per machine start):
#   call 1: quick7 (GPU tests of the sampling kernels; the interval's relative upper end is new),
#           last7 (SmolLM2 batch 32 greedy vs penalties), kprofsampling (which kernels the
#           penalised step adds: ~115 us of device time a step against 51 us in the
#           microbenchmark), structuredx with LOOM_SAMPLING_GRAPH=0 and =1 after a warm-up
#   call 2: wl8b with LOOM_TRITON_KVP=1 and 2 in one call (bf16: two heads a program were 6%
#           faster at 256 x 900 in attn_micro), wlfp8 again (12,000 on fp8: 11,347-11,940 so far)
# Session 7's plan (done) (carry .whl + .whl2 + .tok; ~1 min of device time per machine start):
#   call 1: quickfused (the SamplingGraph GPU tests), samplinghost (incl. 16 x 6 vs 32 x 5 vs
#           64 x 4 thresholds x rounds), samplinggraph (first penalties run of each setting
#           compiles: compare the later ones), structuredab
#   call 2: if the graphs pay, flip LOOM_SAMPLING_GRAPH's default and re-run sampling /
#           structuredx; pyspysampling for the rest of SmolLM2's host time; attn (fp8 sweep)
# Session 6's plan (done) (carry .whl, 31 MB with FlashInfer's JIT modules incl. fp8; .whl2 + .tok for
# the structured sections; the machine's start took ~1 min of device time in session 5):
#   call 1 (carry .whl and .whl2: xgrammar is the oracle of the fused-bitmask GPU test): quick5
#           (incl. the multi-chunk sampling kernels on a 128,256-wide row, the fused grammar
#           bitmask, the fp8 Triton decode test), sampling8b, sampling (the multi-program sampling kernels; the first
#           penalties run of each section compiles: compare the second)
#   call 2: wl8b (the 1000-request workload on the default) and wl8b --kv-cache-dtype fp8_e4m3
#           (the new fp8 auto: Triton decode up to batch 32, FlashInfer above), wl8b
#           --enable-mixed-chunk (decode rides along the ~90 small capacity-limited prefills),
#           attn (128-token tiles, 8 warps, 2-4 pipeline stages for the Triton decode over bf16
#           and fp8: which makes fp8 reads pay), structured
#           (SmolLM2, now with the whole llguidance batch-16 row: give it 200 s)
set -uo pipefail
out=${1:?usage: bench/h200_more.sh OUTDIR SECTION}
section=${2:?usage: bench/h200_more.sh OUTDIR SECTION}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
log="$out/log.txt"

fi_tar=$(ls .whl/fi-stripped.t?z 2>/dev/null | head -1)
if [ -n "$fi_tar" ] && [ ! -d /tmp/fisite/flashinfer ]; then
  mkdir -p /tmp/fisite && $py -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$fi_tar" /tmp/fisite &&
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fisite \
      .whl/apache_tvm_ffi-*.whl 2>&1 | tail -2 | tee -a "$log"
fi
# FlashInfer's modules JIT-compiled on an earlier machine (the "ficache" section) load as AOT
# artifacts (flashinfer/data/aot/NAME/NAME.so) without a rebuild.
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

offline() {  # tag, then loom bench offline flags
  echo "== $1" | tee -a "$log"; shift
  $py -m loom.cli bench offline --load-format dummy --skip-tokenizer-init \
    --result-file "$out/results.jsonl" "$@" 2>&1 | grep -v "^Loading" | tail -7 | tee -a "$log"
}
latency() {  # tag, then loom bench latency flags
  echo "== $1" | tee -a "$log"; shift
  $py -m loom.cli bench latency --load-format dummy --skip-tokenizer-init \
    --result-file "$out/results.jsonl" "$@" 2>&1 | grep -v "^Loading" | tail -3 | tee -a "$log"
}
structured() {  # loom bench structured on SmolLM2's shape (dummy weights, .tok), 64 new tokens
  $py -m loom.cli bench structured --model $SM --load-format dummy --tokenizer-path .tok \
    --max-new-tokens 64 --result-file "$out/results.jsonl" "$@" 2>&1 | grep -v "^Loading" |
    tail -3 | tee -a "$log"
}
if [ -d .whl2 ] && [ ! -d /tmp/site2/xgrammar ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 \
    .whl2/*.whl $(ls .whl/apache_tvm_ffi-*.whl 2>/dev/null) 2>&1 | tail -2 | tee -a "$log"
fi
[ -d /tmp/site2/xgrammar ] && export PYTHONPATH="/tmp/site2:$PYTHONPATH"
# .whl3: gguf (for bf16parity on the default model's GGUF)
if [ -d .whl3 ] && [ ! -d /tmp/site3/gguf ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site3 \
    .whl3/*.whl 2>&1 | tail -2 | tee -a "$log"
fi
[ -d /tmp/site3/gguf ] && export PYTHONPATH="/tmp/site3:$PYTHONPATH"
L8=configs/llama-3-8b.json
SM=configs/smollm2-135m.json

case $section in
ficache)
  # The compiled FlashInfer modules, packed to come back under $out (carry them as .whl/fi-jit.txz)
  $py - "$out/fi-jit.txz" <<'PYEOF' 2>&1 | tee -a "$log"
import pathlib, sys, tarfile
sos = [p for p in pathlib.Path(".cache/fi").rglob("*.so") if p.parent.name == p.stem]
sos += [p for p in pathlib.Path("/tmp/fisite/flashinfer/data/aot").rglob("*.so")]
with tarfile.open(sys.argv[1], "w:xz", preset=6) as tar:
    for p in sos:
        print(p, p.stat().st_size)
        tar.add(p, arcname=f"{p.stem}/{p.name}")
print(sys.argv[1], pathlib.Path(sys.argv[1]).stat().st_size)
PYEOF
  ;;
wl8b)
  offline "8b-1000-random" --model $L8 --num-prompts 1000 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977 "${@:3}"
  ;;
structuredproc)
  # the scheduler in its own process (as `loom serve` runs it): no interpreter lock shared with
  # the benchmark's detokenising
  for bs in 1 16; do
    $py -m loom.cli bench structured --model $SM --load-format dummy --tokenizer-path .tok \
      --engine-backend process --batch-size $bs --num-prompts $([ $bs = 1 ] && echo 8 || echo 32) \
      --max-new-tokens 64 --result-file "$out/results.jsonl" 2>&1 | grep -v "^Loading" | tail -2 | tee -a "$log"
  done
  ;;
structured8b)
  # Llama-3-8B's body with SmolLM2's vocabulary (bench/configs/llama-3-8b-smolvocab.json): a
  # GPU-bound step (~4.5 ms at batch 1), so the grammar's host work can hide behind it
  for be in xgrammar llguidance; do
    for bs in 1 16; do
      $py -m loom.cli bench structured --model bench/configs/llama-3-8b-smolvocab.json --load-format dummy \
        --tokenizer-path .tok --grammar-backend $be --batch-size $bs --num-prompts $([ $bs = 1 ] && echo 8 || echo 32) \
        --max-new-tokens 64 --result-file "$out/results.jsonl" 2>&1 | grep -v "^Loading" | tail -2 | tee -a "$log"
    done
  done
  ;;
sampling8b)
  for s in greedy penalties greedy penalties; do
    offline "8b-b32-$s" --model $L8 --num-prompts 32 --input-len 128 --output-len 128 --max-running-requests 32 --sampling $s
  done
  ;;
wlfp8)
  # the 1000-request workload with an fp8 KV cache: FlashInfer for prefill and decode (a 16-bit
  # query over fp8 K/V; its fp8 modules JIT-compile on first use: run ficache after), then the
  # default backends
  # (default first: since session 7 it decodes with Triton, two KV heads a program)
  offline "8b-1000-random-fp8kv" --model $L8 --num-prompts 1000 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977 --kv-cache-dtype fp8_e4m3
  offline "8b-1000-random-fp8kv-fi" --model $L8 --num-prompts 1000 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977 --kv-cache-dtype fp8_e4m3 --attention-backend flashinfer
  ;;
wlkvp)
  # the 1000-request workload over an fp8 cache with Triton decode at every batch size, KV heads
  # per decode program 1 / 4 (LOOM_TRITON_KVP; run attn first to pick the count)
  for n in ${KVPS:-1 4}; do
    LOOM_TRITON_KVP=$n offline "8b-1000-random-fp8kv-triton-kvp$n" --model $L8 --num-prompts 1000 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977 --kv-cache-dtype fp8_e4m3 --decode-attention-backend triton
  done
  ;;
wltriton)
  offline "8b-1000-random-triton" --model $L8 --num-prompts 1000 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977 --attention-backend triton
  ;;
kprofpre)
  # one 8k-token prefill step (8 x 1024) and 32 x 1024 in 8k chunks: where prefill's time goes
  $py bench/gpu_kernel_profile.py $L8 8 1024 1 2>&1 | grep -v "^Loading" | tail -32 | tee -a "$log"
  $py bench/gpu_kernel_profile.py $L8 32 1024 1 2>&1 | grep -v "^Loading" | tail -32 | tee -a "$log"
  ;;
kprof512)
  $py bench/gpu_kernel_profile.py $L8 512 800 16 2>&1 | grep -v "^Loading" | tail -32 | tee -a "$log"
  ;;
kprofdec)
  # the decode steps alone at batch 512 x ~900 tokens (the 1000-request workload's regime):
  # kernels of a 17-token run minus those of a 1-token run; further k=v engine kwargs pass on
  $py bench/gpu_kernel_profile.py $L8 512 900 17 --decode-only "${@:3}" 2>&1 | grep -v "^Loading" | tail -32 | tee -a "$log"
  ;;
ggufpart)
  # The default model's GGUF (98 MB) exceeds one call's 64 MiB: carry .gguf/smollm2.gguf.part-00
  # (+ .md5) in one call and .gguf/smollm2.gguf.part-01 in the next, started within the machine's
  # 30 s idle window; each call keeps its part in /tmp/gguf and the last one joins them.
  mkdir -p /tmp/gguf && cp .gguf/smollm2.gguf.* /tmp/gguf/ 2>/dev/null
  if [ -f /tmp/gguf/smollm2.gguf.part-00 ] && [ -f /tmp/gguf/smollm2.gguf.part-01 ]; then
    cat /tmp/gguf/smollm2.gguf.part-0? > /tmp/gguf/smollm2.gguf
    echo "gguf joined: $(md5sum /tmp/gguf/smollm2.gguf | cut -d' ' -f1) (want $(cat /tmp/gguf/smollm2.gguf.md5))" | tee -a "$log"
  else
    ls /tmp/gguf | tee -a "$log"
  fi
  ;;
bf16parity)
  # the default model's GGUF: a path, or the one ggufpart joined
  $py bench/bf16_parity.py --model "${3:-/tmp/gguf/smollm2.gguf}" --device cuda --result-file "$out/results.jsonl" 2>&1 | tail -3 | tee -a "$log"
  ;;
pyspy)
  # where the host's time goes in the host-bound small-model runs (py-spy from .whl2)
  spy=/tmp/site2/bin/py-spy
  $spy record -r 500 -f raw -o "$out/spy-structured.txt" -- $py -m loom.cli bench structured \
    --model $SM --load-format dummy --tokenizer-path .tok --batch-size 16 --num-prompts 32 \
    --max-new-tokens 64 2>&1 | grep "Loom structured" | tee -a "$log"
  $py bench/pyspy_top.py "$out/spy-structured.txt" 45 | tee -a "$log"
  $spy record -r 500 -f raw -o "$out/spy-sampling.txt" -- $py -m loom.cli bench offline \
    --model $SM --load-format dummy --skip-tokenizer-init --num-prompts 32 --input-len 128 \
    --output-len 512 --max-running-requests 32 --sampling penalties 2>&1 | grep "^Loom" | tee -a "$log"
  $py bench/pyspy_top.py "$out/spy-sampling.txt" 45 | tee -a "$log"
  ;;
pyspysampling)
  # where the host's time goes in SmolLM2's penalised batch-32 steps (the sampling part of
  # pyspy alone, which session 6's call cut off)
  spy=/tmp/site2/bin/py-spy
  $py -m loom.cli bench offline --model $SM --load-format dummy --skip-tokenizer-init --num-prompts 32 \
    --input-len 128 --output-len 64 --max-running-requests 32 --sampling penalties >/dev/null 2>&1  # compile
  $spy record -r 500 -f raw -o "$out/spy-sampling.txt" -- $py -m loom.cli bench offline \
    --model $SM --load-format dummy --skip-tokenizer-init --num-prompts 32 --input-len 128 \
    --output-len 512 --max-running-requests 32 --sampling penalties 2>&1 | grep "^Loom" | tee -a "$log"
  $py bench/pyspy_top.py "$out/spy-sampling.txt" 45 | tee -a "$log"
  gzip -f "$out/spy-sampling.txt"
  ;;
quicktests)
  $py -m pytest -q -m gpu tests/gpu -k "penalty or argmax or rotary or fused_sampling or large_batches or fp8" -p no:cacheprovider 2>&1 | tail -5 | tee -a "$log"
  $py -m pytest -q tests/test_triton_backend.py tests/test_conformance.py -k "half or variants or cuda or hybrid or fused_penalties" -p no:cacheprovider 2>&1 | tail -3 | tee -a "$log"
  ;;
quick5)
  # session 5: Triton decode splits by batch size and fp16 dots over fp8 K/V, the fp8 auto
  # switch, the 8-threshold cut search in the sampling kernel
  $py -m pytest -q -m gpu tests/gpu -k "fused_sampling or large_batches or fp8" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -40 | tee -a "$log"
  $py -m pytest -q tests/test_triton_backend.py -k "half_precision or fused_penalties or variants" -p no:cacheprovider 2>&1 | tail -3 | tee -a "$log"
  ;;
quick8)
  # session 8: the sampling kernels compile once across seeds and batch sizes; the fp8 decode's
  # slot prefetch with two KV heads a program (kernel tests, then the engines over fp8)
  $py -m pytest -q -m gpu tests/gpu -k "recompile or fused_sampling or sampling_graph or fp8" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -15 | tee -a "$log"
  $py -m pytest -q tests/test_triton_backend.py -k "half_precision or several_kv" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -5 | tee -a "$log"
  ;;
quick10)
  # session 10: one KV split writes the decode output itself (no merge kernel); decode steps
  # timed on the device; graphs over large batches, fp8 engines
  $py -m pytest -q -m gpu tests/gpu -k "timed_on_the_device or large_batches or fp8 or graph" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -15 | tee -a "$log"
  $py -m pytest -q tests/test_triton_backend.py -k "half_precision or variants" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -5 | tee -a "$log"
  ;;
wlnoorder)
  LOOM_TRITON_ORDER=0 offline "8b-1000-random-noorder" --model $L8 --num-prompts 1000 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977 "${@:3}"
  ;;
wlnogc)
  # the 1000-request workload with the collector not frozen after start-up (LOOM_GC_FREEZE=0)
  LOOM_GC_FREEZE=0 offline "8b-1000-random-nogcfreeze" --model $L8 --num-prompts 1000 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977 "${@:3}"
  ;;
quick9)
  # session 9: the CUDA graph runner's packed static buffers (one [5, max_bs] tensor, three
  # copies a replay): every graph test, large batches across buckets, overlap
  $py -m pytest -q -m gpu tests/gpu -k "graph or large_batches or overlap or recompile" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -15 | tee -a "$log"
  ;;
wlchunk)
  # the 1000-request workload over fp8_e4m3 with 16,384-token prefill chunks, then the default
  # (8,192 on CUDA): half the back-to-back prefill steps
  for c in 16384 8192; do
    offline "8b-1000-random-fp8kv-chunk$c" --model $L8 --num-prompts 1000 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977 --kv-cache-dtype fp8_e4m3 --chunked-prefill-size $c
  done
  ;;
structured64)
  # SmolLM2 batch 16, xgrammar, 64 prompts (~260 timed steps each way), twice
  for i in 1 2; do
    $py -m loom.cli bench structured --model $SM --load-format dummy --tokenizer-path .tok \
      --batch-size 16 --num-prompts 64 --max-new-tokens 64 --result-file "$out/results.jsonl" \
      2>&1 | grep -v "^Loading" | tail -3 | tee -a "$log"
  done
  ;;
wlfp8pf)
  # the 1000-request workload over fp8_e4m3: the default (slots prefetched with two KV heads a
  # program) against LOOM_TRITON_PREFETCH=0
  for pf in 1 0; do
    LOOM_TRITON_PREFETCH=$pf offline "8b-1000-random-fp8kv-pf$pf" --model $L8 --num-prompts 1000 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977 --kv-cache-dtype fp8_e4m3
  done
  ;;
quick7)
  # session 7: the sampling kernels with 3 rounds and the pick kernel's settling, the Gumbel
  # noise's column mapping, sampling graphs, fp8 auto (Triton decode at every batch size)
  $py -m pytest -q -m gpu tests/gpu -k "fused_sampling or sampling_graph or gumbel or fp8" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -30 | tee -a "$log"
  $py -m pytest -q tests/test_triton_backend.py -k "half_precision or kv_heads" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -5 | tee -a "$log"
  ;;
final7)
  # session 7, last call: the Triton decode reading two KV heads a program on the GPU (kernel
  # tests over bf16 / fp8), batch 32 greedy vs penalties on SmolLM2 with the sampling graphs now
  # on by default, structured batch 16 on SmolLM2, the 1000-request bf16 workload with 2 KV heads
  # a program (LOOM_TRITON_KVP=2)
  $py -m pytest -q tests/test_triton_backend.py -k "half_precision and None-False-2" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -5 | tee -a "$log"
  for s in greedy penalties greedy penalties; do
    offline "smol-b32-$s" --model $SM --num-prompts 32 --input-len 128 --output-len 512 --max-running-requests 32 --sampling $s
  done
  $py -m loom.cli bench structured --model $SM --load-format dummy --tokenizer-path .tok \
    --batch-size 16 --num-prompts 32 --max-new-tokens 64 --result-file "$out/results.jsonl" 2>&1 | grep -v "^Loading" | tail -1 | tee -a "$log"
  LOOM_TRITON_KVP=2 offline "8b-1000-random-kvp2" --model $L8 --num-prompts 1000 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977
  ;;
kprofsampling)
  # which kernels a penalised SmolLM2 decode step adds to a greedy one at batch 32 (session 7:
  # ~115 us more device time a step, against 51 us in bench/sampling_host.py); then the same
  # with the sampling graphs
  for s in greedy penalties; do
    $py bench/gpu_kernel_profile.py $SM 32 128 128 --decode-only --sampling $s 2>&1 | grep -v "^Loading" | grep -A24 '^configs' | tee -a "$log"
  done
  LOOM_SAMPLING_GRAPH=1 $py bench/gpu_kernel_profile.py $SM 32 128 128 --decode-only --sampling penalties 2>&1 | grep -v "^Loading" | grep -A24 '^configs' | tee -a "$log"
  ;;
last7)
  # SmolLM2 batch 32 greedy vs penalties after the search interval became relative to the row's
  # range (a warm-up penalties run compiles the kernels first)
  offline "smol-b32-penalties-warmup" --model $SM --num-prompts 32 --input-len 128 --output-len 64 --max-running-requests 32 --sampling penalties
  for s in greedy penalties greedy penalties; do
    offline "smol-b32-$s" --model $SM --num-prompts 32 --input-len 128 --output-len 512 --max-running-requests 32 --sampling $s
  done
  ;;
quickfused)
  $py -m pytest -q -m gpu tests/gpu -k "fused_sampling or sampling_graph" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -30 | tee -a "$log"
  ;;
samplinggraph)
  # batch 32 greedy vs penalties on SmolLM2 (512 steps) and the 8B, with the sampling kernels in
  # CUDA graphs (LOOM_SAMPLING_GRAPH=1) and without, alternating; then structured batch 16
  for g in 1 0 1 0; do
    for s in greedy penalties; do
      LOOM_SAMPLING_GRAPH=$g offline "smol-b32-$s-graph$g" --model $SM --num-prompts 32 --input-len 128 --output-len 512 --max-running-requests 32 --sampling $s
    done
  done
  for g in 1 0; do
    LOOM_SAMPLING_GRAPH=$g offline "8b-b32-penalties-graph$g" --model $L8 --num-prompts 32 --input-len 128 --output-len 128 --max-running-requests 32 --sampling penalties
  done
  ;;
samplinghost)
  # host and device microseconds per sampling call, per variant (bench/sampling_host.py)
  $py bench/sampling_host.py "$out/results.jsonl" 2>&1 | grep -v "^Loading" | tail -30 | tee -a "$log"
  ;;
quick4)
  # session 4's GPU tests: fused penalties in the sampling kernel, hybrid backends, graphs
  $py -m pytest -q -m gpu tests/gpu -k "fused_sampling or large_batches or fp8" -p no:cacheprovider 2>&1 | tail -3 | tee -a "$log"
  $py -m pytest -q tests/test_triton_backend.py -k "hybrid or fused_penalties or variants" -p no:cacheprovider 2>&1 | tail -3 | tee -a "$log"
  ;;
sampling8b2)
  for s in greedy penalties; do
    offline "8b-b32-$s" --model $L8 --num-prompts 32 --input-len 128 --output-len 128 --max-running-requests 32 --sampling $s
  done
  ;;
defaults)
  # the defaults as they now are (FlashInfer prefill + Triton decode on CUDA)
  latency "8b-b1-default" --model $L8 --batch-size 1 --input-len 128 --output-len 256 "${@:3}"
  offline "smol-b1-default" --model $SM --num-prompts 2 --input-len 128 --output-len 256 --max-running-requests 1 "${@:3}"
  ;;
lora)
  # multi-LoRA on the GPU (built in session 11, never run on one): the GPU test against peft,
  # then the same requests on the base model and with two random rank-16 adapters in turn
  # (bench/make_lora.py; steps with an adapter run eagerly, outside the CUDA graphs)
  $py -m pytest -q -m gpu tests/gpu/test_cuda_lora.py -p no:cacheprovider --tb=short 2>&1 | tail -5 | tee -a "$log"
  for m in $SM $L8; do
    for s in 1 2; do $py bench/make_lora.py --model $m --out /tmp/lora-$(basename $m .json)-$s --seed $s | tee -a "$log"; done
    t=$(basename $m .json)
    offline "$t-lora-ab-b64" --model $m --num-prompts 64 --input-len 128 --output-len 256 \
      --lora-paths a=/tmp/lora-$t-1 b=/tmp/lora-$t-2 --request-lora a b "${@:3}"
  done
  ;;
hf64)
  # Loom against HF transformers generate() at batch 64 (Llama-3-8B shape, 64 x 128 / 256)
  offline "8b-b64-vs-hf" --model $L8 --num-prompts 64 --input-len 128 --output-len 256 --compare-hf --hf-batch-size 64 --mem-fraction-static 0.5
  ;;
firstreq)
  # what a fresh engine's first batch-1 requests pay after the start-up warm-up, with an empty
  # Triton cache (a fresh machine): per request, its time and the kernels compiled inside it
  tc=/tmp/tc-first-$RANDOM && rm -rf $tc
  TRITON_CACHE_DIR=$tc $py bench/first_request.py --model "${3:-$SM}" --result-file "$out/results.jsonl" 2>&1 |
    grep "^request" | tee -a "$log"
  ;;
wlsplits)
  # Triton decode at scale with fewer KV splits (the default splits 8 ways above batch 4)
  for n in 1 2 4; do
    LOOM_TRITON_SPLITS=$n offline "8b-1000-random-splits$n" --model $L8 --num-prompts 1000 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977
  done
  ;;
wl8bfi)
  # the 1000-request workload with FlashInfer decode too (the default before session 4)
  offline "8b-1000-random-fidecode" --model $L8 --num-prompts 1000 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977 --decode-attention-backend flashinfer
  ;;
smol256)
  offline "smol-256-random" --model $SM --num-prompts 256 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977 "${@:3}"
  ;;
structuredx)
  # SmolLM2, xgrammar only (the default backend): host-bound steps, the fused bitmask's case
  for bs in 1 16; do
    $py -m loom.cli bench structured --model $SM --load-format dummy --tokenizer-path .tok \
      --batch-size $bs --num-prompts $([ $bs = 1 ] && echo 8 || echo 32) \
      --max-new-tokens 64 --result-file "$out/results.jsonl" 2>&1 | grep -v "^Loading" | tail -4 | tee -a "$log"
  done
  ;;
pyspystruct)
  # where the host time of SmolLM2's constrained batch-16 steps goes: one run to warm the
  # kernel caches, then py-spy (by function, without pausing the process) over a run of 64
  # prompts; the scheduler thread's functions, then the stacks under _sample_device alone
  st() { $py -m loom.cli bench structured --model $SM --load-format dummy --tokenizer-path .tok \
    --batch-size 16 --max-new-tokens 64 --result-file "$out/results.jsonl" "$@"; }
  st --num-prompts 16 2>&1 | grep "Loom structured" | tee -a "$log"
  /tmp/site2/bin/py-spy record -r 1000 --function --nonblocking -f raw -o "$out/spy-struct.txt" \
    -- $py -m loom.cli bench structured --model $SM --load-format dummy --tokenizer-path .tok \
    --batch-size 16 --max-new-tokens 64 --num-prompts 64 2>&1 | grep -A2 "Loom structured" | tee -a "$log"
  $py bench/pyspy_top.py "$out/spy-struct.txt" 40 | tee -a "$log"
  $py bench/pyspy_top.py "$out/spy-struct.txt" 40 _sample_device | tee -a "$log"
  $py bench/pyspy_top.py "$out/spy-struct.txt" 25 run_structured | tee -a "$log"
  ;;
quick9b)
  # session 9: graph replays of a chained batch that lost finished requests (ids gathered on
  # the device), the masked argmax against xgrammar's kernel
  $py -m pytest -q -m gpu tests/gpu -k "graph or large_batches or overlap or grammar_bitmask or synchronise" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -15 | tee -a "$log"
  ;;
structllg)
  # SmolLM2, llguidance, the scheduler in its own process: batch 16 over 64 prompts, batch 1
  # over 16
  for bs in 16 1; do
    n=$([ $bs = 1 ] && echo 16 || echo 64)
    $py -m loom.cli bench structured --model $SM --load-format dummy --tokenizer-path .tok \
      --grammar-backend llguidance --engine-backend process --batch-size $bs --num-prompts $n \
      --max-new-tokens 64 --result-file "$out/results.jsonl" 2>&1 | grep -v "^Loading" | tail -3 | tee -a "$log"
  done
  ;;
structfinal)
  # SmolLM2 xgrammar, 64 prompts: batch 16 with the scheduler in its own process twice, on the
  # thread backend once, batch 1 (16 prompts) in its own process
  for i in 1 2; do echo "== process, batch 16" | tee -a "$log"; structured --num-prompts 64 --engine-backend process --batch-size 16; done
  echo "== thread, batch 16" | tee -a "$log"; structured --num-prompts 64 --batch-size 16
  echo "== process, batch 1" | tee -a "$log"; structured --num-prompts 16 --engine-backend process --batch-size 1
  ;;
structmaskab)
  # SmolLM2 batch 16, xgrammar, 64 prompts, scheduler process: LOOM_GRAMMAR_MASK=auto (greedy
  # batches take masked_argmax) against fused, then auto on the thread backend, then batch 1
  for m in auto fused; do
    echo "== LOOM_GRAMMAR_MASK=$m, process" | tee -a "$log"
    LOOM_GRAMMAR_MASK=$m structured --num-prompts 64 --engine-backend process --batch-size 16
  done
  echo "== auto, thread" | tee -a "$log"; structured --num-prompts 64 --batch-size 16
  echo "== auto, process, batch 1, 16 prompts" | tee -a "$log"
  structured --num-prompts 16 --engine-backend process --batch-size 1
  ;;
structuredproc64|structuredproc16)
  # SmolLM2 batch 16, xgrammar, 64 (or 32) prompts, the scheduler in its own process (as loom
  # serve runs it: no interpreter lock shared with the detokenising front end), twice
  n=$([ "$section" = structuredproc64 ] && echo 64 || echo 32)
  for i in 1 2; do structured --engine-backend process --batch-size 16 --num-prompts $n; done
  ;;
structuredgraph)
  # SmolLM2 batch 16, xgrammar: sampling graphs off / on, alternating, twice (on: grammar
  # batches adopt shared graphs; the line reports captures and adoptions, and each run's
  # decode-step host phases)
  for i in 1 2; do
    for g in 0 1; do
      echo "-- LOOM_SAMPLING_GRAPH=$g" | tee -a "$log"
      LOOM_SAMPLING_GRAPH=$g $py -m loom.cli bench structured --model $SM --load-format dummy \
        --tokenizer-path .tok --batch-size 16 --num-prompts 32 --max-new-tokens 64 \
        --result-file "$out/results.jsonl" 2>&1 | grep -v "^Loading" | tail -3 | tee -a "$log"
    done
  done
  ;;
structuredab)
  # SmolLM2 batch 16, xgrammar: the grammar mask in the fused sampling kernels vs the library's
  # own kernel + argmax (LOOM_GRAMMAR_MASK), alternating, twice
  for i in 1 2; do
    for mode in fused library; do
      echo "-- LOOM_GRAMMAR_MASK=$mode" | tee -a "$log"
      LOOM_GRAMMAR_MASK=$mode $py -m loom.cli bench structured --model $SM --load-format dummy \
        --tokenizer-path .tok --batch-size 16 --num-prompts 32 --max-new-tokens 64 \
        --result-file "$out/results.jsonl" 2>&1 | grep -v "^Loading" | tail -1 | tee -a "$log"
    done
  done
  ;;
structured8bx)
  for bs in 1 16; do
    $py -m loom.cli bench structured --model bench/configs/llama-3-8b-smolvocab.json --load-format dummy \
      --tokenizer-path .tok --batch-size $bs --num-prompts $([ $bs = 1 ] && echo 8 || echo 32) \
      --max-new-tokens 64 --result-file "$out/results.jsonl" 2>&1 | grep -v "^Loading" | tail -2 | tee -a "$log"
  done
  ;;
attnfp8)
  # session 9: fp8 decode tiles / heads a program (call 2 also ran an integer fp8 -> fp16
  # conversion, since removed: slower on every row)
  $py bench/attn_micro.py --sweep-fp8 "$out/results.jsonl" 2>&1 | grep -E "^bs|rror" | tee -a "$log"
  ;;
structkprof)
  # session 9: a constrained SmolLM2 batch-16 decode step on the device: busy time, idle gaps
  # and what ended them, kernels against the free step's (bench/structured_kprof.py)
  $py bench/structured_kprof.py $SM .tok 16 64 "${@:3}" 2>&1 | grep -v "^Loading\|USDT" | tail -40 | tee -a "$log"
  ;;
attnsweep)
  # the Triton decode's launch options at the 8B workload's mean decode step (512 x 850)
  $py bench/attn_micro.py --sweep "$out/results.jsonl" 2>&1 | grep -E "^bs|rror" | tee -a "$log"
  ;;
attn)
  $py bench/attn_micro.py "$out/results.jsonl" 2>&1 | grep -E "^bs|rror" | tee -a "$log"
  ;;
b1lite)
  latency "8b-b1-triton" --model $L8 --batch-size 1 --input-len 128 --output-len 256 --attention-backend triton
  LOOM_TRITON_SPLITS=8 latency "8b-b1-triton-splits8" --model $L8 --batch-size 1 --input-len 128 --output-len 256 --attention-backend triton
  latency "8b-b1-flashinfer" --model $L8 --batch-size 1 --input-len 128 --output-len 256 --attention-backend flashinfer
  ;;
kprof)
  # kernel profiles: 8B batch 1 (graphs), 8B batch 256 decode, 8B prefill-heavy
  $py bench/gpu_kernel_profile.py $L8 1 128 64 attention_backend=triton 2>&1 | grep -v "^Loading" | tail -32 | tee -a "$log"
  $py bench/gpu_kernel_profile.py $L8 256 768 32 2>&1 | grep -v "^Loading" | tail -32 | tee -a "$log"
  ;;
tests)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$log"
  echo "CUDA_HOME=${CUDA_HOME:-unset}" | tee -a "$log"
  $py -c "import flashinfer, sys; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -3 | tee -a "$log"
  $py -m pytest -q -m gpu tests/gpu tests/test_conformance.py tests/test_triton_backend.py \
    tests/test_gemv.py -p no:cacheprovider 2>&1 | tail -40 | tee -a "$log"
  $py -m pytest -q tests/test_fused_ops.py -p no:cacheprovider 2>&1 | tail -5 | tee -a "$log"
  ;;
gemv)
  $py bench/gemv_micro.py "$out/results.jsonl" 2>&1 | tail -40 | tee -a "$log"
  ;;
b1)
  for be in triton flashinfer; do
    latency "8b-b1-$be" --model $L8 --batch-size 1 --input-len 128 --output-len 256 --attention-backend $be
  done
  LOOM_GEMV=triton latency "8b-b1-triton-gemv" --model $L8 --batch-size 1 --input-len 128 --output-len 256
  offline "8b-b1-overlap-on" --model $L8 --num-prompts 2 --input-len 128 --output-len 256 --max-running-requests 1
  offline "8b-b1-overlap-off" --model $L8 --num-prompts 2 --input-len 128 --output-len 256 --max-running-requests 1 --disable-overlap-schedule
  offline "smol-b1-graphs+overlap" --model $SM --num-prompts 2 --input-len 128 --output-len 256 --max-running-requests 1
  offline "smol-b1-no-overlap" --model $SM --num-prompts 2 --input-len 128 --output-len 256 --max-running-requests 1 --disable-overlap-schedule
  offline "smol-b1-no-graphs" --model $SM --num-prompts 2 --input-len 128 --output-len 256 --max-running-requests 1 --disable-cuda-graph
  LOOM_GEMV=triton offline "smol-b1-triton-gemv" --model $SM --num-prompts 2 --input-len 128 --output-len 256 --max-running-requests 1
  ;;
workloads)
  offline "smol-256-random" --model $SM --num-prompts 256 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977
  offline "8b-1000-random" --model $L8 --num-prompts 1000 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977
  offline "8b-b64-vs-hf" --model $L8 --num-prompts 64 --input-len 128 --output-len 256 --compare-hf --hf-batch-size 64 --mem-fraction-static 0.5
  ;;
parity)
  $py bench/gpu_parity.py --init-range 0.1 $SM $L8 2>&1 | tail -4 | tee -a "$log" "$out/parity.jsonl"
  ;;
structured)
  for be in xgrammar llguidance; do
    for bs in 1 16; do
      $py -m loom.cli bench structured --model $SM --load-format dummy --tokenizer-path .tok \
        --grammar-backend $be --batch-size $bs --num-prompts $([ $bs = 1 ] && echo 8 || echo 32) \
        --max-new-tokens 64 --result-file "$out/results.jsonl" 2>&1 | grep -v "^Loading" | tail -2 | tee -a "$log"
    done
  done
  ;;
tritondot)
  for v in plain dot; do
    LOOM_TRITON_DECODE=$v latency "8b-b1-triton$v" --model $L8 --batch-size 1 --input-len 128 --output-len 256 --attention-backend triton
    LOOM_TRITON_DECODE=$v latency "8b-b64-triton$v" --model $L8 --batch-size 64 --input-len 1024 --output-len 256 --attention-backend triton
  done
  ;;
sampling)
  for s in greedy penalties greedy penalties; do
    offline "smol-b32-$s" --model $SM --num-prompts 32 --input-len 128 --output-len 512 --max-running-requests 32 --sampling $s
  done
  ;;
esac
