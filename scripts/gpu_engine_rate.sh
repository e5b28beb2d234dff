#!/usr/bin/env bash
# Run ON a lent 2-GPU machine (after the stash calls), through
#
#   bash scripts/gpu_device_run.sh bg rate bash scripts/gpu_engine_rate.sh
#
# The engine's rate with many tenants, in one job on two GPUs at once:
#   GPU 1: the grouped kernels' GPU test, then benchmarks.lora_kernels (every
#          LoRA op of a step, vLLM's against ours), then benchmarks.engine_rate
#          for `serve` against plain `vllm serve` (0, 8 and 32 adapters);
#   GPU 0: benchmarks.engine_rate for `serve` (grouped kernels) against
#          `serve --lora-kernels vllm`, the whole curve.
# Both servers of a comparison share one GPU (interleaved windows). Results
# land in $OUT: lora_kernels.json, engine_rate.json, engine_rate_vs_vllm.json,
# and the logs (g0.log, g1.log, servers.tgz). ENGINE_RATE_ARGS adds flags to
# both engine_rate runs. Then, here: python -m benchmarks.engine_rate --plot FILE.
set -u
work="$HOME/engine-rate"
mkdir -p "$work" "$OUT"
bash "$SITE_RUN" run true > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
export PYTHONPATH="$HOME/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export SKYRL_LORA_CACHE="$HOME/skyrl-cache"
gpu="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
machine="$gpu, $(nvidia-smi -L | wc -l) GPUs, vLLM 0.26.0"
echo "machine: $machine; commit ${SKYRL_COMMIT:-?}"
CUDA_VISIBLE_DEVICES=0 python3 -c "
from pathlib import Path
from skyrl_lora.server.embedded.random_model import build_random_model
build_random_model(Path('$work'), rank=16, size='8b')" > "$OUT/g0.log" 2>&1
echo "model built $(date +%T)"
extra=(${ENGINE_RATE_ARGS:-})
(
    export CUDA_VISIBLE_DEVICES=1
    python3 -m pytest -p no:cacheprovider -o addopts="" -q gpu_tests/test_gpu_grouped_lora.py
    python3 -m benchmarks.lora_kernels --profile --machine "$machine" \
        --json "$OUT/lora_kernels.json"
    python3 -m benchmarks.engine_rate --servers ours,vllm --adapters 0,8,32 --nvml-device 1 \
        --work "$work" --out "$work/g1" --machine "$machine" --gpu-mem 0.45 \
        --json "$OUT/engine_rate_vs_vllm.json" "${extra[@]}"
) > "$OUT/g1.log" 2>&1 &
g1=$!
CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.engine_rate --servers ours,ours_vllm_kernels \
    --nvml-device 0 --work "$work" --out "$work/g0" --machine "$machine" --gpu-mem 0.45 \
    --json "$OUT/engine_rate.json" "${extra[@]}" >> "$OUT/g0.log" 2>&1
echo "GPU 0 done $(date +%T)"
wait "$g1"
echo "GPU 1 done $(date +%T)"
tar czf "$OUT/servers.tgz" -C "$work" g0 g1 2>/dev/null
