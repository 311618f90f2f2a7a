#!/usr/bin/env bash
# The Mosaic GPU prefill kernel on the lent H200 (docs/kernels.md): its tests compiled, then the attention
# benchmark with it beside the Triton kernel, and (OVERLAP=1) the overlap loop on a tiny model. The package is not
# installed there: a shim makes kernels/ import as sgjax.kernels.  Usage: OUT=... bash scripts/lab/h200_mgpu.sh
# Optional: CASES (bench_attention --cases), PER_LAYER (--per-layer), LAYERS, REPS, TESTS=0, BENCH=0, OVERLAP=1, FORWARD=1
# (bench_forward's 8B prefill step with each prefill kernel), OVERLAP_8B=1 (bench_overlap on dummy Llama-3-8B),
# *_TIMEOUT. The tests run compiled: the interpret-mode ones are CI's (they need the CPU backend).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/shim/sgjax
REPO=$PWD
ln -sf "$REPO"/sgjax/* /tmp/shim/sgjax/ && ln -sfn "$REPO/kernels" /tmp/shim/sgjax/kernels
export PYTHONPATH=/tmp/shim:$REPO JAX_PLATFORMS=cuda JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -P -m pytest tests/kernels/test_pallas_mgpu.py tests/kernels/test_kv_write.py \
    tests/kernels/test_pallas_attention.py -k "not interpret" -q -p no:cacheprovider --import-mode=append \
    > "$OUT/test_mgpu.log" 2>&1; echo "tests exit $?" >> "$OUT/test_mgpu.log"; tail -5 "$OUT/test_mgpu.log"
fi
cd /tmp
if [ "${BENCH:-1}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 -P "$REPO/scripts/perf/bench_attention.py" --mgpu \
    --cases "${CASES:-prefill-4k,mixed}" --per-layer "${PER_LAYER:-prefill-4k}" --layers "${LAYERS:-16}" \
    --reps "${REPS:-20}" --out "$OUT/bench_attention_mgpu.json" > "$OUT/bench_attention_mgpu.log" 2>&1
  echo "bench exit $?" >> "$OUT/bench_attention_mgpu.log"; grep -v "^W0\|^I0" "$OUT/bench_attention_mgpu.log" | tail -40
fi
if [ "${FORWARD:-0}" = 1 ]; then  # the whole dummy Llama-3-8B prefill step, Triton against Mosaic GPU attention
  timeout "${FORWARD_TIMEOUT:-200}" python3 -P "$REPO/scripts/perf/bench_forward.py" --skip-hf --workloads prefill \
    --attention pallas:triton pallas:mgpu --out "$OUT/forward" > "$OUT/bench_forward.log" 2>&1
  echo "forward exit $?" >> "$OUT/bench_forward.log"; grep -v "^W0\|^I0" "$OUT/bench_forward.log" | tail -6
fi
if [ "${OVERLAP:-0}" = 1 ]; then
  for b in 32 128; do timeout 150 python3 -P "$REPO/scripts/perf/bench_overlap.py" --batch $b --out "$OUT/bench_overlap.jsonl" \
    2>&1 | tail -3; done
fi
if [ "${OVERLAP_8B:-0}" = 1 ]; then
  # The engine compiles its whole shape ladder at start: for the 8B that took over 270 s (session 9, nothing
  # came back), so the log goes to $OUT and the default limit is one call's worth.
  for b in ${OVERLAP_BATCHES:-32}; do timeout "${OVERLAP_TIMEOUT:-500}" python3 -P "$REPO/scripts/perf/bench_overlap.py" \
    --dummy llama3-8b --batch $b --out "$OUT/bench_overlap_8b.jsonl" > "$OUT/bench_overlap_8b_$b.log" 2>&1
    echo "overlap exit $?" >> "$OUT/bench_overlap_8b_$b.log"; grep -v "^W0\|^I0" "$OUT/bench_overlap_8b_$b.log" | tail -4
  done
fi
cd "$REPO"
