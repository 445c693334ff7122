#!/usr/bin/env bash
# One device run, budgeted for 8 minutes on one H200, writing 8 files to $OUT:
#
#   nvidia-smi.txt   the GPU's state before anything runs (clocks, power, temperature, memory)
#   probe.txt        torch and CUDA versions, the attention kernel torch picks for both models' shapes, and a
#                    k = 4 step at b = 1 and 64: each pass's wall time between barriers against its CUDA-event time
#   pytest-gpu.txt   the GPU tests (pytest -m gpu): parity with transformers, sampling, bf16 vs fp32, clocks
#   profile.json     a reference calibration: llama-3.1-8b + llama-3.2-1b shapes in bfloat16, acceptance 0.8,
#   profile.csv      batch sizes 1, 4, 16, 64, contexts 512 and 2048, k up to 6, --quick, cut at --max-seconds
#   model.json       specbatch fit of it
#   table.json       specbatch table of it
#   run.log          what calibrate, fit and table said
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
if [ "${1:-}" = "--device" ]; then DEVICE="${2:?--device needs a value: cuda or cpu}"; fi
mkdir -p "$OUT"
status=0

if [ "$DEVICE" = cpu ]; then  # tiny shapes: the script's every step, in seconds
    shapes=$(mktemp -d)
    trap 'rm -rf "$shapes"' EXIT
    tiny='"model_type": "llama", "vocab_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 512'
    echo "{$tiny, \"hidden_size\": 64, \"num_hidden_layers\": 2, \"intermediate_size\": 128}" > "$shapes/target.json"
    echo "{$tiny, \"hidden_size\": 32, \"num_hidden_layers\": 1, \"intermediate_size\": 64}" > "$shapes/draft.json"
    target="$shapes/target.json" draft="$shapes/draft.json" dtype=float32
    probe=(--batch-sizes 1,8 --context-len 32 --new-tokens 8)
    grid=(--batch-sizes 1,4 --context-lens 32,64 --max-k 3 --max-seconds 60)
else
    target=llama-3.1-8b draft=llama-3.2-1b dtype=bfloat16
    probe=(--batch-sizes 1,64 --context-len 512 --new-tokens 24)
    grid=(--batch-sizes 1,4,16,64 --context-lens 512,2048 --max-k 6 --max-seconds 240)
fi

# 1. the GPU's state
{ nvidia-smi -q -d CLOCK,POWER,TEMPERATURE,PERFORMANCE,MEMORY 2>&1 || echo "no nvidia-smi on this machine"; } \
    > "$OUT/nvidia-smi.txt"

# 2. versions, attention kernels, one step timed two ways
python -m specbatch.calibrate.device_probe --target "$target" --draft "$draft" --device "$DEVICE" --dtype "$dtype" \
    --k 4 "${probe[@]}" > "$OUT/probe.txt" 2>&1 || { echo "device probe failed (probe.txt)" >&2; status=1; }

# 3. the GPU tests (they skip without CUDA); bounded, as no test may hold the device for long
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/ > "$OUT/pytest-gpu.txt" 2>&1
case $? in 0|5) ;; *) echo "GPU tests failed (pytest-gpu.txt)" >&2; status=1 ;; esac

# 4. the reference calibration, its fit and its table
{
    specbatch calibrate --target "$target" --draft "$draft" --device "$DEVICE" --dtype "$dtype" --acceptance 0.8 \
        --quick "${grid[@]}" --force --out "$OUT/profile.json" \
        && specbatch fit "$OUT/profile.json" -o "$OUT/model.json" \
        && specbatch table "$OUT/model.json" -o "$OUT/table.json" --max-batch 64
} > "$OUT/run.log" 2>&1 || { echo "calibration, fit or table failed (run.log)" >&2; status=1; }

ls -l "$OUT"
exit $status
