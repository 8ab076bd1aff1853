#!/usr/bin/env bash
# The GPU figures of the README in one go: roofline (bf16 matmul rate, copy
# bandwidth), the SSD alone in both forms, then forward, train and decode at 130m
# and 1.3b in bfloat16. Each part runs in its own process, so one failure costs
# only its own rows; the merged table is written last.
#
#   bash benchmarks/gpu.sh [OUT_DIR]          # default bench_out/gpu
#   SIZES=130m bash benchmarks/gpu.sh /tmp/g  # fewer sizes
#
# Run from the repository root (python -m benchmarks), after `pip install -e .`.
set -u
OUT=${1:-bench_out/gpu}
SIZES=${SIZES:-130m,1.3b}
REPEATS=${REPEATS:-5}
WORK=$(mktemp -d)
mkdir -p "$OUT"
py=${PYTHON:-python3}
log() { echo "== $(date -u +%H:%M:%S) $*"; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>/dev/null
$py -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"

parts=()
run() {  # run NAME ARGS...: one benchmarks process, its results.json kept
  local name=$1; shift
  log "$name: python -m benchmarks $*"
  if $py -m benchmarks "$@" --dtype bfloat16 --repeats "$REPEATS" --out "$WORK/$name" > "$WORK/$name.log" 2>&1; then
    parts+=("$WORK/$name")
    cp "$WORK/$name/results.json" "$OUT/$name.json"
  else
    log "$name FAILED (rc $?); its log ends:"
  fi
  grep -v "^|\|^#\|^$\|^-" "$WORK/$name.log" | tail -n 25
}

run forward forward --config "$SIZES"
# save_matmuls: without remat the 130m step at 16 x 2048 tokens wanted 159 GiB.
run train train --config "$SIZES" --remat save_matmuls
run decode decode --config "$SIZES" --new_tokens 64
run ssd ssd --ssd_form scan,parallel --chunks 64,128,256

log "report"
inputs=$(IFS=,; echo "${parts[*]}")
$py -m benchmarks report --inputs "$inputs" --out "$OUT" > "$WORK/report.log" 2>&1 || tail -n 20 "$WORK/report.log"
cat "$OUT/results.md" 2>/dev/null
