#!/usr/bin/env bash
# Train ON the GPU machine (no network) from the packed payload.
#
#   bash train/gpu_run.sh [MINUTES] [extra train_model.py arguments...]
#   TASK=assistant bash train/gpu_run.sh [MINUTES] [extra train_assistant.py arguments...]
#
# MINUTES (default 6) is the wall-clock budget of the training loop; final evaluation,
# saving and the golden add about half a minute on top.
# TASK=assistant trains the assistant drafter for the target in $TARGET (default
# models/gemma4-code-25m-v2 of the checkout this script sits in) instead of the model, into
# train/out/$NAME/ (NAME defaults to "assistant"), or with $OUT set into one file
# $OUT/$NAME.tar.gz (model.safetensors, config.json, generation_config.json, metrics.json,
# train_log.csv, train_stdout.log), so that several shapes can train side by side on one GPU:
#   TASK=assistant NAME=a4 bash gpu_run.sh 6 --layers 4 & TASK=assistant NAME=a2 bash gpu_run.sh 6 --layers 2 & wait
# TASK=mtp trains the glm-mtp row (train_mtp.py) the same way, into train/out/$NAME/ (NAME
# defaults to "mtp") or $OUT/$NAME.tar.gz (model.safetensors, config.json, metrics.json,
# train_log.csv, train_stdout.log); its final check uses transformers' glm4_moe, which the
# payload's trimmed transformers keeps.
#   TASK=mtp NAME=pre bash gpu_run.sh 6 --chain pre_norm & TASK=mtp NAME=post bash gpu_run.sh 6 --chain post_norm & wait
# TASK=eval scores whole held-out and unseen files as `mlx-spec perplexity` does, for the model
# folders of MODELS at the contexts of CONTEXTS (see the section below); MINUTES is unused.
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

# The scripts beside this one (the checkout's, or the payload's copies when it runs from there).
SCRIPTS="$HERE"

# ---------------------------------------------------------------- per-file evaluation
# TASK=eval scores the payload's held-out and unseen files whole, as `mlx-spec perplexity`
# does (eval_heldout.py --per-file), for each model folder of MODELS (default: the checkout's
# default model) at each context of CONTEXTS (default "0,512": the served context, then 512),
# in float32 on the GPU. One JSON line per model and context, also appended to $OUT/eval.jsonl.
if [ "${TASK:-model}" = "eval" ]; then
  for m in ${MODELS:-$HERE/../models/gemma4-code-25m-v2}; do
    "$PY" "$SCRIPTS/eval_heldout.py" "$m" --data "$PAYLOAD/data" --per-file "${CONTEXTS:-0,512}" \
      --device cuda | tee -a ${OUT:+"$OUT/eval.jsonl"}
  done
  rm -rf "$WORK" "${UNPACK:-}"
  exit 0
fi

# ---------------------------------------------------------------- assistant drafter
if [ "${TASK:-model}" = "assistant" ]; then
  TARGET="${TARGET:-$HERE/../models/gemma4-code-25m-v2}"
  NAME="${NAME:-assistant}"
  if [ -n "${OUT:-}" ]; then RUN="$WORK/$NAME"; else RUN="$HERE/out/$NAME"; fi
  rm -rf "$RUN"
  mkdir -p "$RUN"
  # The checkout's scripts: train_assistant.py imports eval_heldout.py beside it.
  # A failure after training (evaluation, the transformers check) must not lose the saved
  # weights: export whatever is there, then fail.
  status=0
  "$PY" "$HERE/train_assistant.py" --target "$TARGET" --train-bin "$PAYLOAD/data/train.bin" \
    --heldout-bin "$PAYLOAD/data/heldout.bin" --out "$RUN" --max-minutes "$MINUTES" "$@" \
    2>&1 | tee "$RUN/train_stdout.log" || status=$?
  if [ -d "$RUN/model" ]; then mv "$RUN"/model/* "$RUN"/ && rmdir "$RUN/model"; fi
  if [ "$status" -ne 0 ]; then
    [ -n "${OUT:-}" ] && tar -C "$RUN" -czf "$OUT/$NAME.tar.gz" .
    echo "== train_assistant.py failed ($status); what it left is in ${OUT:-$RUN}" >&2
    exit "$status"
  fi
  "$PY" - "$RUN/metrics.json" "$NAME" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
a = m["args"]
rows = [
    ("run", sys.argv[2]),
    ("parameters", f"{m['params']:,}"),
    ("shape", f"{a['layers']} layers, hidden {a['hidden']}, ffn {a['ffn']}, {a['steps']} steps"),
    ("train steps", f"{m['train_steps']:,} in {m['train_seconds'] / 60:.2f} min"),
] + [(f"est. acceptance at {k + 1}", f"{v:.3f}") for k, v in enumerate(m["heldout"]["mean_acceptance_length_at_k"])]
w = max(len(k) for k, _ in rows)
print("=" * 50)
for k, v in rows:
    print(f"{k:<{w}}  {v}")
print("=" * 50)
EOF
  if [ -n "${OUT:-}" ]; then
    tar -C "$RUN" -czf "$OUT/$NAME.tar.gz" .
    echo "== result: $OUT/$NAME.tar.gz (untar it into plugins/assistant/checkpoint or a folder of your own)"
  else
    echo "== result: $RUN"
  fi
  rm -rf "$WORK" "${UNPACK:-}"
  exit 0
fi

# ---------------------------------------------------------------- MTP row (glm-mtp)
if [ "${TASK:-model}" = "mtp" ]; then
  TARGET="${TARGET:-$HERE/../models/gemma4-code-25m-v2}"
  NAME="${NAME:-mtp}"
  if [ -n "${OUT:-}" ]; then RUN="$WORK/$NAME"; else RUN="$HERE/out/$NAME"; fi
  rm -rf "$RUN"
  mkdir -p "$RUN"
  "$PY" -c "import transformers.models.glm4_moe.modeling_glm4_moe" 2>/dev/null \
    || echo "== warning: this transformers has no glm4_moe (a payload packed before pack_for_gpu.sh kept it); the final check will fail" >&2
  # As for the assistant: whatever train_mtp.py saved is exported even when a later stage
  # (evaluation, the transformers check) fails.
  status=0
  "$PY" "$HERE/train_mtp.py" --target "$TARGET" --train-bin "$PAYLOAD/data/train.bin" \
    --heldout-bin "$PAYLOAD/data/heldout.bin" --out "$RUN" --max-minutes "$MINUTES" "$@" \
    2>&1 | tee "$RUN/train_stdout.log" || status=$?
  if [ -d "$RUN/model" ]; then mv "$RUN"/model/* "$RUN"/ && rmdir "$RUN/model"; fi
  if [ -n "${OUT:-}" ]; then tar -C "$RUN" -czf "$OUT/$NAME.tar.gz" .; fi
  if [ "$status" -ne 0 ]; then
    echo "== train_mtp.py failed ($status); what it left is in ${OUT:-$RUN}" >&2
    exit "$status"
  fi
  "$PY" - "$RUN/metrics.json" "$NAME" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
a, v = m["args"], m.get("verify", {})
rows = [
    ("run", sys.argv[2]),
    ("chain_hidden", a["chain"]),
    ("parameters", f"{m['params']:,}"),
    ("shape", f"{a['heads']}/{a['kv_heads']} heads x {a['head_dim']}, ffn {a['ffn']}, {a['steps']} steps"),
    ("train steps", f"{m['train_steps']:,} in {m['train_seconds'] / 60:.2f} min"),
] + [(f"est. acceptance at {k + 1}", f"{x:.3f}") for k, x in enumerate(m["heldout"]["mean_acceptance_length_at_k"])] + [
    ("transformers check", f"{'PASS' if v.get('pass') else 'FAIL'}, max |dlogit| {v.get('max_logit_diff', float('nan')):.2e}"),
]
w = max(len(k) for k, _ in rows)
print("=" * 50)
for k, x in rows:
    print(f"{k:<{w}}  {x}")
print("=" * 50)
EOF
  if [ -n "${OUT:-}" ]; then
    echo "== result: $OUT/$NAME.tar.gz (config.json, model.safetensors for plugins/glm-mtp/checkpoint)"
  else
    echo "== result: $RUN"
  fi
  rm -rf "$WORK" "${UNPACK:-}"
  exit 0
fi

# ---------------------------------------------------------------- train
SLICED=()
if [ -n "${STATE:-}" ]; then
  # A run in slices (STATE=<file on the GPU machine's disk>, SLICE=<minutes per call>): each
  # call trains one slice and saves the state beside the run folder, which must outlive the
  # call; the call that completes MINUTES goes on to the evaluation, checks and export below.
  RUN="$(dirname "$STATE")/run"
  SLICED=(--state "$STATE" --slice-minutes "${SLICE:?SLICE (minutes per call) goes with STATE}")
elif [ -n "${OUT:-}" ]; then
  RUN="$WORK/run"
else
  RUN="$HERE/out/run"
fi
# A run starts from an empty folder; a resumed one keeps its logs.
if [ -z "${STATE:-}" ] || [ ! -f "$STATE" ]; then rm -rf "$RUN"; fi
mkdir -p "$RUN"
"$PY" "$SCRIPTS/train_model.py" --device cuda --data "$PAYLOAD/data" --tokenizer "$PAYLOAD/data/tokenizer" \
  --out "$RUN" --max-minutes "$MINUTES" "${SLICED[@]}" "$@" 2>&1 | tee -a "$RUN/train_stdout.log"
if [ -f "$RUN/PAUSED" ]; then
  [ -n "${OUT:-}" ] && cp "$RUN/train_stdout.log" "$RUN/eval_log.csv" "$OUT/"
  echo "== slice done: $(cat "$RUN/PAUSED"); call again with the same STATE to go on"
  rm -rf "$WORK" "${UNPACK:-}"
  exit 0
fi

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
