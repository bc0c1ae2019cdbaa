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
#   loaders [CONFIG] [GROUPS] [GGUF_TYPE]
#          load time and peak memory of each weight loader (`loom bench load`, bf16, one load a
#          process) on random weights of CONFIG's shape (default the Llama-3-8B shape), written
#          by bench/make_checkpoint.py into /tmp/ck8b (/tmp/ck-NAME for another CONFIG) on the
#          GPU, or on the CPU where there is none. GROUPS (comma-separated, default
#          safetensors,remote,pt,modelopt, run in the order given) and their loads:
#            safetensors  auto, layered, auto + --quantization fp8, layered + fp8
#            bnb          bitsandbytes (NF4 quantized at load), layered + --quantization
#                         bitsandbytes (needs the bitsandbytes package)
#            remote       --model http://127.0.0.1:PORT/ (python -m http.server on the
#                         safetensors directory), copied into a cache under /tmp first; the row's
#                         fetch_s is the copy, load_s the load from the copy
#            pt           pytorch_model-*.bin shards
#            modelopt     a ModelOpt FP8 export (detected by itself), with auto and layered
#            gguf         model.gguf (needs the gguf package: .whl3), projections in GGUF_TYPE
#                         (default Q8_0 on CUDA, Q4_0 on the CPU), token_embd / output Q8_0,
#                         tiny tokenizer; gguf-dense: --load-formats gguf (every tensor
#                         dequantised to fp32 on the host by gguf-py, loaded as bf16);
#                         gguf-blocks: + --quantization gguf (on CUDA the projections stay in
#                         their GGML blocks on the GPU for the Triton kernels, every block type;
#                         on the CPU only Q4_0 / Q4_1 stay packed, as int4, others load dense).
#                         LOOM_GGUF_CACHE=0: no config / weight cache read or written. The row
#                         has gguf_type. A reused $ck/gguf keeps the type it was written with.
#          Each row also has the group's tag and host_peak_bytes (the largest resident set of the
#          load's processes, interpreter and CUDA runtime included). The loads read the
#          checkpoint from the page cache (just written). A format's directory (16 GB in bf16
#          for the 8B shape, modelopt 8.5 GB) is deleted once no later group of the call reads
#          it, the remote cache after its load; an existing directory is reused, so a call cut
#          short is resumed by the next while the machine is warm (gguf 8.5 GB at Q8_0).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"

load_one() {  # TAG, then `loom bench load` flags (one format): its row, tagged, with the host's
  # peak (ru_maxrss of the load's process tree) and the JSON object $row_extra's fields
  echo "== $1" | tee -a "$log"
  $py - "$out/results.jsonl" "$@" <<'PYEOF' 2>&1 | tail -6 | tee -a "$log"
import json, os, resource, subprocess, sys, tempfile
result, tag, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
with tempfile.TemporaryDirectory() as tmp:
    rows = os.path.join(tmp, "rows.jsonl")
    cmd = [sys.executable, "-m", "loom.cli", "bench", "load", "--result-file", rows, *flags]
    done = subprocess.run(cmd, capture_output=True, text=True)
    print(done.stdout.strip() if done.returncode == 0 else done.stderr[-3000:])
    if done.returncode != 0:
        sys.exit(done.returncode)
    (row,) = [json.loads(line) for line in open(rows)]
host = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
row.update(tag=tag, host_peak_bytes=host, **json.loads(os.environ.get("row_extra") or "{}"))
with open(result, "a") as f:
    f.write(json.dumps(row) + "\n")
print(f"  host peak {host / 2**20:.0f} MiB")
PYEOF
}

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
loaders)
  cfg=${3:-$L8}
  IFS=, read -ra groups <<<"${4:-safetensors,remote,pt,modelopt}"
  for g in "${groups[@]}"; do
    case $g in
    safetensors | bnb | remote | pt | modelopt | gguf) ;;
    *) echo "unknown loaders group: $g" >&2 && exit 2 ;;
    esac
  done
  ck=/tmp/ck-$(basename "$cfg" .json)
  [ "$cfg" = "$L8" ] && ck=/tmp/ck8b
  dev=$($py -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
  echo "== loaders: $cfg on $dev, checkpoints in $ck, groups ${groups[*]}" | tee -a "$log"
  lflags=(--device "$dev" --dtype bfloat16)
  gguf_type=${5:-$([ "$dev" = cuda ] && echo Q8_0 || echo Q4_0)}
  checkpoint() {  # FORMAT: $ck/FORMAT, written unless there
    [ -d "$ck/$1" ] || $py bench/make_checkpoint.py "$cfg" "$ck" --formats "$1" \
      --dtype bfloat16 --device "$dev" --gguf-type "$gguf_type" 2>&1 | tail -3 | tee -a "$log"
  }
  format_of() { case $1 in remote | bnb) echo safetensors ;; *) echo "$1" ;; esac; }
  for i in "${!groups[@]}"; do
    g=${groups[$i]}
    fmt=$(format_of "$g")
    checkpoint "$fmt"
    case $g in
    safetensors)
      load_one st-auto --model "$ck/safetensors" --load-formats auto "${lflags[@]}"
      load_one st-layered --model "$ck/safetensors" --load-formats layered "${lflags[@]}"
      load_one st-fp8 --model "$ck/safetensors" --load-formats auto --quantization fp8 \
        "${lflags[@]}"
      load_one st-layered-fp8 --model "$ck/safetensors" --load-formats layered \
        --quantization fp8 "${lflags[@]}"
      ;;
    bnb)
      load_one st-bnb-nf4 --model "$ck/safetensors" --load-formats bitsandbytes "${lflags[@]}"
      load_one st-layered-bnb-nf4 --model "$ck/safetensors" --load-formats layered \
        --quantization bitsandbytes "${lflags[@]}"
      ;;
    remote)
      cache=/tmp/loom-remote-cache port=8765
      $py -m http.server $port --bind 127.0.0.1 --directory "$ck/safetensors" \
        >/dev/null 2>&1 &
      server=$!
      url=http://127.0.0.1:$port
      $py -c "import socket, sys, time
for _ in range(100):
    try: socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=1).close(); break
    except OSError: time.sleep(0.1)" $port
      fetch_s=$(LOOM_CACHE_DIR=$cache $py -c "import sys, time
from loom.model_loader.remote import fetch_model
start = time.perf_counter(); fetch_model(sys.argv[1])
print(f'{time.perf_counter() - start:.2f}')" \
        "$url" 2>"$out/fetch.err") || tail -5 "$out/fetch.err" | tee -a "$log"
      echo "fetched $url in ${fetch_s:-(failed)} s: $(du -sh "$cache" | cut -f1)" | tee -a "$log"
      LOOM_CACHE_DIR=$cache row_extra="{\"fetch_s\": ${fetch_s:-null}}" load_one remote \
        --model "$url" --load-formats auto "${lflags[@]}"
      kill "$server"
      rm -rf "$cache"
      ;;
    pt)
      load_one pt --model "$ck/pt" --load-formats pt "${lflags[@]}"
      ;;
    modelopt)
      load_one modelopt-auto --model "$ck/modelopt" --load-formats auto "${lflags[@]}"
      load_one modelopt-layered --model "$ck/modelopt" --load-formats layered "${lflags[@]}"
      ;;
    gguf)
      extra="{\"gguf_type\": \"$gguf_type\"}"
      LOOM_GGUF_CACHE=0 row_extra=$extra load_one gguf-dense --model "$ck/gguf/model.gguf" \
        --load-formats gguf "${lflags[@]}"
      LOOM_GGUF_CACHE=0 row_extra=$extra load_one gguf-blocks --model "$ck/gguf/model.gguf" \
        --load-formats gguf --quantization gguf "${lflags[@]}"
      ;;
    esac
    later=$(for h in "${groups[@]:$((i + 1))}"; do format_of "$h"; done)
    grep -qx "$fmt" <<<"$later" || rm -rf "${ck:?}/$fmt"
  done
  rmdir "$ck" 2>/dev/null
  ;;
*)
  unknown_section
  ;;
esac
