#!/usr/bin/env bash
# A/B of the working tree against an older commit's code in one machine lease: every run of
# the current src/ alternates with the same run of the older one, so both meet the same card,
# clocks and temperature. Extract the older code first, untracked, and carry it:
#   git archive REV src | tar -x -C bench_base      (then run with carry: ["bench_base"])
#
#   bash bench/gpu/ab.sh OUTDIR SECTION [REPEATS]
#
# Sections (bf16, dummy weights, Triton attention unless .whl brings FlashInfer):
#   b1     Llama-3-8B and SmolLM2 shapes, batch 1, 128 in / 256 out (`loom bench latency`)
#   wl8b   Llama-3-8B, 1000 requests, in/out uniform in [100, 1024] (`loom bench offline`)
#   smol256  SmolLM2, 256 requests, the same lengths
# REPEATS (default 1): rounds of base-then-new. Results: OUTDIR/results.jsonl in run order and
# OUTDIR/log.txt, each run headed "== base ..." or "== new ...".
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"
[ -d bench_base/src/loom ] || { echo "bench_base/src is missing (see the header)" >&2; exit 2; }
repeats=${3:-1}
new_path=$PYTHONPATH
base_path="$PWD/bench_base/src:$PYTHONPATH"

side() {  # SIDE FUNCTION TAG ARGS...: one run with that side's code
  local s=$1 fn=$2 tag=$3
  shift 3
  if [ "$s" = base ]; then PYTHONPATH=$base_path "$fn" "base $tag" "$@"; else PYTHONPATH=$new_path "$fn" "new $tag" "$@"; fi
}

for _ in $(seq "$repeats"); do
  for s in base new; do
    case $section in
    b1)
      side $s latency 8b-b1 --model $L8 --batch-size 1 --input-len 128 --output-len 256
      side $s latency smol-b1 --model $SM --batch-size 1 --input-len 128 --output-len 256
      ;;
    wl8b)
      side $s offline 8b-1000-random --model $L8 --num-prompts 1000 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977
      ;;
    smol256)
      side $s offline smol-256-random --model $SM --num-prompts 256 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977
      ;;
    *)
      unknown_section
      ;;
    esac
  done
done
