#!/usr/bin/env bash
# Run ON the lent GPU machine, from the repository root, through the device tool.
#
#   scripts/gpu_device_run.sh stash N        copy the carried part .pN to $HOME/stash
#   scripts/gpu_device_run.sh test [ARGS]    install vLLM from the parts (once per
#                                            machine), then run gpu_tests with pytest
#   scripts/gpu_device_run.sh run CMD...     the same install, then run CMD (a probe)
#   scripts/gpu_device_run.sh rl [ARGS]      the same install, then the multi-tenant RL
#                                            example's GPU shape (examples/multi_tenant_rl.py
#                                            --gpu ARGS); its JSON, plot and server log
#                                            land in $OUT (rl_gpu.json, rl_gpu.png, ...);
#                                            SKYRL_GPU_MPS=1 runs it under a CUDA MPS daemon
#   scripts/gpu_device_run.sh bg NAME CMD... the same install, then CMD detached (it outlives
#                                            the call's 600 s), then as `wait NAME` (for
#                                            $BG_WAIT_S, default 560: set it below the call's
#                                            limit when little device time is left, or the
#                                            call is cut and brings nothing back); CMD gets
#                                            $OUT=$HOME/bg/NAME and $SITE_RUN (this script),
#                                            but not vLLM on its path: run Python through
#                                            bash "$SITE_RUN" run python3 ...
#   scripts/gpu_device_run.sh wait NAME [S]  wait up to S s (default 560) for NAME, copy its
#                                            log and $OUT into this call's $OUT; rc 3: still running
#                                            (then also partial.tgz: what gpu_configs.sh's runs
#                                            wrote so far)
#
# The machine keeps $HOME only while it stays warm (about 30 s after a call),
# so the stash calls and the test call must follow each other closely.
set -euo pipefail
stash="$HOME/stash"
site="$HOME/site"

install() {
    if [[ -f "$site/.complete" ]]; then
        return
    fi
    local unpack="$HOME/wheels"
    mkdir -p "$unpack"
    cat "$stash"/part.* | tar xf - -C "$unpack"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$unpack"/*.whl
    touch "$site/.complete"
}

wait_bg() {
    local name="$1" limit="${2:-560}" dir="$HOME/bg/$1" waited=0
    while [[ ! -f "$dir.rc" && $waited -lt $limit ]]; do
        sleep 5
        waited=$((waited + 5))
    done
    mkdir -p "${OUT:-$HOME/out}/$name"
    cp -r "$dir"/. "${OUT:-$HOME/out}/$name/" 2>/dev/null || true
    cp "$dir.log" "${OUT:-$HOME/out}/$name.log"
    tail -n 40 "$dir.log"
    if [[ -f "$dir.rc" ]]; then
        echo "$name ended, rc $(cat "$dir.rc")"
        return 0
    fi
    echo "$name still running after ${waited} s"
    # What the runs of scripts/gpu_configs.sh wrote so far (their JSON, saved
    # after each point, and their own logs): a job the device time cuts off
    # still brings its finished points back.
    if [[ -d "$HOME/runs" ]]; then
        (cd "$HOME/runs" && tar czf "${OUT:-$HOME/out}/$name/partial.tgz" \
            $(ls -d */*.json */scale.log */rl.log 2>/dev/null)) 2>/dev/null || true
    fi
    return 3
}

case "${1:-}" in
    wait)
        shift
        wait_bg "$@"
        ;;
    bg)
        name="$2"
        shift 2
        install
        mkdir -p "$HOME/bg/$name"
        rm -f "$HOME/bg/$name.rc"
        OUT="$HOME/bg/$name" SITE_RUN="$(pwd)/scripts/gpu_device_run.sh" setsid nohup bash -c \
            '"$@"; echo $? > "$HOME/bg/'"$name"'.rc"' bash "$@" > "$HOME/bg/$name.log" 2>&1 < /dev/null &
        wait_bg "$name" "${BG_WAIT_S:-560}"
        ;;
    stash)
        mkdir -p "$stash"
        cp ".p$2"/part.* "$stash/"
        ls -la "$stash"
        ;;
    test | run | rl)
        mode="$1"
        shift
        started=$(date +%s)
        install
        echo "vLLM installed in $(( $(date +%s) - started )) s"
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        export PYTHONUNBUFFERED=1 SKYRL_LORA_CACHE="$HOME/skyrl-cache"
        # Editable, like on the CPU machines: client/ and server/ map into skyrl_lora.
        python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
        python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
        if [[ "$mode" == run ]]; then
            exec "$@"
        fi
        if [[ "$mode" == rl ]]; then
            out="${OUT:-$HOME/rl-out}"
            mkdir -p "$out"
            machine="$(python3 -c "import torch; print(torch.cuda.get_device_name(0))"), vLLM 0.26.0"
            if [[ "${SKYRL_GPU_MPS:-0}" == 1 ]]; then
                # The engine and the learners as clients of one MPS server, not
                # contexts the GPU time-slices between (docs/gpu.md, 94ac4e8).
                # A daemon told to quit takes a moment to go: one started
                # meanwhile fails, and a run right after another would then
                # run time-sliced, so wait for it to be gone on both ends.
                # The kernel keeps 15 characters of a process name, so
                # "nvidia-cuda-mps" names the control daemon and its server.
                mps_gone() { while pgrep -x nvidia-cuda-mps > /dev/null; do sleep 0.5; done; }
                mps_gone
                nvidia-cuda-mps-control -d
                trap 'echo quit | nvidia-cuda-mps-control; mps_gone' EXIT
                machine="$machine, CUDA MPS"
                # Proof it ran under MPS: the engine and learners show as M+C.
                (sleep 180 && nvidia-smi > "$out/nvidia_smi_mid_run.txt" 2>&1) &
            fi
            python3 -m examples.multi_tenant_rl --gpu --machine "$machine" \
                --json "$out/rl_gpu_full.json" --summary-json "$out/rl_gpu.json" \
                --plot "$out/rl_gpu.png" "$@"
            exit
        fi
        [[ $# -gt 0 ]] || set -- gpu_tests
        exec python3 -m pytest -p no:cacheprovider -o addopts="" -rA -s "$@"
        ;;
    *)
        sed -n '2,20p' "$0" >&2
        exit 2
        ;;
esac
