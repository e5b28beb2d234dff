#!/usr/bin/env bash
# Run HERE (not on the GPU machine): fetch the wheels CUDA vLLM 0.26.0 needs on
# the lent GPU machines (torch 2.11.0+cu130 is already there), plus our test
# dependencies (pytest-asyncio; PEFT for the RL example's learners), and split them
# into parts in git-ignored folders .p1 ... .pN, one to carry per device call. A call
# carries 64 MiB with the working tree, so a part is 62 MiB less the tracked files.
# See "GPU tests" in the README for the calls that follow.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
work="${SKYRL_GPU_WHEELS:-$root/.gpu-wheels}"
resolver="${SKYRL_GPU_RESOLVER:-$root/../shared/tools/gpu-vllm/resolve_wheels.py}"
mkdir -p "$work/wheels"
if [[ ! -f "$work/wheels/.complete" ]]; then
    python3 "$resolver" vllm==0.26.0 "$work/wheels"
    touch "$work/wheels/.complete"
fi
# Ray, which the replica group (gpu_tests/test_gpu_group.py) runs on, and what
# of its closure the machines lack (about 80 MB: one more part), at the version
# the CPU tests run.
if [[ ! -f "$work/wheels/.ray-complete" ]]; then
    python3 "$resolver" ray==2.60.0 "$work/wheels"
    touch "$work/wheels/.ray-complete"
fi
# What vLLM does not bring: our core's own needs (xxhash), and the tests' and
# the RL example's. Already downloaded ones are kept.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform any \
    -d "$work/wheels" pycountry pytest-asyncio==1.5.0 peft==0.21.2 "xxhash>=3.0"
rm -rf "$root"/.p[0-9]*
tar cf "$work/all.tar" -C "$work/wheels" --exclude=.complete --exclude=.ray-complete .
tree_mib=$(( $(cd "$root" && git ls-files -z | xargs -0 cat | wc -c) / 1048576 + 1 ))
(cd "$work" && rm -f part.* && split -b "$((62 - tree_mib))m" -d -a 1 all.tar part.)
n=0
for part in "$work"/part.*; do
    n=$((n + 1))
    mkdir -p "$root/.p$n"
    cp "$part" "$root/.p$n/"
done
echo "$n parts in .p1 ... .p$n ($(du -sh "$work/all.tar" | cut -f1) in all)"
