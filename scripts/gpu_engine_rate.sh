#!/usr/bin/env bash
# Run ON a lent machine of 1, 2 or 4 GPUs (after the stash calls), through
#
#   bash scripts/gpu_device_run.sh bg rate bash scripts/gpu_engine_rate.sh
#
# The engine's rate with many tenants (benchmarks.engine_rate: the whole
# curve for each server), one server per GPU, all at once:
#   GPU 0: `serve` (its defaults: grouped LoRA kernels, overlapped shrink)
#   GPU 1: `serve --lora-overlap off`                         (2 GPUs or more)
#   GPU 2: plain `vllm serve` with the same vLLM flags        (4 GPUs only)
# and "the kernel part": the GPU tests of the kernels, the overlap and the logits guard,
# benchmarks.lora_kernels with its profile, then the real-engine scenario
# tests and benchmarks.pause_latency --gpu (PAUSE_ROW=0 leaves both out,
# SCENARIOS=0 the scenario tests alone). It runs on
# GPU 3 beside the servers on 4 GPUs; on 1 GPU the one server, the kernel part
# and the pause row run one after another (RATE_SERVERS=ours,ours_fused: those
# servers side by side on the one GPU, rounds interleaved, in one run).
# Every server's base-model point (0 adapters) runs the same kernels, so it
# calibrates the GPUs against each other. Results land in $OUT (at most 8
# files come back): engine_rate_<server>.json, lora_kernels.json, logs.tgz
# (refreshed as the runs go). ENGINE_RATE_ARGS adds flags to every engine_rate run,
# LORA_KERNELS_ARGS to lora_kernels (--sweep, or --base-kernels NAME=FILE to
# time another grouped_lora.py beside this one; LORA_KERNELS=0 leaves it
# out), and LORA_LAYERS_ARGS, where set, runs benchmarks.lora_layers with
# them in the kernel part (lora_layers.json). The fused layer's A/B on one GPU,
# the servers' first greedy tokens set against float32 and each bf16 rounding
# order (--reference, benchmarks.rounding_orders):
#   SCENARIOS=0 PAUSE_ROW=0 LORA_KERNELS=0 RATE_SERVERS=ours,ours_fused \
#   LORA_LAYERS_ARGS="--tokens 64 --adapters 1,8,32 --by-class --fused-tiles qkv_proj=64x64x6,qkv_proj=128x64x4" \
#   ENGINE_RATE_ARGS="--adapters 0,1,8 --streams 64 --rounds 3 --max-loras 8 --reference" bash ...
set -u
work="$HOME/engine-rate"
mkdir -p "$work" "$OUT"
bash "$SITE_RUN" run true > "$work/install.log" 2>&1 || { cat "$work/install.log"; exit 1; }
export PYTHONPATH="$HOME/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export SKYRL_LORA_CACHE="$HOME/skyrl-cache"
gpus=$(nvidia-smi -L | wc -l)
machine="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
machine="$machine, $gpus GPUs, vLLM 0.26.0"
echo "machine: $machine; commit ${SKYRL_COMMIT:-?}"
CUDA_VISIBLE_DEVICES=0 python3 -c "
from pathlib import Path
from skyrl_lora.server.embedded.random_model import build_random_model
build_random_model(Path('$work'), rank=16, size='8b')" > "$work/model.log" 2>&1
echo "model built $(date +%T)"
kernel_part() {
    python3 -m pytest -p no:cacheprovider -o addopts="" -q \
        gpu_tests/test_gpu_grouped_lora.py gpu_tests/test_gpu_lora_overlap.py \
        gpu_tests/test_gpu_fused_lora.py gpu_tests/test_gpu_logits_guard.py
    [[ -z "${LORA_LAYERS_ARGS:-}" ]] || python3 -m benchmarks.lora_layers $LORA_LAYERS_ARGS \
        --machine "$machine" --json "$OUT/lora_layers.json"
    [[ "${LORA_KERNELS:-1}" == 0 ]] || python3 -m benchmarks.lora_kernels --profile \
        --ranks 16,64 --tokens 64,256 ${LORA_KERNELS_ARGS:-} \
        --machine "$machine" --json "$OUT/lora_kernels.json"
}
pause_row() {
    [[ "${PAUSE_ROW:-1}" == 0 ]] && return
    [[ "${SCENARIOS:-1}" == 0 ]] || timeout 420 python3 -m pytest -p no:cacheprovider \
        -o addopts="" -q -x gpu_tests/test_gpu_scenarios.py
    # Issue 67's GPU row: another tenant's token gaps across one tenant's
    # pauses, 64 and 256 of the paused tenant's requests in flight.
    python3 -m benchmarks.pause_latency --gpu --size 0.8b --in-flight 64,256 \
        --rounds 3 --pauses 20 --gpu-mem 0.3 --machine "$machine" \
        --work "$HOME/pause-latency" --log "$work/pause_latency_server.log" \
        --json "$OUT/pause_latency_gpu.json"
}
extra=(${ENGINE_RATE_ARGS:-})
rate_of() {  # server name (or names, a,b: side by side, the memory split), GPU
    # a,b is named a_and_b: the device tool does not bring back names with "+".
    local name="${1//,/_and_}" share=()
    [[ "$1" == *,* ]] || share=(--gpu-mem 0.85)
    CUDA_VISIBLE_DEVICES=$2 python3 -m benchmarks.engine_rate --servers "$1" \
        --nvml-device "$2" --work "$work" --out "$work/$name" --machine "$machine" \
        "${share[@]}" --json "$OUT/engine_rate_$name.json" "${extra[@]}" > "$work/$name.log" 2>&1
}
pids=()
if (( gpus == 1 )); then
    # One GPU: one after another, the principal figures (the rate, and with
    # --reference its references, computed before the servers start) first.
    (
        rate_of "${RATE_SERVERS:-ours}" 0
        CUDA_VISIBLE_DEVICES=0 kernel_part > "$work/kernels.log" 2>&1
        CUDA_VISIBLE_DEVICES=0 pause_row > "$work/pause.log" 2>&1
    ) &
    pids+=($!)
else
    servers=(ours ours_no_overlap vllm)
    (( gpus < 4 )) && servers=(ours ours_no_overlap)
    for i in "${!servers[@]}"; do
        rate_of "${servers[$i]}" "$i" &
        pids+=($!)
    done
    if (( gpus >= 4 )); then
        (
            export CUDA_VISIBLE_DEVICES=3
            kernel_part
            pause_row
        ) > "$work/kernels.log" 2>&1 &
        pids+=($!)
    fi
fi
pack() { tar czf "$OUT/logs.tgz" -C "$work" --exclude='vllm-cache-*' --exclude='r64' \
    --exclude='*.safetensors' $(cd "$work" && ls -d *.log ours* vllm* 2>/dev/null) 2>/dev/null; }
while true; do
    running=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && running=1; done
    pack
    grep -h -E "tok/s|up in|did not start|passed|failed|^sweep|^r[0-9]+ M=|Error" "$work"/*.log | tail -n 12
    (( running )) || break
    sleep 30
done
echo "all done $(date +%T)"
