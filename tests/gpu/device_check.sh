#!/usr/bin/env bash
# The GPU proof of the weight path and colocation, one command on a lent GPU (about 8 minutes), after the gpu-kit's
# staging calls (../shared/gpu-kit/README.md; the last chunk installs vLLM):
#   bash tests/gpu/device_check.sh            (in a device `run`, timeout_s 600; results in $OUT/gpu_check.md)
# It runs, each bounded so that the later ones still run:
#   1. tests/gpu/ (-s: the tests print what they measure): the hf engine and the trainer on CUDA, vLLM loading a
#      version from CUDA IPC handles, over an NCCL link (two GPUs only), sleep freeing GPU memory on hf and vLLM;
#   2. benchmarks/bench_scale.py's vLLM rows on the GPU in bf16 at 0.5B and 1.5B: the file reload against the
#      in-memory paths, seconds per version, verified;
#   3. `rlflow run pipelines/smollm2.yaml` on vLLM in bf16, synchronous, rollout and trainer sharing the GPU (0.5
#      each), so the engine sleeps through every train step (the plan says so), 5 steps; GPU memory sampled.
# Record what it wrote in docs/guides/gpus.md ("On a GPU").
set -uo pipefail
OUT=${OUT:-/tmp/rlflow-gpu-check}
mkdir -p "$OUT"
res="$OUT/gpu_check.md"
py=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
{
  echo "# GPU check, $(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $py -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)" 2>&1 | tail -1
} >"$res"

section() { printf '\n## %s\n\n```\n' "$1" >>"$res"; }
endsection() { printf '```\n' >>"$res"; }

section "tests/gpu (timeout 200 s)"
timeout 200 $py -P -m pytest tests/gpu -q -s -p no:cacheprovider -o addopts="" >"$OUT/tests_gpu.log" 2>&1
echo "rc=$?" >>"$res"
grep -E "passed|failed|skipped|error|freed" "$OUT/tests_gpu.log" | tail -25 >>"$res"
endsection

section "weights into vLLM on the GPU, bf16 (timeout 150 s)"
timeout 150 $py benchmarks/bench_scale.py --device cuda --parts vllm --vllm-sizes 0.5b 1.5b --repeat 1 \
  >"$OUT/bench_vllm.log" 2>&1
echo "rc=$?" >>"$res"
grep -E "^\||^###" "$OUT/bench_vllm.log" >>"$res"
endsection

section "rlflow run pipelines/smollm2.yaml, vLLM bf16, synchronous, colocated with sleep (timeout 200 s)"
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -lms 500 >"$OUT/gpu_memory.csv" &
smi=$!
timeout 200 bash -c "$py -m rlflow.cli compile pipelines/smollm2.yaml --set stages.rollout.engine=vllm \
  --set 'edges.3.policy={kind: barrier}' --set stages.train.steps=5 --set stages.rollout.num_gpus=0.5 \
  --set stages.train.num_gpus=0.5 && $py -m rlflow.cli run" >"$OUT/smollm2_vllm.log" 2>&1
echo "rc=$?" >>"$res"
kill $smi 2>/dev/null
grep -E "sleeps during|weights to rollout|^step |^done|Error|error" "$OUT/smollm2_vllm.log" | tail -20 >>"$res"
echo "GPU memory used (MiB), min / max while it ran: $(cut -d, -f2 "$OUT/gpu_memory.csv" | tr -dc '0-9\n' | sort -n | sed -n '1p;$p' | tr '\n' ' ')" >>"$res"
endsection
cat "$res"
