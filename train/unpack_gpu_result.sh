#!/usr/bin/env bash
# Rebuild a run folder from what gpu_run.sh exported to $OUT/run on the GPU machine
# (model shards + rest.tar.gz), then check the checkpoint and plot the loss curve.
#
#   bash train/unpack_gpu_result.sh SRC_DIR [DST_DIR]      (DST_DIR default: train/out/run)
# Env: PYTHON (python with torch + transformers 5.24 + matplotlib, default python3)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SRC="${1:?usage: unpack_gpu_result.sh SRC_DIR [DST_DIR]}"
DST="${2:-$HERE/out/run}"
PY="${PYTHON:-python3}"
[ -f "$SRC/rest.tar.gz" ] || { echo "no $SRC/rest.tar.gz" >&2; exit 1; }
rm -rf "$DST"
mkdir -p "$DST"
tar -C "$DST" -xzf "$SRC/rest.tar.gz"
cp "$SRC"/model*.safetensors "$DST/model/"
chmod -R u+w "$DST"
echo "== rebuilt $DST"
"$PY" "$HERE/verify_checkpoint.py" "$DST/model"
"$PY" "$HERE/plot_loss.py" "$DST" || echo "(plot skipped: matplotlib missing?)"
