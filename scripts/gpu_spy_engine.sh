#!/usr/bin/env bash
# Run ON the lent GPU machine, beside a benchmark (backgrounded):
#
#   bash scripts/gpu_spy_engine.sh BENCH_LOG PREFIX &
#
# Waits (up to 15 minutes) for "server up" in BENCH_LOG, then samples the vLLM
# engine core process with py-spy until it exits, twice at once: every thread
# with --idle (wall time, waits included) into PREFIX.idle.raw, and only the
# thread holding the GIL into PREFIX.gil.raw. py-spy is not a dependency:
# PYSPY_WHEEL names its carried wheel (`pip download py-spy`); without it this
# does nothing. Read the files with scripts/probes/pyspy_stacks.py.
set -u
log="$1" prefix="$2"
[[ -n "${PYSPY_WHEEL:-}" ]] || exit 0
spy="$HOME/pyspy/bin/py-spy"
if [[ ! -x "$spy" ]]; then
    python3 -m pip install -q --no-index --no-deps --upgrade --target "$HOME/pyspy" "$PYSPY_WHEEL"
fi
for _ in $(seq 1 900); do
    grep -q "server up" "$log" 2> /dev/null && break
    sleep 1
done
engine=$(pgrep -f "VLLM::EngineCore" | head -1)
[[ -n "$engine" ]] || exit 0
"$spy" record --idle --nonblocking -r 100 -f raw -p "$engine" -o "$prefix.idle.raw" > "$prefix.spy.log" 2>&1 &
"$spy" record --gil --nonblocking -r 100 -f raw -p "$engine" -o "$prefix.gil.raw" >> "$prefix.spy.log" 2>&1 &
wait
