#!/usr/bin/env bash
# Installs mlx-spec under a prefix, so that it runs from any directory:
#
#   PREFIX/bin/mlx-spec                       the binary
#   PREFIX/lib/mlx-spec/                      the libmlx it was built against (Linux)
#   PREFIX/share/mlx-spec/models/gemma4-code-25m-v2   the default model
#   PREFIX/share/mlx-spec/plugins/<name>/     each drafter plugin: plugin.toml, its library and
#                                             what it ships beside them (a checkpoint folder)
#
# The binary finds its default model and plugins from its own location (PREFIX/share/mlx-spec),
# or from $MLX_SPEC_HOME when that is set. Usage:
#
#   ./scripts/install.sh [--prefix DIR] [--no-build]
#
# The default prefix is ~/.local. Without --no-build, scripts/setup.sh runs first (idempotent).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="${HOME}/.local"
BUILD=1
while (($#)); do
    case "$1" in
        --prefix)
            [[ $# -ge 2 ]] || { echo "[install] error: --prefix needs a folder" >&2; exit 2; }
            PREFIX="$2"
            shift 2
            ;;
        --no-build) BUILD=0; shift ;;
        -h | --help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "[install] error: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

source "$ROOT/scripts/plugin-library.sh"

say() { printf '[install] %s\n' "$*" >&2; }
die() { printf '[install] error: %s\n' "$*" >&2; exit 1; }

((BUILD)) && "$ROOT/scripts/setup.sh"
BIN="$ROOT/target/release/mlx-spec"
[[ -x "$BIN" ]] || die "$BIN is not built: run scripts/setup.sh first"

mkdir -p "$PREFIX"
PREFIX="$(cd "$PREFIX" && pwd)"
SHARE="$PREFIX/share/mlx-spec"
mkdir -p "$PREFIX/bin" "$SHARE/models" "$SHARE/plugins"

install -m 755 "$BIN" "$PREFIX/bin/mlx-spec"

# libmlx: the binary's RUNPATH names the build tree's copy first and $ORIGIN/../lib/mlx-spec
# second, so the installed binary keeps working when the checkout is gone.
if [[ "$(uname -s)" == Linux ]]; then
    mkdir -p "$PREFIX/lib/mlx-spec"
    libdir="$(ls -d "$ROOT"/.mlx/mlx-cpu-*/mlx/lib 2>/dev/null | head -n 1)"
    [[ -n "$libdir" ]] || die "no libmlx under .mlx/: run scripts/setup.sh first"
    cp -P "$libdir"/*.so* "$PREFIX/lib/mlx-spec/"
fi

# The default model is the one the host names (DEFAULT_MODEL_DIR in host/src/lib.rs).
default_model="$(sed -n 's/^pub const DEFAULT_MODEL_DIR: &str = "\(.*\)";/\1/p' "$ROOT/host/src/lib.rs")"
[[ -n "$default_model" && -d "$ROOT/$default_model" ]] || die "cannot find the default model named in host/src/lib.rs"
rm -rf "$SHARE/$default_model"
cp -R "$ROOT/$default_model" "$SHARE/models/"

# Each plugin folder as the host reads it: the manifest and, beside it, the library this
# checkout built (else the copy already beside the manifest).
for manifest in "$ROOT"/plugins/*/plugin.toml; do
    [[ -f "$manifest" ]] || continue
    src="$(dirname "$manifest")"
    name="$(basename "$src")"
    dest="$SHARE/plugins/$name"
    lib="$(plugin_library "$manifest")"
    rm -rf "$dest"
    mkdir -p "$dest"
    # Everything the plugin ships beside its manifest (a checkpoint folder, a README), but
    # not a library left there by an earlier build: the fresh one is copied below.
    for item in "$src"/* "$src"/.[!.]*; do
        [[ -e "$item" ]] || continue
        case "$(basename "$item")" in
            *.so | *.dylib | src | tests | target | Cargo.toml | Cargo.lock | build.rs) continue ;;
        esac
        cp -R "$item" "$dest/"
    done
    if [[ -n "$lib" && -f "$ROOT/target/release/$lib" ]]; then
        cp "$ROOT/target/release/$lib" "$dest/"
    elif [[ -n "$lib" && -f "$src/$lib" ]]; then
        cp "$src/$lib" "$dest/"
    else
        say "warning: plugin $name has no built library (run scripts/setup.sh)"
    fi
done

say "installed $PREFIX/bin/mlx-spec (model and plugins in $SHARE)"
case ":$PATH:" in
    *":$PREFIX/bin:"*) ;;
    *) say "add $PREFIX/bin to PATH to run mlx-spec by name" ;;
esac
