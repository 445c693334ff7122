#!/usr/bin/env bash
# Run Python in vLLM's virtual environment with the environment bench/vllm/setup.sh recorded (LD_PRELOAD of
# Intel OpenMP and tcmalloc, in-process engine core, 1 GiB KV cache): bash bench/vllm/run.sh SCRIPT.py ARGS...
# The venv is $SPECBATCH_VLLM_VENV, else bench/vllm/.venv. Exits 3, before starting Python, when it is not set up.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${SPECBATCH_VLLM_VENV:-$here/.venv}"
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/specbatch-vllm.env" ]; then
    echo "vLLM is not set up in $venv: run 'bash bench/vllm/setup.sh' first" >&2
    exit 3
fi
set -a
. "$venv/specbatch-vllm.env"
set +a
exec "$venv/bin/python" "$@"
