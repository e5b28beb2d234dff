#!/usr/bin/env bash
# Run ON the lent GPU machine (after the stash calls), through scripts/gpu_device_run.sh:
#
#   bash scripts/gpu_device_run.sh bg cfg bash scripts/gpu_configs.sh rl \
#       "default=" "vllm_budget=--no-graph-step-budget" \
#       "default=" "vllm_budget=--no-graph-step-budget"
#   bash scripts/gpu_device_run.sh bg cfg bash scripts/gpu_configs.sh scale \
#       "default=" "vllm_metadata=--no-host-lora-metadata" "default="
#
# One benchmark server per NAME=SERVE_FLAGS argument, in the order given
# (interleave them: A B A B), one after the other on one machine:
#
#   rl     the multi-tenant RL run under CUDA MPS (`gpu_device_run.sh rl`);
#          RL_ARGS replaces its arguments below. One run takes 380-500 s
#          (the first on a machine compiles): four runs a machine at most.
#   scale  `benchmarks.scale` on the random 8B shape (the tenant curve at 8
#          tenants and the rank-64 swap cost, `--long-step-ms 30`); SCALE_ARGS
#          replaces its arguments below. The model is built once into
#          $HOME/scale-work; a server after the first takes about 250 s.
#
# Each run's $OUT (JSON, server log, and for rl the plot and nvidia-smi
# mid-run) is packed into $OUT/NAME_N.tgz as soon as it ends, so a `wait`
# call brings the finished runs back while later ones still run (a call
# brings back at most 8 files). Then, here:
#
#   for f in DIR/*.tgz; do tar xzf "$f" -C runs; done
#   python3 scripts/probes/rl_runs.py $(cd runs && for d in *; do echo "$d=runs/$d"; done)
#   python3 scripts/probes/gap_causes.py runs/NAME_N/scale.json runs/NAME_N/scale_server.log
#
# rl_runs.py groups runs by their effective step budget, other serve flags
# and per-adapter mode.
set -u
kind="${1:-}"
shift || true
rl_args="${RL_ARGS:---transfer handover --modes per_adapter_staged,global,global,per_adapter_staged --max-wall-s 40 --warm-up-s 20}"
scale_args="${SCALE_ARGS:---parts tenants,swap_cost --tenants 8 --ranks 64 --transports path,handover,handover_swap}"
case "$kind" in
    rl | scale) ;;
    *)
        sed -n '2,30p' "$0" >&2
        exit 2
        ;;
esac
n=0
for spec in "$@"; do
    n=$((n + 1))
    name="${spec%%=*}_$n"
    flags="${spec#*=}"
    dir="$HOME/runs/$name"
    mkdir -p "$dir"
    echo "== $name $kind [${flags:-default}] $(date +%T)"
    if [[ "$kind" == rl ]]; then
        # shellcheck disable=SC2086
        SKYRL_GPU_MPS=1 OUT="$dir" bash "$SITE_RUN" rl $rl_args ${flags:+"--serve-flags=$flags"} \
            > "$dir/rl.log" 2>&1
    else
        # shellcheck disable=SC2086
        OUT="$dir" bash "$SITE_RUN" run python3 -m benchmarks.scale $scale_args \
            "--serve-flags=--long-step-ms 30${flags:+ $flags}" --work "$HOME/scale-work" \
            --json "$dir/scale.json" > "$dir/scale.log" 2>&1
    fi
    echo "$name rc $? $(date +%T)"
    tar czf "$OUT/$name.tgz" -C "$HOME/runs" "$name"
done
