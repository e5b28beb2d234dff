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
# (interleave them: A B A B), one after the other on one machine. NAME@TREE
# runs it from TREE instead of this checkout: an older commit's files, made
# here with `git archive C server skyrl_lora client benchmarks scripts
# examples pyproject.toml README.md | tar -x -C TREE; echo C > TREE/COMMIT`
# and carried with the call, for an A/B across commits on one machine. The
# runs from this checkout are labelled by SKYRL_COMMIT where it is set (the
# lent machine's copy of .git may be older than its files).
# PYSPY_WHEEL (a carried wheel) samples each server's engine with py-spy
# (scripts/gpu_spy_engine.sh) into its run's engine.{idle,gil}.raw.
#
#   rl     the multi-tenant RL run under CUDA MPS (`gpu_device_run.sh rl`);
#          RL_ARGS replaces its arguments below. One run takes 380-500 s
#          (the first on a machine compiles): four runs a machine at most.
#   host   `benchmarks.push_receive` on the machine's host, no engine and no
#          server flags (FLAGS are its own arguments; HOST_ARGS replaces the
#          default `--mb 336 --rounds 3 --sends 3 --lanes 4`): the push's
#          receive, its CPU at both ends and a CPU-bound neighbour's steps,
#          about a minute a run. With NAME@TREE, the library of a tree.
#   scale  `benchmarks.scale` on the random 8B shape (the tenant curve at 8
#          tenants and the rank-64 swap cost, `--long-step-ms 30`); SCALE_ARGS
#          replaces its arguments below, so name `--ranks 64` in it (left
#          out, the slots are sized for rank 128). The model is built once
#          into $HOME/scale-work; a server after the first takes about 250 s
#          (about 210 s with `--parts tenants`).
#
# Each run's $OUT (JSON, server log, and for rl the plot and nvidia-smi
# mid-run) is packed into $OUT/NAME_N.tgz as soon as it ends, so a `wait`
# call brings the finished runs back while later ones still run (a call
# brings back at most 8 files). Then, here:
#
#   for f in DIR/*.tgz; do tar xzf "$f" -C runs; done
#   python3 scripts/probes/rl_runs.py $(cd runs && for d in *; do echo "$d=runs/$d"; done)
#   .venv/bin/python scripts/probes/gap_causes.py runs/NAME_N/scale.json runs/NAME_N/scale_server.log
#
# rl_runs.py groups runs by their effective step budget, other serve flags
# and per-adapter mode.
set -u
kind="${1:-}"
shift || true
rl_args="${RL_ARGS:---transfer handover --max-wall-s 40 --warm-up-s 20}"
scale_args="${SCALE_ARGS:---parts tenants,swap_cost --tenants 8 --ranks 64 --transports path,handover,handover_swap}"
host_args="${HOST_ARGS:---mb 336 --rounds 3 --sends 3 --lanes 4}"
case "$kind" in
    rl | scale | host) ;;
    *)
        sed -n '2,46p' "$0" >&2
        exit 2
        ;;
esac
n=0
for spec in "$@"; do
    n=$((n + 1))
    head="${spec%%=*}"
    name="${head%%@*}_$n"
    flags="${spec#*=}"
    tree="$(pwd)" commit=""
    if [[ "$head" == *@* ]]; then
        tree="${head#*@}"
        commit="$(cat "$tree/COMMIT")"
    fi
    label="${commit:-${SKYRL_COMMIT:-}}"  # the tree's commit, else this checkout's
    dir="$HOME/runs/$name"
    mkdir -p "$dir"
    echo "== $name $kind [${flags:-default}]${commit:+ at $commit} $(date +%T)"
    spying=""
    if [[ "$kind" != host ]]; then  # a host run has no engine to sample
        bash scripts/gpu_spy_engine.sh "$dir/$kind.log" "$dir/engine" &
        spying=$!
    fi
    if [[ "$kind" == host ]]; then
        # shellcheck disable=SC2086
        (cd "$tree" && SKYRL_COMMIT="$label" bash "$SITE_RUN" run \
            python3 -m benchmarks.push_receive $host_args $flags --json "$dir/push_receive.json") \
            > "$dir/host.log" 2>&1
    elif [[ "$kind" == rl ]]; then
        # shellcheck disable=SC2086
        SKYRL_GPU_MPS=1 OUT="$dir" bash "$SITE_RUN" rl $rl_args ${flags:+"--serve-flags=$flags"} \
            > "$dir/rl.log" 2>&1
    else
        # shellcheck disable=SC2086
        (cd "$tree" && SKYRL_COMMIT="$label" OUT="$dir" bash "$SITE_RUN" run \
            python3 -m benchmarks.scale $scale_args \
            "--serve-flags=--long-step-ms 30${flags:+ $flags}" --work "$HOME/scale-work" \
            --json "$dir/scale.json") > "$dir/scale.log" 2>&1
    fi
    echo "$name rc $? $(date +%T)"
    # py-spy writes its files once the engine is gone; a run that never came up leaves it waiting.
    if [[ -n "$spying" ]]; then
        for _ in $(seq 1 20); do
            kill -0 "$spying" 2> /dev/null || break
            sleep 0.5
        done
        kill "$spying" 2> /dev/null
    fi
    tar czf "$OUT/$name.tgz" -C "$HOME/runs" "$name"
done
