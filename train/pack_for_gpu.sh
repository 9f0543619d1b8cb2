#!/usr/bin/env bash
# Pack everything the GPU machine (no network, Python 3.12, a torch venv) needs to train:
#   out/gpu-payload/
#     gpu_run.sh, train_model.py, verify_checkpoint.py   copies of the scripts
#     wheels/      pinned wheels for what transformers 5.24.0 imports (cp312, manylinux)
#     transformers-5.24.0-trimmed.tar.xz   transformers 5.24.0 from its pinned wheel with every
#                  model folder dropped except gemma4, gemma4_assistant, glm4_moe (the MTP row's
#                  check) and auto (9 MB, not 60)
#     data/        train.bin.xz, heldout.bin.xz, unseen.bin.xz, *_index.json, manifest.json,
#                  tokenizer_stats.json, tokenizer/{tokenizer.json,tokenizer_config.json}
#   out/gpu-parts/gpu-payload.tar.NN   the same folder as one tar cut into parts of at most
#                  PART_MB MB (default 24), so that each part travels in one device call
#                  (a call carries at most 64 MiB with the working tree); gpu_run.sh joins them
#
# Run here after prepare_corpus.py and train_tokenizer.py:   bash train/pack_for_gpu.sh
# Env: PYTHON (a python with pip, default python3); PART_MB; TRAIN_MB=N to carry only the
# first N MB of train.bin (a drafter's run reads a fraction of the corpus: with TRAIN_MB=100 the
# payload is about 30 MB, so one call carries it with the working tree and a target model);
# PACK_NUMPY=1 to carry numpy too
# (+16.6 MB; the H200 machine's python already has numpy 2.5.2, so it is left out by default;
# gpu_run.sh installs a carried numpy only when the GPU python has none).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
DATA="$HERE/data"
PAYLOAD="$HERE/out/gpu-payload"
PARTS="$HERE/out/gpu-parts"
PART_MB="${PART_MB:-24}"

# transformers 5.24.0 and the packages it imports when building, training, saving and
# reloading Gemma4ForCausalLM (checked with sys.modules); the hub CLI extras (typer, rich,
# pydantic, hf-xet, ...) are never imported, so they stay out (install uses --no-deps).
# transformers itself is packed trimmed (see above); tokenizers is the GPU python's own.
TRANSFORMERS=transformers==5.24.0
WHEELS=(
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

for f in train.bin heldout.bin heldout_index.json unseen.bin unseen_index.json manifest.json \
         tokenizer_stats.json tokenizer/tokenizer.json tokenizer/tokenizer_config.json; do
  [ -f "$DATA/$f" ] || { echo "missing $DATA/$f: run prepare_corpus.py and train_tokenizer.py first" >&2; exit 1; }
done

rm -rf "$PAYLOAD" "$PARTS" "$HERE/out/gpu-payload.tar.xz" "$HERE/out/gpu-payload.tar.gz"
mkdir -p "$PAYLOAD/wheels" "$PAYLOAD/data/tokenizer"

# Reuse wheels from an earlier pack when present (same pinned names), else download.
CACHE="$HERE/out/wheel-cache"
mkdir -p "$CACHE"
"$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$CACHE" "${WHEELS[@]}" "$TRANSFORMERS"
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

# transformers without the ~550 model folders Gemma 4 training never imports
TRIM="$HERE/out/transformers-trim"
rm -rf "$TRIM" && mkdir -p "$TRIM"
"$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
  "$(ls "$CACHE"/transformers-5.24.0-*.whl)" "$TRIM"
for d in "$TRIM"/transformers/models/*/; do
  case "$(basename "$d")" in gemma4|gemma4_assistant|glm4_moe|auto) ;; *) rm -rf "$d" ;; esac
done
XZ_OPT="-6 -T0" tar -C "$TRIM" -cJf "$PAYLOAD/transformers-5.24.0-trimmed.tar.xz" .
rm -rf "$TRIM"

for f in heldout.bin unseen.bin; do
  xz -6 -T0 -c "$DATA/$f" > "$PAYLOAD/data/$f.xz"
done
if [ -n "${TRAIN_MB:-}" ]; then
  # Tokens are uint16: cut at an even byte count, so no token is split.
  head -c $((TRAIN_MB * 1000000 / 2 * 2)) "$DATA/train.bin" | xz -6 -T0 -c > "$PAYLOAD/data/train.bin.xz"
else
  xz -6 -T0 -c "$DATA/train.bin" > "$PAYLOAD/data/train.bin.xz"
fi
cp "$DATA"/heldout_index.json "$DATA"/unseen_index.json "$DATA"/manifest.json \
   "$DATA"/tokenizer_stats.json "$PAYLOAD/data/"
cp "$DATA"/tokenizer/tokenizer.json "$DATA"/tokenizer/tokenizer_config.json "$PAYLOAD/data/tokenizer/"
cp "$HERE"/gpu_run.sh "$HERE"/train_model.py "$HERE"/verify_checkpoint.py "$PAYLOAD/"
( cd "$PAYLOAD" && sha256sum wheels/*.whl ./*.tar.xz data/*.xz data/*.json data/tokenizer/* > SHA256SUMS )

mkdir -p "$PARTS"
tar -C "$HERE/out" -cf - gpu-payload | split -d -b "${PART_MB}M" - "$PARTS/gpu-payload.tar."
( cd "$PARTS" && sha256sum gpu-payload.tar.* > PARTS.sha256 )
echo "== payload folder: $(du -sh "$PAYLOAD" | cut -f1)  ($(ls "$PAYLOAD/wheels" | wc -l) wheels, $(du -sh "$PAYLOAD/wheels" | cut -f1))"
ls -l "$PARTS"
echo "== carry each part of $PARTS in its own device call into one folder there, then run"
echo "   PARTS=<that folder> bash gpu_run.sh MINUTES   (gpu_run.sh is inside the payload too)"
