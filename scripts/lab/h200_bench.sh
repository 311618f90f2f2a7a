#!/usr/bin/env bash
# The paper's programs and the serving benchmark on the lent H200 (docs/bench.md). That machine has jax, torch and
# transformers but not this package, gguf, accelerate, the datasets or SmolLM2, and a call carries at most 64 MiB,
# so the caller prepares (see docs/bench.md, "On the H200"):
#   out/gpuA: wheels/ (gguf, accelerate, and fastapi, uvicorn, pydantic, httpx, opentelemetry-api with their
#             dependencies for the server; py3.12 manylinux, see docs/server.md), smoltok/ (tokenizer dir), workloads.json (run.py --dump-workloads),
#             bench_workload.json (bench_engine.py --dump-workload), smol.part_a (first half of the SmolLM2 GGUF)
#   out/gpuB: the same small files and smol.part_b, smol.sha256
# Stage a (first call) runs dummy Llama-3-8B and keeps part a in /tmp; stage b (the next call, same machine)
# joins the GGUF and runs the real SmolLM2 with the HF baseline.  Usage: bash scripts/lab/h200_bench.sh a|b
# Optional: A_ARGS / B_ARGS (more run.py arguments, the last of a repeated flag wins: --workloads, --repeats, ...),
# A_TIMEOUT / B_TIMEOUT (seconds for run.py), SERVING=0 (stage a without the serving benchmark), B2_ARGS /
# B2_TIMEOUT (a second SmolLM2 run in stage b, its rows in programs_smollm2_2.jsonl).
set -euo pipefail
stage=$1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
IN=out/gpu${stage^^}
rm -rf /tmp/p && mkdir -p /tmp/p /tmp/whl && cp -r sgjax /tmp/p/ && cp -r kernels /tmp/p/sgjax/kernels
for w in "$IN"/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/whl; done
export PYTHONPATH=/tmp/p:/tmp/whl:$PWD/scripts/perf JAX_PLATFORMS=cuda HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
REPO=$PWD
ln -sfn "$REPO/kernels" "$REPO/sgjax/kernels"  # this copy of the checkout imports as the installed package would
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpu_$stage.txt"
if [ "$stage" = a ]; then
  cp "$IN/smol.part_a" /tmp/smol.part_a
  python3 - <<'PY'
import json
from sgjax.model.tokenizer import load_tokenizer, save_hf_dir
tok = load_tokenizer("out/gpuA/smoltok")
# Llama-3-8B's shapes with SmolLM2's vocabulary, so every sampled id decodes (dummy weights)
save_hf_dir(tok, "/tmp/llama8b", {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": tok.vocab_size,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "eos_token_id": list(tok.eos_token_ids)})
PY
  timeout "${A_TIMEOUT:-330}" python3 scripts/bench/run.py --num-programs 16 --dummy llama3-8b --tokenizer "$IN/smoltok" --workload-file \
    "$IN/workloads.json" --baseline none --gen-cap 64 --latency-programs 1 --max-total-tokens 131072 --out "$OUT/programs_llama8b.jsonl" \
    --plots "$OUT/llama8b" ${A_ARGS:-} > "$OUT/programs_llama8b.log" 2>&1 || echo "programs exit $?" >> "$OUT/programs_llama8b.log"
  if [ "${SERVING:-1}" = 1 ]; then
  # from /tmp: `python -m sgjax.cli` (the server) must not find the checkout's sgjax/ (no kernels) first
  cd /tmp && timeout 180 python3 "$REPO/scripts/perf/bench_serving.py" --workload-file "$REPO/$IN/bench_workload.json" --num-prompts 128 \
    --request-rates 8,32,inf --max-output-len 128 --tag h200-dummy-llama3-8b \
    --server-args "--model-path /tmp/llama8b --load-format dummy --max-running-requests 64 --max-total-tokens 131072" \
    --out "$OUT/serving_llama8b.jsonl" > "$OUT/serving_llama8b.log" 2>&1 || echo "serving exit $?" >> "$OUT/serving_llama8b.log"
  cd "$REPO"
  fi
else
  cat /tmp/smol.part_a "$IN/smol.part_b" > /tmp/smollm2.gguf
  echo "$(cat "$IN/smol.sha256")  /tmp/smollm2.gguf" | sha256sum -c > "$OUT/sha.txt"
  timeout "${B_TIMEOUT:-540}" python3 scripts/bench/run.py --model-path /tmp/smollm2.gguf --dtype float32 --hf-device cuda --max-total-tokens 131072 \
    --workload-file "$IN/workloads.json" --gen-cap 64 --latency-programs 1 --out "$OUT/programs_smollm2.jsonl" \
    --plots "$OUT/smollm2" ${B_ARGS:-} > "$OUT/programs_smollm2.log" 2>&1 || echo "programs exit $?" >> "$OUT/programs_smollm2.log"
  if [ -n "${B2_ARGS:-}" ]; then  # a second run in the same call, e.g. other workloads without the HF baseline
    timeout "${B2_TIMEOUT:-300}" python3 scripts/bench/run.py --model-path /tmp/smollm2.gguf --dtype float32 --hf-device cuda \
      --max-total-tokens 131072 --workload-file "$IN/workloads.json" --gen-cap 64 --latency-programs 1 \
      --out "$OUT/programs_smollm2_2.jsonl" --plots "$OUT/smollm2_2" $B2_ARGS > "$OUT/programs_smollm2_2.log" 2>&1 \
      || echo "programs exit $?" >> "$OUT/programs_smollm2_2.log"
  fi
fi
# a call brings back at most 8 files: one archive per stage
cd "$OUT" && tar czf "/tmp/results_$stage.tgz" . && rm -rf "${OUT:?}"/* && mv "/tmp/results_$stage.tgz" "$OUT/"
