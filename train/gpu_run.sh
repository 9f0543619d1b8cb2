#!/usr/bin/env bash
# Train the model ON the GPU machine (no network) from the packed payload.
#
#   bash train/gpu_run.sh [MINUTES] [extra train_model.py arguments...]
#
# MINUTES (default 6) is the wall-clock budget of the training loop; final evaluation,
# saving and the golden add about half a minute on top.
# The payload is looked for, in order: $PARTS, a folder holding the parts written by
# pack_for_gpu.sh (gpu-payload.tar.NN + PARTS.sha256; they are joined and unpacked into a
# scratch folder); $PAYLOAD; the folder of this script when it holds wheels/ and data/
# (running the copy inside the payload); train/out/gpu-payload/.
# Python: $PYTHON, then python3, then /opt/torch/.venv/bin/python (the first one whose torch
# sees CUDA). The carried wheels go into a fresh --target folder (nothing is installed into
# that python); numpy only when that python has none.
# Result when $OUT is unset: train/out/run/ (train_log.csv, eval_log.csv, metrics.json,
# train_stdout.log, model/). When $OUT is set (the remote harness, which brings back at most
# 8 files of <= 16 MiB each, at most 2 folders deep), the run is trained in a scratch folder
# and exported as $OUT/run/{model-0000N-of-0000M.safetensors, rest.tar.gz, metrics.json,
# train_stdout.log}; rebuild the tree here with
#   bash train/unpack_gpu_result.sh <folder holding those files> [train/out/run]
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MINUTES="${1:-6}"
[ $# -gt 0 ] && shift

# ---------------------------------------------------------------- payload
if [ -n "${PARTS:-}" ]; then
  (cd "$PARTS" && sha256sum --quiet -c PARTS.sha256) || { echo "payload parts in $PARTS: checksum mismatch or part missing" >&2; exit 1; }
  UNPACK="$(mktemp -d "${TMPDIR:-/tmp}/gemma4-payload.XXXXXX")"
  echo "== joining $(ls "$PARTS"/gpu-payload.tar.* | wc -l) parts from $PARTS"
  cat "$PARTS"/gpu-payload.tar.* | tar -C "$UNPACK" -xf -
  PAYLOAD="$UNPACK/gpu-payload"
elif [ -n "${PAYLOAD:-}" ]; then
  :
elif [ -d "$HERE/wheels" ] && [ -d "$HERE/data" ]; then
  PAYLOAD="$HERE"
elif [ -d "$HERE/out/gpu-payload/wheels" ]; then
  PAYLOAD="$HERE/out/gpu-payload"
else
  echo "no payload: set PARTS (or PAYLOAD), or run pack_for_gpu.sh to make train/out/gpu-payload/" >&2
  exit 1
fi
if [ -f "$PAYLOAD/SHA256SUMS" ]; then
  (cd "$PAYLOAD" && sha256sum --quiet -c SHA256SUMS) || { echo "payload checksum mismatch" >&2; exit 1; }
fi
for f in "$PAYLOAD"/data/*.bin.xz; do
  [ -e "$f" ] || continue
  [ -f "${f%.xz}" ] || xz -d -k -T0 "$f"
done

# ---------------------------------------------------------------- python with torch
PY=""
for cand in ${PYTHON:-} python3 /opt/torch/.venv/bin/python; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    PY="$cand"; break
  fi
done
if [ -z "$PY" ]; then
  echo "no python whose torch sees a CUDA device (tried: ${PYTHON:-} python3 /opt/torch/.venv/bin/python)" >&2
  exit 1
fi
echo "== python: $(command -v "$PY") ($("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, torch.cuda.get_device_name(0))'))"

# ---------------------------------------------------------------- carried wheels
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gemma4-train.XXXXXX")"
SITE="$WORK/site"
mkdir -p "$SITE"
WHEELS=()
for w in "$PAYLOAD"/wheels/*.whl; do
  case "$(basename "$w")" in
    numpy-*) "$PY" -c "import numpy" 2>/dev/null && continue ;;
  esac
  WHEELS+=("$w")
done
if "$PY" -m pip --version >/dev/null 2>&1; then
  "$PY" -m pip install --disable-pip-version-check -q --no-index --no-deps --target "$SITE" "${WHEELS[@]}"
else
  echo "== no pip: unpacking wheels directly"
  "$PY" - "$SITE" "${WHEELS[@]}" <<'EOF'
import sys, zipfile
for w in sys.argv[2:]:
    zipfile.ZipFile(w).extractall(sys.argv[1])
EOF
fi
if [ -f "$PAYLOAD/transformers-5.24.0-trimmed.tar.xz" ]; then
  tar -C "$SITE" -xJf "$PAYLOAD/transformers-5.24.0-trimmed.tar.xz"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import transformers, numpy; from transformers import Gemma4ForCausalLM; \
print('== transformers', transformers.__version__, 'from', transformers.__file__.rsplit('/', 2)[0], '| numpy', numpy.__version__)"

# ---------------------------------------------------------------- train
if [ -n "${OUT:-}" ]; then
  RUN="$WORK/run"
else
  RUN="$HERE/out/run"
fi
rm -rf "$RUN"
mkdir -p "$RUN"
SCRIPTS="$HERE"
[ -f "$PAYLOAD/train_model.py" ] && SCRIPTS="$PAYLOAD"
"$PY" "$SCRIPTS/train_model.py" --device cuda --data "$PAYLOAD/data" --tokenizer "$PAYLOAD/data/tokenizer" \
  --out "$RUN" --max-minutes "$MINUTES" "$@" 2>&1 | tee "$RUN/train_stdout.log"

# ---------------------------------------------------------------- check + summary
"$PY" "$SCRIPTS/verify_checkpoint.py" "$RUN/model" 2>&1 | tee -a "$RUN/train_stdout.log"
"$PY" - "$RUN/metrics.json" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
rows = [
    ("params", f"{m['params']:,}"),
    ("steps", f"{m['steps']:,}"),
    ("tokens", f"{m['tokens_seen']:,} ({m['epochs']:.1f} epochs)"),
    ("minutes", f"{m['train_wall_seconds'] / 60:.2f} train, {m['total_wall_seconds'] / 60:.2f} total"),
    ("tokens/s", f"{m['tokens_per_second']:,.0f}"),
    ("saved weights of step", f"{m['saved_step']:,} (best periodic eval; restored: {m['restored_best']})"),
    ("final train loss", f"{m['final_train_loss']:.4f}"),
    ("held-out loss", f"{m['heldout_loss']:.4f}"),
    ("perplexity", f"{m['heldout_ppl']:.3f}"),
    ("device", m["device"]),
]
w = max(len(k) for k, _ in rows)
print("=" * 50)
for k, v in rows:
    print(f"{k:<{w}}  {v}")
print("=" * 50)
EOF
if [ -n "${OUT:-}" ]; then
  EXP="$OUT/run"
  rm -rf "$EXP"
  mkdir -p "$EXP"
  cp "$RUN"/model/model*.safetensors "$EXP/"
  tar -C "$RUN" --exclude='model/model*.safetensors' -czf "$EXP/rest.tar.gz" .
  cp "$RUN/metrics.json" "$RUN/train_stdout.log" "$EXP/"
  ls -la "$EXP"
  echo "== result: $EXP (unpack here with: bash train/unpack_gpu_result.sh <that folder>)"
  rm -rf "$WORK" "${UNPACK:-}"
else
  echo "== result: $RUN (model in $RUN/model)"
  rm -rf "$WORK"
fi
