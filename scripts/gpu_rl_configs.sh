#!/usr/bin/env bash
# Run ON the lent GPU machine (after the stash calls), through scripts/gpu_device_run.sh:
#
#   bash scripts/gpu_device_run.sh bg cfg bash scripts/gpu_rl_configs.sh \
#       "default=" "vllm_budget=--no-graph-step-budget" \
#       "default=" "vllm_budget=--no-graph-step-budget"
#
# The multi-tenant RL run under CUDA MPS once per NAME=SERVE_FLAGS argument, in
# the order given (interleave them: A B A B), one server each, on one machine.
# Each run's $OUT (headline JSON, plot, server log, nvidia-smi mid-run) is packed
# into $OUT/NAME_N.tgz as soon as it ends, so a `wait` call brings the finished
# runs back while later ones still run (a call brings back at most 8 files).
# RL_ARGS replaces the RL example's arguments below. Then, here:
#
#   for f in DIR/*.tgz; do tar xzf "$f" -C runs; done
#   python3 scripts/probes/rl_runs.py $(cd runs && for d in *; do echo "$d=runs/$d"; done)
#
# Runs of one configuration are grouped by their serve flags. One run takes
# 380-500 s (the first on a machine compiles), and a machine goes back after
# 30 minutes held: four runs a machine at most.
set -u
args="${RL_ARGS:---transfer handover --modes per_adapter_staged,global,global,per_adapter_staged --max-wall-s 40 --warm-up-s 20}"
n=0
for spec in "$@"; do
    n=$((n + 1))
    name="${spec%%=*}_$n"
    flags="${spec#*=}"
    dir="$HOME/runs/$name"
    mkdir -p "$dir"
    echo "== $name [${flags:-default}] $(date +%T)"
    # shellcheck disable=SC2086
    SKYRL_GPU_MPS=1 OUT="$dir" bash "$SITE_RUN" rl $args ${flags:+"--serve-flags=$flags"} \
        > "$dir/rl.log" 2>&1
    echo "$name rc $? $(date +%T)"
    tar czf "$OUT/$name.tgz" -C "$HOME/runs" "$name"
done
