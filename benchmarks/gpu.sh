#!/usr/bin/env bash
# One run on a lent NVIDIA GPU, inside 10 minutes: the SSD kernels against the XLA
# form (checked on the device first, then timed, with a jax.profiler trace), the
# layer kernels (conv + SiLU, gated RMSNorm) against the XLA layer the same way, the
# fused layer (layer_impl auto on a GPU) against the plain layer over the SSD kernel, the
# train step at 130m and 1.3b in bfloat16 at 4 x 2048, and decode at batch 1; each
# part with the run's own roofline (bf16 matmul rate, copy bandwidth). Each part
# runs in its own process under its own time limit, so one failure or hang costs
# only its own rows; the merged table is written last, and whatever finished is
# in OUT_DIR. Made for the lent machine's Python 3.12, jax 0.11.2 and CUDA 13 (no
# network there: nothing is installed; the repository is put on PYTHONPATH).
#
#   bash benchmarks/gpu.sh [OUT_DIR]             # default bench_out/gpu
#   DRY_RUN=1 bash benchmarks/gpu.sh /tmp/g      # any host, on CPU: tiny shapes, every
#                                                # part and the report, a few minutes
#   SIZES=130m bash benchmarks/gpu.sh /tmp/g     # fewer sizes
#
# Run from the repository root. Results: OUT_DIR/{ssd,train,decode}.json and
# results.md, OUT_DIR/ssd/results.md (kernels vs XLA), OUT_DIR/layer/results.md
# (the layer kernels vs XLA), OUT_DIR/fused/results.md (the fused layer vs the plain one),
# OUT_DIR/trace (the profile),
# OUT_DIR/log (every part's full log).
set -u
OUT=${1:-bench_out/gpu}
DRY_RUN=${DRY_RUN:-0}
py=${PYTHON:-python3}
WORK=$(mktemp -d)
mkdir -p "$OUT/log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
log() { echo "== $(date -u +%H:%M:%S) (+$(( $(date +%s) - start )) s) $*"; }

if [ "$DRY_RUN" = 1 ]; then
  export JAX_PLATFORMS=cpu
  SIZES=${SIZES:-tiny}; REPEATS=${REPEATS:-1}
  SSD_ARGS="--dry_run"; TRAIN_SHAPE="--batch 2 --seq_len 128"; DECODE_ARGS="--new_tokens 4 --seq_len 64"
  T_SSD=600; T_LAYER=600; T_FUSED=600; T_TRAIN=600; T_DECODE=600  # a shared CPU: generous
else
  SIZES=${SIZES:-130m,1.3b}; REPEATS=${REPEATS:-5}
  SSD_ARGS=""; TRAIN_SHAPE="--batch 4 --seq_len 2048"; DECODE_ARGS="--new_tokens 64 --seq_len 128"
  # Seconds per part (compiles included; 2026-11-30 on an H200: ssd 81 s, train 109 s,
  # decode 86 s for twice the shapes; the layer and fused parts are four small compiles a
  # size): 130 + 70 + 70 + 200 + 100 + start-up stays under 10 min.
  T_SSD=${T_SSD:-130}; T_LAYER=${T_LAYER:-70}; T_FUSED=${T_FUSED:-70}; T_TRAIN=${T_TRAIN:-200}
  T_DECODE=${T_DECODE:-100}
fi

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>/dev/null
if ! $py -c "import jax, flax, optax, mamba_train, benchmarks; print('python', __import__('sys').version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" > "$OUT/log/env.log" 2>&1; then
  log "the package does not import here; nothing measured:"; tail -n 20 "$OUT/log/env.log"; exit 1
fi
cat "$OUT/log/env.log"
if [ "$DRY_RUN" != 1 ] && ! $py -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')"; then
  log "no GPU backend (jax.default_backend() is not 'gpu'): run with DRY_RUN=1 to try the script on CPU"; exit 1
fi

parts=()
part() {  # part NAME SECONDS CMD...: one process under a time limit, its log kept
  local name=$1 limit=$2; shift 2
  log "$name (limit ${limit} s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/log/$name.log" 2>&1
  local rc=$?
  [ $rc = 124 ] && log "$name ran past ${limit} s: stopped; what it logged ends:"
  [ $rc != 0 ] && [ $rc != 124 ] && log "$name FAILED (rc $rc); its log ends:"
  grep -v "^|\|^#\|^$\|^-" "$OUT/log/$name.log" | tail -n 25
  return $rc
}
bench() {  # bench NAME SECONDS ARGS...: a `python -m benchmarks` part, its results.json kept
  local name=$1 limit=$2; shift 2
  if part "$name" "$limit" $py -m benchmarks "$@" --dtype bfloat16 --repeats "$REPEATS" --out "$WORK/$name"; then
    parts+=("$WORK/$name"); cp "$WORK/$name/results.json" "$OUT/$name.json"
  fi
}

# 1. The SSD kernels: agreement with the XLA form on this device, then both timed,
#    forward and forward+backward, and the profile.
part ssd "$T_SSD" $py -m benchmarks.gpu_ssd $SSD_ARGS --repeats "$REPEATS" --out "$OUT/ssd" --trace "$OUT/trace" \
  && cat "$OUT/ssd/results.md"
# 2. The layer kernels (what the fused layer falls back to): agreement with the plain forms
#    on this device, then both timed forward and forward+backward at the layers' shapes.
part layer "$T_LAYER" $py -m benchmarks.gpu_layer $SSD_ARGS --repeats "$REPEATS" --out "$OUT/layer" \
  && cat "$OUT/layer/results.md"
# 3. The fused layer (layer_impl auto on a GPU): agreement with the plain layer over the SSD
#    kernel on this device, then both timed, forward and forward+backward.
part fused "$T_FUSED" $py -m benchmarks.gpu_fused $SSD_ARGS --repeats "$REPEATS" --out "$OUT/fused" \
  && cat "$OUT/fused/results.md"
# 4. The train step (ssd_impl and layer_impl auto: the kernels), 4 x 2048 a GPU, as the AOT report.
bench train "$T_TRAIN" train --config "$SIZES" $TRAIN_SHAPE --remat save_matmuls
# 5. Decode at batch 1 (the device loop, host loop and recompute rows).
bench decode "$T_DECODE" decode --config "$SIZES" $DECODE_ARGS

log "report"
inputs=$(IFS=,; echo "${parts[*]:-}")
if [ -n "$inputs" ]; then
  $py -m benchmarks report --inputs "$inputs" --out "$OUT" > "$OUT/log/report.log" 2>&1 || tail -n 20 "$OUT/log/report.log"
  cat "$OUT/results.md" 2>/dev/null
fi
log "done in $(( $(date +%s) - start )) s: $OUT"
