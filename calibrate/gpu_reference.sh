#!/usr/bin/env bash
# One device run, budgeted for 8 minutes on one H200 with the image's torch (every step capped: 450 s in all, the
# rest is loading), writing 8 files to $OUT:
#
#   nvidia-smi.txt   the GPU's state before anything runs (clocks, power, temperature, memory)
#   probe.txt        torch and CUDA versions, the attention kernel torch picks for both models' shapes; a k = 4
#                    step at b = 1 and 64, eager and with CUDA graphs (each pass's wall time between barriers
#                    against its CUDA-event time, and the steps' wall time); then every isolated pass (8B
#                    target and 1B draft, b = 1 and 64, n = 1 and 5) eager and graphed side by side, with the
#                    kernel launches a pass makes (torch's profiler)
#   pytest-gpu.txt   the GPU tests (pytest -m gpu): parity with transformers, sampling, bf16 vs fp32, clocks, graphs
#   profile.json     a reference calibration: llama-3.1-8b + llama-3.2-1b shapes in bfloat16, acceptance 0.8,
#   profile.csv      batch sizes 1, 4, 16, 64, contexts 512 and 2048, k up to 6, --quick, cut at --max-seconds
#                    (graphed passes: the runtime's default on CUDA; the profile says "execution")
#   model.json       specbatch fit of it
#   table.json       specbatch table of it
#   run.log          what calibrate, fit and table said; a bench of the table against fixed k (synthetic
#                    acceptance 0.8, 128 new tokens; its bench.json printed here, its other files dropped);
#                    `specbatch demo` on the device
#
# Shapes only (no weights are downloaded): acceptance is given, the profile holds measured passes and steps.
# A calibration cut short by --max-seconds keeps every point it measured (--resume continues it).
#
#   OUT=/some/dir calibrate/gpu_reference.sh                # on a GPU
#   OUT=/some/dir calibrate/gpu_reference.sh --device cpu   # the same steps on tiny shapes, on a CPU (CI)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-data/profiles/gpu-reference}"
DEVICE=cuda
PYTHON="${PYTHON:-python3}"  # an image may have python3 and no python
if [ "${1:-}" = "--device" ]; then DEVICE="${2:?--device needs a value: cuda or cpu}"; fi
mkdir -p "$OUT"
scratch=$(mktemp -d)  # what the bench and the demo write beside what is kept: not among the 8 files
trap 'rm -rf "$scratch"' EXIT
status=0

if [ "$DEVICE" = cpu ]; then  # tiny shapes: the script's every step, in seconds
    tiny='"model_type": "llama", "vocab_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 512'
    echo "{$tiny, \"hidden_size\": 64, \"num_hidden_layers\": 2, \"intermediate_size\": 128}" > "$scratch/target.json"
    echo "{$tiny, \"hidden_size\": 32, \"num_hidden_layers\": 1, \"intermediate_size\": 64}" > "$scratch/draft.json"
    target="$scratch/target.json" draft="$scratch/draft.json" dtype=float32
    probe=(--batch-sizes 1,8 --context-len 32 --new-tokens 8)
    grid=(--batch-sizes 1,4 --context-lens 32,64 --max-k 3 --max-seconds 60)
    bench=(--batch-sizes 1,4 --ks 0,2 --rounds 1 --max-new-tokens 16)
    demo=(--batch-sizes 1 --rounds 1 --max-new-tokens 8 --prompts-shown 1 --max-batch 4)
    probe_s=120 pytest_s=150 calibrate_s=200 fit_s=60 table_s=60 bench_s=200 demo_s=420
else
    target=llama-3.1-8b draft=llama-3.2-1b dtype=bfloat16
    probe=(--batch-sizes 1,64 --context-len 512 --new-tokens 24)
    grid=(--batch-sizes 1,4,16,64 --context-lens 512,2048 --max-k 6 --max-seconds 70)
    bench=(--batch-sizes 1,16,64 --ks 0,4 --rounds 2 --max-new-tokens 128)
    demo=(--batch-sizes 1 --rounds 1 --max-new-tokens 32)  # two loops: the demo pair's, then the demo head's
    probe_s=80 pytest_s=80 calibrate_s=90 fit_s=25 table_s=15 bench_s=60 demo_s=100  # 450 s at most; the probe
    # compiles the fused layer kernels for both shapes first (inductor caches them on disk for the later steps)
fi

# 1. the GPU's state
{ nvidia-smi -q -d CLOCK,POWER,TEMPERATURE,PERFORMANCE,MEMORY 2>&1 || echo "no nvidia-smi on this machine"; } \
    > "$OUT/nvidia-smi.txt"

# 2. versions, attention kernels, steps in both modes, every pass eager vs graphed with its launches
timeout "$probe_s" "$PYTHON" -m specbatch.calibrate.device_probe --target "$target" --draft "$draft" --device "$DEVICE" \
    --dtype "$dtype" --k 4 --modes eager,cuda-graphs "${probe[@]}" > "$OUT/probe.txt" 2>&1 \
    || { echo "device probe failed (probe.txt)" >&2; status=1; }

# 3. the GPU tests (they skip without CUDA); bounded, as no test may hold the device for long. Only the folders
# that hold them are collected: a bare GPU image may lack the serving tests' client packages (openai) and
# pytest-xdist (so the project's addopts, which start its workers, are dropped: one process holds the GPU)
timeout "$pytest_s" "$PYTHON" -m pytest -m gpu -o addopts="" -q -p no:cacheprovider tests/runtime tests/calibrate \
    > "$OUT/pytest-gpu.txt" 2>&1
case $? in 0|5) ;; *) echo "GPU tests failed (pytest-gpu.txt)" >&2; status=1 ;; esac

# 4. the reference calibration, its fit and its table; a bench with the table; the demo
{
    echo "== calibrate, fit, table"
    timeout "$calibrate_s" specbatch calibrate --target "$target" --draft "$draft" --device "$DEVICE" \
        --dtype "$dtype" --acceptance 0.8 --quick "${grid[@]}" --force --out "$OUT/profile.json" \
        && timeout "$fit_s" specbatch fit "$OUT/profile.json" -o "$OUT/model.json" \
        && timeout "$table_s" specbatch table "$OUT/model.json" -o "$OUT/table.json" --max-batch 64
} > "$OUT/run.log" 2>&1 || { echo "calibration, fit or table failed (run.log)" >&2; status=1; }
{
    echo "== bench with the table (synthetic acceptance 0.8)"
    timeout "$bench_s" specbatch bench --target "$target" --draft "$draft" --device "$DEVICE" --dtype "$dtype" \
        --table "$OUT/table.json" --model "$OUT/model.json" --synthetic-acceptance 0.8 --resolve-rounds 0 \
        "${bench[@]}" --out "$scratch/bench" --json
} >> "$OUT/run.log" 2>&1 || { echo "bench failed (run.log)" >&2; status=1; }
{
    echo "== specbatch demo --device $DEVICE"
    timeout "$demo_s" specbatch demo --device "$DEVICE" "${demo[@]}" --out "$scratch/demo"
} >> "$OUT/run.log" 2>&1 || { echo "demo failed (run.log)" >&2; status=1; }

ls -l "$OUT"
exit $status
