#!/usr/bin/env bash
# GPU reference profiles: the GPU tests, then two shape-only calibrations in bfloat16.
#
#   opt-6.7b   + opt-125m   (the pair of Su et al. 2023)
#   llama-2-7b + llama-68m  (the pair of SpecInfer)
#
# No weights exist for these shapes here, so acceptance is given (--acceptance 0.8) and the profiles
# hold measured forward-pass times and step overheads only. Budget: under 8 minutes on one H200
# (each step has its own timeout, so a slow step cannot eat the others' time; a calibration cut
# short still leaves every point it measured in its profile, resumable with --resume).
#
#   OUT=/some/dir calibrate/gpu_reference.sh      # default OUT: data/profiles
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-data/profiles}"
mkdir -p "$OUT"

# 'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'
gpu=$(python -c "import re, torch; name = torch.cuda.get_device_name(0).lower().replace('nvidia', ''); \
print(re.sub('[^a-z0-9]+', '-', name).strip('-'))") || { echo "no CUDA device" >&2; exit 1; }
echo "device: $gpu, profiles in $OUT"

status=0
timeout 100 python -m pytest -m gpu -q tests/ 2>&1 | tail -n 20 || status=1

# Batch 1..64 covers the paper's 1..32 and one step beyond; three context lengths fix the L term.
# KV cache at the largest point: 64 rows x 1801 tokens x 512 KiB (7B, bf16) = 56 GiB, plus 13.5 GiB
# of weights: fits an H200 (141 GB) with room to spare, and the memory check says so before building.
common=(--device cuda --dtype bfloat16 --acceptance 0.8 --max-k 8
        --batch-sizes 1,2,4,8,16,32,64 --context-lens 256,1024,1792)
for pair in "opt-6.7b opt-125m" "llama-2-7b llama-68m"; do
    read -r target draft <<< "$pair"
    profile="$OUT/$gpu-$target-$draft.json"
    echo "calibrating $target + $draft -> $profile"
    timeout 170 specbatch calibrate --target "$target" --draft "$draft" "${common[@]}" --out "$profile" \
        || { echo "calibration of $target + $draft failed or timed out (exit $?)" >&2; status=1; }
done
ls -l "$OUT"
exit $status
