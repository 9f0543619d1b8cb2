#!/usr/bin/env bash
# Speculative vs plain decoding, measured side by side in one process per row (greedy, the
# outputs are checked to be identical). Usage: scripts/bench-spec.sh [MODEL_DIR] [extra bench flags]
#   - ngram on a prompt that repeats itself (copying pays off);
#   - a drafter that never proposes: the cost of the plugin boundary and the loop per step;
#   - a drafter that is always wrong: what auto-off leaves of the cost of bad drafts.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL="${1:-$ROOT/models/gemma4-code-25m-v2}"
shift || true
BIN="$ROOT/target/release/mlx-spec"
LIB=libmlx_spec_test_drafter.so
[[ "$(uname -s)" == Darwin ]] && LIB=libmlx_spec_test_drafter.dylib
(cd "$ROOT" && cargo build --release --quiet --workspace)
PLUGINS="$(mktemp -d)"
trap 'rm -rf "$PLUGINS"' EXIT
mkdir -p "$PLUGINS/ngram" "$PLUGINS/empty" "$PLUGINS/shift"
cp "$ROOT/plugins/ngram/plugin.toml" "$ROOT/target/release/libmlx_spec_ngram."* "$PLUGINS/ngram/"
for mode in empty shift; do
    cp "$ROOT/target/release/$LIB" "$PLUGINS/$mode/"
    printf '[plugin]\nname = "test-drafter"\nversion = "0.1.0"\nkind = "other"\napi = 1\nlibrary = "%s"\n[defaults]\nmode = "%s"\n' \
        "$LIB" "$mode" >"$PLUGINS/$mode/plugin.toml"
done
PROMPT="$ROOT/tests/prompts/code-edit.txt"
"$BIN" bench --model "$MODEL" --drafter ngram --plugins-dir "$PLUGINS/ngram" --prompt-file "$PROMPT" \
    --gen-tokens 128 --repeats 3 "$@"
"$BIN" bench --model "$MODEL" --drafter test-drafter --plugins-dir "$PLUGINS/empty" --prompt-file "$PROMPT" \
    --gen-tokens 128 --repeats 3 "$@" | tail -n 1
"$BIN" bench --model "$MODEL" --drafter test-drafter --plugins-dir "$PLUGINS/shift" --prompt-file "$PROMPT" \
    --gen-tokens 128 --repeats 3 "$@" | tail -n 1
