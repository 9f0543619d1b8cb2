#!/usr/bin/env bash
# Compiles every fused CUDA kernel a decode step calls, for the H200 (sm_90a), with no GPU:
# before a lease, so that a kernel that does not compile or would not keep a grid-wide
# barrier's blocks resident is found here, not on the GPU machine.
#
#   bench/gpu/compile_check.sh            # E4B and 12B shapes, bf16 and 4-bit
#
# Needs the release binary (scripts/setup.sh) and PyPI: it fetches NVIDIA's NVRTC, ptxas,
# CUDA runtime headers and CCCL wheels once into .gpu/nvrtc (about 150 MB). Each model runs
# with one period of its layer pattern (two for E4B, whose second period shares the first's
# KV) and a 16 384-token
# vocabulary: the kernels' shapes are those of the full model but for the vocabulary, which
# is only a loop bound of the output head. Sources and the table go to .gpu/kernel-sources.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
LAB="$ROOT/target/release/mlx-spec-lab"
NV="$ROOT/.gpu/nvrtc"
OUT="$ROOT/.gpu/kernel-sources"
[[ -x "$LAB" ]] || { echo "build the host first: ./scripts/setup.sh"; exit 2; }

if [[ ! -f "$NV/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ]]; then
    mkdir -p "$NV/dl"
    python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$NV/dl" \
        nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-nvcc-cu12==12.9.86 \
        nvidia-cuda-runtime-cu12==12.9.79 nvidia-cuda-cccl-cu12==12.9.27
    python3 - "$NV" <<'EOF'
import glob, os, stat, sys, zipfile
root = sys.argv[1]
for wheel in glob.glob(os.path.join(root, "dl", "*.whl")):
    zipfile.ZipFile(wheel).extractall(root)
ptxas = os.path.join(root, "nvidia", "cuda_nvcc", "bin", "ptxas")
os.chmod(ptxas, os.stat(ptxas).st_mode | stat.S_IEXEC)
EOF
fi

rm -rf "$OUT"
mkdir -p "$OUT"
dumps=()
# COMPILE_CHECK_MODELS / COMPILE_CHECK_BITS narrow the check (defaults: "e4b 12b", "0 4").
for model in ${COMPILE_CHECK_MODELS:-e4b 12b}; do
    config="$OUT/gemma-4-$model-short.json"
    python3 - "$ROOT/configs/gemma-4-$model.json" "$config" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
types = c["layer_types"]
period = types.index("full_attention") + 1
# One layer of each kind, twice where the second period shares the first one's KV.
keep = 2 * period if c.get("num_kv_shared_layers") else period
c["layer_types"] = types[:keep]
c["num_hidden_layers"] = keep
if c.get("num_kv_shared_layers"):
    c["num_kv_shared_layers"] = period
c["vocab_size"] = 16384
if c.get("vocab_size_per_layer_input"):
    c["vocab_size_per_layer_input"] = 16384
json.dump(c, open(sys.argv[2], "w"), indent=1)
EOF
    for bits in ${COMPILE_CHECK_BITS:-0 4}; do
        dir="$OUT/$model-$([[ $bits == 4 ]] && echo 4bit || echo bf16)"
        extra=()
        [[ $bits == 4 ]] && extra=(--random-bits 4)
        "$LAB" --random-weights --model "$config" --dtype bf16 "${extra[@]}" \
            --prompt-tokens 4 --gen-tokens 1 --dump-kernel-sources "$dir"
        dumps+=("$dir")
    done
done
python3 "$ROOT/bench/gpu/compile_check.py" --cuda "$NV" "${dumps[@]}" | tee "$OUT/compile-check.md"
