#!/usr/bin/env bash
# The whole engine on the lent H200 (issue: the engine at the roofline, with the overlap loop, on the paper's
# programs). The package is not installed there: a shim makes kernels/ import as sgjax.kernels. Inputs are prepared
# here (docs/engine.md, "On the H200") in out/gpu (carried by the first call) and out/gpu2 (the second):
#   out/gpu:  smoltok/ (SmolLM2's tokenizer as an HF dir), bench_workload.json (bench_engine.py --dump-workload),
#             workloads.json (scripts/bench/run.py --dump-workloads), wheels/ (gguf); carried by every call
#   out/gpu1: smol.part_a (the GGUF's first 50,000,000 bytes; stage 1)
#   out/gpu2: smol.part_b (the rest), smol.sha256 (stage 2); a call carries at most 64 MiB
# Stages (one call each, on the same warm machine so /tmp and the compilation cache survive):
#   1  scripts/probes/probe_sampler_sync.py, then dummy Llama-3-8B (bf16): bench_engine on ShareGPT (no sharing) and MMLU 5-shot at 32 and 128 running
#      requests, overlap on / off / no cache, a profiled pass per configuration
#   2  the real SmolLM2 (fp32; the GGUF joined from the two parts): bench_engine at 32 and 128 and bench_overlap;
#      then bench_overlap on the 8B at batch 128
#   3  the paper's programs on the 8B (full, no_overlap, no_cache, --repeats 3) and HF transformers on the same GPU
#      over the same weights
#   f  the families' kernels and shapes: the Mosaic GPU / Triton kernel tests compiled (sliding windows, soft caps,
#      head_dim 256), then bench_forward on dummy Qwen3-8B and Gemma-3-12B; also keeps stage 2's part a in /tmp
# Usage: OUT=... bash scripts/lab/h200_engine.sh 1|2|3|f   Optional: S1_TIMEOUT, S2_TIMEOUT, S3_TIMEOUT, WORKLOADS (stage 3),
#   MODELS, FORWARD_TIMEOUT, FORWARD_ARGS (stage f)
set -uo pipefail
stage=$1
OUT=${OUT:-/tmp/out}
REPO=$PWD
mkdir -p "$OUT" /tmp/shim/sgjax /tmp/site
ln -sf "$REPO"/sgjax/* /tmp/shim/sgjax/ && ln -sfn "$REPO/kernels" /tmp/shim/sgjax/kernels
[ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site out/gpu/wheels/*.whl
export PYTHONPATH=/tmp/shim:/tmp/site:$REPO/scripts/perf JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu,memory.used --format=csv \
  > "$OUT/gpu_$stage.txt" 2>&1
for d in smoltok bench_workload.json workloads.json; do [ -e "out/gpu/$d" ] && cp -r "out/gpu/$d" /tmp/; done
quiet() { grep -v "^W0\|^I0\|^E0" "$@"; }
cd /tmp
if [ "$stage" = f ]; then
  [ -e "$REPO/out/gpu1/smol.part_a" ] && cp "$REPO/out/gpu1/smol.part_a" /tmp/smol.part_a
  (cd "$REPO" && timeout "${TEST_TIMEOUT:-150}" python3 -P -m pytest -q -p no:cacheprovider \
    tests/kernels/test_pallas_mgpu.py tests/kernels/test_pallas_attention.py -k "not interpret" --import-mode=append \
    > "$OUT/kernel_tests.log" 2>&1; echo "exit $?" >> "$OUT/kernel_tests.log"); tail -5 "$OUT/kernel_tests.log"
  for m in ${MODELS:-qwen3-8b gemma3-12b}; do
    timeout "${FORWARD_TIMEOUT:-150}" python3 -P "$REPO/scripts/perf/bench_forward.py" --model $m --skip-hf \
      --attention ${FORWARD_ATTENTION:-pallas} ${FORWARD_ARGS:-} --out "$OUT/forward_$m" > "$OUT/forward_$m.log" 2>&1
    echo "exit $?" >> "$OUT/forward_$m.log"; quiet "$OUT/forward_$m.log" | tail -8
  done
elif [ "$stage" = 1 ]; then
  cp "$REPO/out/gpu1/smol.part_a" /tmp/smol.part_a
  # does the sampler's lax.cond hold the dispatch until the forward is done? (8B and SmolLM2 logits shapes)
  timeout "${PROBE_TIMEOUT:-90}" python3 -P "$REPO/scripts/probes/probe_sampler_sync.py" --rows 128 --vocab 128256 \
    --layers 32 --repeats 10 --tag rows128 --out "$OUT/probe_sampler_sync.jsonl" > "$OUT/probe_sampler_sync.log" 2>&1
  echo "exit $?" >> "$OUT/probe_sampler_sync.log"
  for b in ${S1_BATCHES:-32 128}; do
    timeout "${S1_TIMEOUT:-230}" python3 -P "$REPO/scripts/lab/with_logs.py" "$REPO/scripts/perf/bench_engine.py" --dummy llama3-8b \
      --workload-file /tmp/bench_workload.json --workloads ${S1_WORKLOADS:-sharegpt,mmlu5} --configs ${S1_CONFIGS:-lpm,no_overlap,nocache} \
      --max-running-requests $b --max-total-tokens 131072 --chunked-prefill-size 512 --repeat ${S1_REPEAT:-3} ${S1_ARGS:-} \
      --profile-dir /tmp/prof_8b_$b --tag "8b-b$b" --out "$OUT/engine_8b_b$b.jsonl" > "$OUT/engine_8b_b$b.log" 2>&1
    echo "exit $?" >> "$OUT/engine_8b_b$b.log"; quiet "$OUT/engine_8b_b$b.log" | tail -12
  done
elif [ "$stage" = 2 ]; then
  cat /tmp/smol.part_a "$REPO/out/gpu2/smol.part_b" > /tmp/smollm2.gguf
  echo "$(cat "$REPO/out/gpu2/smol.sha256")  /tmp/smollm2.gguf" | sha256sum -c > "$OUT/sha.txt" 2>&1
  model=(--model-path /tmp/smollm2.gguf)
  if ! grep -q OK "$OUT/sha.txt"; then  # a fresh machine lost part a: SmolLM2's shapes with random weights
    python3 -c "
from sgjax.model.tokenizer import load_tokenizer, save_hf_dir
tok = load_tokenizer('/tmp/smoltok')
save_hf_dir(tok, '/tmp/smol_dummy', {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'vocab_size': 49152,
  'hidden_size': 576, 'intermediate_size': 1536, 'num_hidden_layers': 30, 'num_attention_heads': 9,
  'num_key_value_heads': 3, 'max_position_embeddings': 8192, 'rms_norm_eps': 1e-5, 'rope_theta': 100000.0,
  'tie_word_embeddings': True, 'eos_token_id': list(tok.eos_token_ids)})"
    model=(--model-path /tmp/smol_dummy --load-format dummy)
    echo "DUMMY SmolLM2 weights (part a lost)" >> "$OUT/sha.txt"
  fi
  # SmolLM2's fp32 shape ladder takes minutes to compile on the H200 (110 / 80 / 250 s limits brought nothing back on
  # 2026-12-02): pick one part per call with S2_PARTS, e.g. "engine32" then "overlap32 overlap8b".
  parts=" ${S2_PARTS:-engine32 overlap32 engine128 overlap128 overlap8b} "
  for b in 32 128; do
    # (the exit status is the command's: "exit $?" after a [[ ]] && ... reported the test's, 0, for a timed-out run)
    if [[ "$parts" == *" engine$b "* ]]; then
      JAX_LOG_COMPILES=${LOG_COMPILES:-0} timeout "${S2_TIMEOUT:-280}" python3 -P "$REPO/scripts/perf/bench_engine.py" "${model[@]}" --dtype float32 \
        --workload-file /tmp/bench_workload.json --workloads ${S2_WORKLOADS:-sharegpt,mmlu5} --configs lpm,no_overlap \
        --max-running-requests $b --max-total-tokens 131072 --chunked-prefill-size 512 --repeat 3 ${S2_ARGS:-} \
        --profile-dir /tmp/prof_smol_$b --tag "smollm2-b$b" --out "$OUT/engine_smol_b$b.jsonl" > "$OUT/engine_smol_b$b.log" 2>&1
      echo "exit $?" >> "$OUT/engine_smol_b$b.log"; quiet "$OUT/engine_smol_b$b.log" | grep -v ShapedArray | tail -6
    fi
    if [[ "$parts" == *" overlap$b "* ]]; then
      JAX_LOG_COMPILES=${LOG_COMPILES:-0} timeout "${S2_OVERLAP_TIMEOUT:-280}" \
        python3 -P "$REPO/scripts/perf/bench_overlap.py" "${model[@]}" --dtype float32 --batch $b --prompt 64 --new 128 \
        --chunked-prefill-size 512 ${S2_ARGS:-} --out "$OUT/overlap.jsonl" > "$OUT/overlap_smol_$b.log" 2>&1
      echo "exit $?" >> "$OUT/overlap_smol_$b.log"; quiet "$OUT/overlap_smol_$b.log" | grep -v ShapedArray | tail -4
    fi
  done
  if [[ "$parts" == *" overlap8b "* ]]; then
    timeout "${S2_8B_TIMEOUT:-280}" python3 -P "$REPO/scripts/perf/bench_overlap.py" \
      --dummy llama3-8b --attention-backend pallas:triton --batch 128 --prompt 256 --new 128 --max-total-tokens 131072 \
      --chunked-prefill-size 512 --out "$OUT/overlap.jsonl" > "$OUT/overlap_8b.log" 2>&1
    echo "exit $?" >> "$OUT/overlap_8b.log"; quiet "$OUT/overlap_8b.log" | tail -4
  fi
else
  if [ -z "${SKIP_PROBE:-}" ]; then
    timeout 60 python3 -P "$REPO/scripts/probes/probe_dispatch.py" --out "$OUT/probe_dispatch.json" > "$OUT/probe_dispatch.log" 2>&1
    quiet "$OUT/probe_dispatch.log" | tail -9
  fi
  # the jax client keeps 55% of the GPU, HF's copy of the 8B (16 GB) the rest
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.55 timeout "${S3_TIMEOUT:-540}" python3 -P "$REPO/scripts/bench/run.py" \
    --dummy llama3-8b --tokenizer /tmp/smoltok --workload-file /tmp/workloads.json --num-programs 16 \
    --workloads "${WORKLOADS:-mmlu,multi_turn_short,multi_turn_long,hellaswag,json_decode,react,rag,tree_of_thought}" \
    --configs full,no_overlap,no_cache --repeats 3 --baseline ${S3_BASELINE:-hf} --hf-device cuda --gen-cap 64 --latency-programs 1 ${S3_ARGS:-} \
    --max-total-tokens 131072 --out "$OUT/programs_8b.jsonl" --plots /tmp/plots > "$OUT/programs_8b.log" 2>&1
  echo "exit $?" >> "$OUT/programs_8b.log"; quiet "$OUT/programs_8b.log" | tail -40
fi
cd "$REPO"
