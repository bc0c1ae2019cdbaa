#!/usr/bin/env bash
# `loom serve` against `loom bench offline` on the same workload, in one call: 512 requests of
# 256 random input and 256 output tokens (seed 0, ignore_eos), bf16, dummy weights, SmolLM2's
# tokenizer, the client on the same machine.
#
#   bash bench/gpu/serving.sh OUTDIR SECTION SHAPE
#
# SHAPE: smol (SmolLM2-135M) or 8b (Llama-3-8B's body with SmolLM2's vocabulary).
# Needs: a CUDA GPU; .whlsrv/ with the server's wheels (fastapi, starlette, pydantic and
# pydantic-core, annotated-types, annotated-doc, typing-inspection, typing-extensions, uvicorn,
# click, httptools, orjson, pyzmq, opentelemetry-api, gguf) and, for the sglang section,
# sglang's wheel (installed --no-deps) and pybase64; .tok/ (the SmolLM2 tokenizer); for the base
# section, bench_base/src (bench/gpu/ab.sh explains). Sections:
#   compare SHAPE   offline, then one server (--incremental-streaming-output): /generate from 4
#                   workers with --scaling-check (8), /v1/completions and /v1/chat/completions
#                   from 4, /generate from 1 worker; then a server with --enable-mixed-chunk
#                   --chunked-prefill-size 128 under Poisson arrivals at 80% of the offline
#                   request rate
#   targets SHAPE   the issue's targets alone: offline, /generate and /v1/completions from 4
#                   workers, and the Poisson run on the mixed-chunk server
#   rate SHAPE RATE [FLAGS]  the Poisson run alone at RATE, FLAGS to the client
#   rates SHAPE "SERVER_FLAGS" N RATE...  one server started with SERVER_FLAGS (and
#                   --incremental-streaming-output), then a Poisson run of N requests from 4
#                   workers at each RATE in turn
#   abrates SHAPE "SERVER_FLAGS" N ROUNDS RATE...  ROUNDS of: a server of bench_base/src, then one
#                   of src (both with SERVER_FLAGS), each under the Poisson runs of `rates`
#   fronts SHAPE "SERVER_FLAGS" N ROUNDS RATE...  offline, then ROUNDS of: a server with one
#                   front-end process, then one with N (--tokenizer-worker-num; both with
#                   SERVER_FLAGS), each under /generate all at once from 4 workers and the
#                   Poisson runs of `rates`; RATE "auto": 80% of the offline request rate
#   base SHAPE      /generate from 4 workers against the server of bench_base/src
#   tools SHAPE     chat requests forced to call a tool (--tool-choice required, then named)
#                   against the same requests without tools, at concurrency 1 (16 requests)
#                   and 16 (64 requests), 64 input and 24 output tokens, on a server with the
#                   Hermes-style tool template (loom.testing.templates); needs .whl2 (xgrammar)
#   sglang SHAPE    SGLang's bench_serving (bench/sglang_bench_serving.py) against loom serve:
#                   its sglang (/generate) and sglang-oai (/v1/completions) backends
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"

shape=${3:?usage: bash $0 OUTDIR SECTION SHAPE}
case $shape in
smol) model=$SM ;;
8b) model=$L8SMOLVOCAB ;;
*) echo "unknown shape: $shape" >&2; exit 2 ;;
esac
if [ -d .whlsrv ] && [ ! -d /tmp/sitesrv/fastapi ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sitesrv \
    .whlsrv/*.whl 2>&1 | tail -2 | tee -a "$log"
fi
export PYTHONPATH="$PYTHONPATH:/tmp/sitesrv" HF_HUB_OFFLINE=1
work=(--num-prompts 512 --random-input-len 256 --random-output-len 256 --random-range-ratio 1.0)
port=30123
url=http://127.0.0.1:$port

serve() {  # SRC_DIR, then `loom serve` flags; waits until /health answers
  local src=$1; shift
  # SRC_DIR's loom in place of the tree's (the other entries stay: wheels under /tmp)
  echo "== server ($src) $*" >>"$out/server-$shape.log"  # every server's log kept, in order
  PYTHONPATH="$src:${PYTHONPATH//$PWD\/src:/}" $py -m loom.cli serve --model $model --load-format dummy \
    --tokenizer-path .tok --dtype bfloat16 --port $port "$@" >>"$out/server-$shape.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 300); do
    curl -sf $url/health >/dev/null && return 0
    kill -0 $server_pid 2>/dev/null || { tail -20 "$out/server-$shape.log"; return 1; }
    sleep 1
  done
  return 1
}
stop() {
  kill -TERM $server_pid 2>/dev/null
  wait $server_pid 2>/dev/null
}
client() {  # TAG, then `loom bench serving` flags
  echo "== $shape $1" | tee -a "$log"; shift
  $py -m loom.cli bench serving --base-url $url "${work[@]}" --result-file "$out/results.jsonl" \
    "$@" 2>&1 | tee -a "$log"
}

offline_rate() {  # the offline run, then the request rate that keeps the engine ~80% busy
  echo "== $shape offline" | tee -a "$log"
  $py -m loom.cli bench offline --model $model --load-format dummy --tokenizer-path .tok \
    --dtype bfloat16 --num-prompts 512 --input-len 256 --output-len 256 --random-range-ratio 1.0 \
    --result-file "$out/results.jsonl" 2>&1 | grep -v "^Loading" | tail -3 | tee -a "$log"
  rate=$($py -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])][-1]['loom']; print(round(0.8 * r['output_tokens_per_s'] / 256, 1))" "$out/results.jsonl")
}
rate_run() {  # latency at $rate: prefill chunks share steps with decoding
  serve src --incremental-streaming-output --enable-mixed-chunk --chunked-prefill-size 128 || exit 1
  client "generate x4 rate $rate mixed-chunk 128" --num-workers 4 --request-rate "$rate"
  stop
}

case $section in
compare)
  offline_rate
  serve src --incremental-streaming-output || exit 1
  client "generate x4" --num-workers 4 --scaling-check
  client "completions x4" --backend completions --num-workers 4
  client "chat x4" --backend chat --num-workers 4
  client "generate x1" --num-workers 1
  stop
  rate_run
  ;;
targets)
  offline_rate
  serve src --incremental-streaming-output || exit 1
  client "generate x4" --num-workers 4
  client "completions x4" --backend completions --num-workers 4
  stop
  rate_run
  ;;
rate)  # SHAPE RATE [FLAGS]: rate_run at RATE requests per second, FLAGS passed to the client
  rate=${4:?usage: bash $0 OUTDIR rate SHAPE RATE [FLAGS]}
  serve src --incremental-streaming-output --enable-mixed-chunk --chunked-prefill-size 256 || exit 1
  client "generate x4 rate $rate mixed-chunk 256 ${*:5}" --num-workers 4 --request-rate "$rate" "${@:5}"
  stop
  ;;
rates)  # SHAPE "SERVER_FLAGS" N RATE...
  flags=${4?usage: bash $0 OUTDIR rates SHAPE "SERVER_FLAGS" N RATE...}
  n=${5:?usage: bash $0 OUTDIR rates SHAPE "SERVER_FLAGS" N RATE...}
  # shellcheck disable=SC2086  # the flags are words
  serve src --incremental-streaming-output $flags || exit 1
  for r in "${@:6}"; do
    client "generate x4 rate $r [$flags]" --num-workers 4 --request-rate "$r" --num-prompts "$n"
  done
  stop
  ;;
abrates)  # SHAPE "SERVER_FLAGS" N ROUNDS RATE...: base and new servers in turn, each at every RATE
  flags=${4?usage: bash $0 OUTDIR abrates SHAPE "SERVER_FLAGS" N ROUNDS RATE...}
  n=${5:?usage: bash $0 OUTDIR abrates SHAPE "SERVER_FLAGS" N ROUNDS RATE...}
  rounds=${6:?usage: bash $0 OUTDIR abrates SHAPE "SERVER_FLAGS" N ROUNDS RATE...}
  [ -d bench_base/src/loom ] || { echo "bench_base/src is missing (bench/gpu/ab.sh)" >&2; exit 2; }
  for _ in $(seq "$rounds"); do
    for side in base new; do
      src=$([ $side = base ] && echo bench_base/src || echo src)
      # shellcheck disable=SC2086  # the flags are words
      serve $src --incremental-streaming-output $flags || exit 1
      for r in "${@:7}"; do
        client "$side generate x4 rate $r [$flags]" --num-workers 4 --request-rate "$r" --num-prompts "$n"
      done
      stop
    done
  done
  ;;
fronts)  # SHAPE "SERVER_FLAGS" N ROUNDS RATE...: one front end, then N, in turn
  flags=${4?usage: bash $0 OUTDIR fronts SHAPE "SERVER_FLAGS" N ROUNDS RATE...}
  n=${5:?usage: bash $0 OUTDIR fronts SHAPE "SERVER_FLAGS" N ROUNDS RATE...}
  rounds=${6:?usage: bash $0 OUTDIR fronts SHAPE "SERVER_FLAGS" N ROUNDS RATE...}
  offline_rate
  for _ in $(seq "$rounds"); do
    for fe in 1 "$n"; do
      # shellcheck disable=SC2086  # the flags are words
      serve src --incremental-streaming-output --tokenizer-worker-num "$fe" $flags || exit 1
      client "fronts $fe generate x4 [$flags]" --num-workers 4
      for r in "${@:7}"; do
        [ "$r" = auto ] && r=$rate
        client "fronts $fe generate x4 rate $r [$flags]" --num-workers 4 --request-rate "$r"
      done
      stop
    done
  done
  ;;
base)
  serve bench_base/src || exit 1
  client "base generate x4" --num-workers 4
  stop
  ;;
tools)
  $py -c "from loom.testing.templates import HERMES_TEMPLATE as t; print(t)" >"$out/hermes.jinja"
  serve src --incremental-streaming-output --chat-template "$out/hermes.jinja" || exit 1
  for cn in "1 16" "16 64"; do
    read -r c n <<<"$cn"
    for choice in none required named; do
      flags=(--backend chat --num-prompts "$n" --random-input-len 64 --random-output-len 24
        --max-concurrency "$c")
      [ $choice = none ] || flags+=(--tool-choice $choice)
      client "chat concurrency $c tool_choice $choice" "${flags[@]}"
    done
  done
  stop
  ;;
sglang)
  serve src || exit 1
  for b in sglang sglang-oai; do
    echo "== $shape sglang.bench_serving $b" | tee -a "$log"
    ids=$([ $b = sglang ] && echo --tokenize-prompt)  # token ids, as loom bench serving sends
    $py bench/sglang_bench_serving.py --backend $b --host 127.0.0.1 --port $port --model .tok \
      --tokenizer .tok --served-model-name "$model" --dataset-name random-ids $ids \
      --random-input-len 256 --random-output-len 256 --random-range-ratio 1.0 --num-prompts 512 \
      --request-rate inf --output-file "$out/sglang-$shape-$b.jsonl" 2>&1 | grep -v "it/s]" | tail -34 | tee -a "$log"
  done
  stop
  ;;
*)
  unknown_section
  ;;
esac
