#!/usr/bin/env bash
# Pack everything the GPU machine (no network, Python 3.12, a torch venv) needs to train:
#   out/gpu-payload/
#     gpu_run.sh, train_model.py, verify_checkpoint.py   copies of the scripts
#     wheels/      pinned wheels for transformers 5.24.0 and what it imports (cp312, manylinux)
#     data/        train.bin, heldout.bin, heldout_index.json, manifest.json, tokenizer_stats.json
#     data/tokenizer/   tokenizer.json, tokenizer_config.json
#   out/gpu-payload.tar.xz   the same folder as one tarball (xz: the token files shrink ~4x)
#
# Run here after prepare_corpus.py and train_tokenizer.py:   bash train/pack_for_gpu.sh
# Env: PYTHON (a python with pip, default python3); PACK_NUMPY=1 to carry numpy too (+16.6 MB;
# the H200 machine's /opt/torch/.venv already has numpy 2.5.2, so it is left out by default;
# gpu_run.sh installs a carried numpy only when the GPU python has none).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
DATA="$HERE/data"
PAYLOAD="$HERE/out/gpu-payload"
TARBALL="$HERE/out/gpu-payload.tar.xz"

# transformers 5.24.0 and the packages it imports when building, training, saving and
# reloading Gemma4ForCausalLM (checked with sys.modules); the hub CLI extras (typer, rich,
# pydantic, hf-xet, ...) are never imported, so they stay out (install uses --no-deps).
WHEELS=(
  transformers==5.24.0
  tokenizers==0.23.3
  safetensors==0.8.0
  huggingface_hub==2.4.0
  httpx2==2.16.2
  httpcore2==2.16.2
  h11==0.16.0
  anyio==4.16.0
  idna==3.20
  truststore==0.10.5
  typing_extensions==4.16.0
  filelock==4.3.1
  fsspec==2026.9.0
  packaging==26.4
  pyyaml==6.0.4
  regex==2026.11.19
  tqdm==4.70.1
)
if [ "${PACK_NUMPY:-0}" = "1" ]; then
  WHEELS+=(numpy==2.4.6)
fi

for f in train.bin heldout.bin heldout_index.json manifest.json tokenizer_stats.json \
         tokenizer/tokenizer.json tokenizer/tokenizer_config.json; do
  [ -f "$DATA/$f" ] || { echo "missing $DATA/$f: run prepare_corpus.py and train_tokenizer.py first" >&2; exit 1; }
done

rm -rf "$PAYLOAD" "$TARBALL" "$HERE/out/gpu-payload.tar.gz"
mkdir -p "$PAYLOAD/wheels" "$PAYLOAD/data/tokenizer"

# Reuse wheels from an earlier pack when present (same pinned names), else download.
CACHE="$HERE/out/wheel-cache"
mkdir -p "$CACHE"
"$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$CACHE" "${WHEELS[@]}"
for spec in "${WHEELS[@]}"; do
  name="${spec%%==*}"; ver="${spec##*==}"
  norm="$(echo "$name" | tr 'A-Z-.' 'a-z__')"
  found=""
  for w in "$CACHE"/*.whl; do
    b="$(basename "$w")"
    wn="$(echo "${b%%-*}" | tr 'A-Z-.' 'a-z__')"
    wv="$(echo "$b" | cut -d- -f2)"
    if [ "$wn" = "$norm" ] && [ "$wv" = "$ver" ]; then found="$w"; fi
  done
  [ -n "$found" ] || { echo "no wheel for $spec in $CACHE" >&2; exit 1; }
  cp "$found" "$PAYLOAD/wheels/"
done

cp "$DATA"/train.bin "$DATA"/heldout.bin "$DATA"/heldout_index.json "$DATA"/manifest.json \
   "$DATA"/tokenizer_stats.json "$PAYLOAD/data/"
cp "$DATA"/tokenizer/tokenizer.json "$DATA"/tokenizer/tokenizer_config.json "$PAYLOAD/data/tokenizer/"
cp "$HERE"/gpu_run.sh "$HERE"/train_model.py "$HERE"/verify_checkpoint.py "$PAYLOAD/"
( cd "$PAYLOAD" && sha256sum wheels/*.whl data/*.bin data/tokenizer/* > SHA256SUMS )

XZ_OPT="-6 -T0" tar -C "$HERE/out" -cJf "$TARBALL" gpu-payload
size=$(stat -c %s "$TARBALL")
if [ "$size" -gt 62914560 ]; then
  echo "warning: $TARBALL is $size bytes; a device call carries at most 64 MiB in all" >&2
fi
echo "== payload folder: $(du -sh "$PAYLOAD" | cut -f1)  ($(ls "$PAYLOAD/wheels" | wc -l) wheels, $(du -sh "$PAYLOAD/wheels" | cut -f1))"
echo "== tarball: $TARBALL  $(stat -c %s "$TARBALL") bytes ($(du -h "$TARBALL" | cut -f1))"
