#!/usr/bin/env bash
# Run HERE: fetch the wheels that the server's host-side code needs on the lent
# GPU machine besides torch (aiohttp, pydantic, uvicorn, starlette, ... at the
# versions of this machine's .venv), about 12 MB in the git-ignored .whl, for
# benchmarks that need no vLLM (benchmarks.push_receive, and the kernel ones:
# lora_layers, lora_in_gemm): one device call, no vLLM install. On the device,
# first thing in the command:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site && python3 -m pip install -q --no-index --no-deps \
#     --no-build-isolation -e .
# and name .whl in the call's carry.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SKYRL_LORA_VENV:-$root/.venv}"
packages=(aiohappyeyeballs aiohttp aiosignal annotated-types anyio attrs click frozenlist h11
    httptools idna multidict prometheus_client propcache pydantic pydantic_core python-multipart
    sniffio starlette typing_extensions typing-inspection uvicorn uvloop xxhash yarl)
pins=()
for name in "${packages[@]}"; do
    version="$("$venv/bin/python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")"
    pins+=("$name==$version")
done
grep -qx "/.whl/" "$root/.git/info/exclude" 2>/dev/null || echo "/.whl/" >> "$root/.git/info/exclude"
rm -rf "$root/.whl"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$root/.whl" "${pins[@]}"
echo "$(ls "$root/.whl" | wc -l) wheels in .whl ($(du -sh "$root/.whl" | cut -f1))"
