#!/usr/bin/env bash
# Makes the working tree small enough to travel to the GPU machine, and puts it back.
#
#   bash bench/gpu/slim.sh aside [KEEP ...]   move what a GPU call does not read into .gpu/aside/
#   bash bench/gpu/slim.sh back               move it all back (git status is clean again)
#
# A device call sends the tracked and untracked-not-ignored files of the checkout, at most
# 64 MiB with the carried paths; tracked files that are absent from the disk do not travel
# (checked on the device machine). The repository's weights (the default model, the drafters'
# checkpoints, the test fixtures) now exceed that on their own, so before a call this moves
# aside the test fixtures and goldens and every drafter checkpoint not named in KEEP (plugin
# names, e.g. `assistant glm-mtp`; `model` keeps nothing else out). KEEP may also name model
# folders of models/ (e.g. `gemma4-code-25m-v2`): those stay and every other model moves aside;
# when KEEP names none, the default model (host/src/lib.rs) stays and the others move aside.
# Run `back` after the call, and before committing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
ASIDE="$ROOT/.gpu/aside"
cd "$ROOT"

case "${1:-}" in
  aside)
    shift
    [ -e "$ASIDE" ] && { echo "$ASIDE exists: run '$0 back' first" >&2; exit 1; }
    mkdir -p "$ASIDE"
    paths=(tests/fixtures tests/goldens)
    for ckpt in plugins/*/checkpoint; do
      [ -d "$ckpt" ] || continue
      name="$(basename "$(dirname "$ckpt")")"
      keep=0
      for k in "$@"; do [ "$k" = "$name" ] && keep=1; done
      [ "$keep" -eq 1 ] || paths+=("$ckpt")
    done
    default_model="$(sed -n 's/^pub const DEFAULT_MODEL_DIR: &str = "models\/\(.*\)";/\1/p' host/src/lib.rs)"
    named_model=0
    for k in "$@"; do [ -d "models/$k" ] && named_model=1; done
    for m in models/*/; do
      m="${m%/}"
      name="$(basename "$m")"
      keep=0
      for k in "$@"; do [ "$k" = "$name" ] && keep=1; done
      [ "$named_model" -eq 0 ] && [ "$name" = "$default_model" ] && keep=1
      [ "$keep" -eq 1 ] || paths+=("$m")
    done
    for p in "${paths[@]}"; do
      mkdir -p "$ASIDE/$(dirname "$p")"
      mv "$p" "$ASIDE/$p"
    done
    echo "moved aside: ${paths[*]}"
    echo "travels now: $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes tracked"
    ;;
  back)
    [ -d "$ASIDE" ] || { echo "nothing is aside" >&2; exit 0; }
    (cd "$ASIDE" && find . -mindepth 1 -maxdepth 3 -type d \( -name checkpoint -o -path ./tests/fixtures -o -path ./tests/goldens -o -path './models/*' \) -print) |
      while read -r p; do
        p="${p#./}"
        mkdir -p "$(dirname "$p")"
        mv "$ASIDE/$p" "$p"
      done
    rm -rf "$ASIDE"
    git status --short -- tests plugins
    ;;
  *)
    sed -n 2,14p "$0" >&2
    exit 2
    ;;
esac
