#!/usr/bin/env bash
# One-time (idempotent) setup of everything mlx-spec needs to build, then a release build.
#
#   Linux: Debian packages (cmake, clang/libclang for bindgen, OpenBLAS), PyPI's prebuilt
#          libmlx (`mlx-cpu`, the exact MLX version mlx-sys pins) unpacked into .mlx/, and
#          mlx-sys fetched by cargo and patched with patches/mlx-sys-0.7.0.patch into
#          .mlx/mlx-sys (the workspace's [patch.crates-io] points there).
#   macOS: mlx-sys is unpacked (the patch is inert there) and MLX builds with Metal as usual.
#
# Nothing third-party is committed: every piece is fetched from a registry by exact version.
# Re-running is cheap; pass --no-build to stop before `cargo build`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MLX_VERSION="0.32.2"       # the MLX version that mlx-sys 0.7.0's mlx-c pins; the C++ ABI must match
MLX_SYS_VERSION="0.7.0"
STATE="$ROOT/.mlx"
BUILD=1
[[ "${1:-}" == "--no-build" ]] && BUILD=0

source "$ROOT/scripts/plugin-library.sh"

say() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

mkdir -p "$STATE"
command -v cargo >/dev/null || die "cargo not found: install Rust (https://rustup.rs) first"

install_debian_packages() {
    local need=()
    command -v cmake >/dev/null || need+=(cmake)
    command -v clang >/dev/null || need+=(clang)
    [[ -n "$(ls /usr/lib/llvm-*/lib/libclang*.so* 2>/dev/null)" ]] || need+=(libclang-dev)
    [[ -e /usr/lib/x86_64-linux-gnu/libopenblas.so || -e /usr/lib/aarch64-linux-gnu/libopenblas.so ]] \
        || need+=(libopenblas-dev)
    command -v python3 >/dev/null || need+=(python3 python3-pip)
    if ((${#need[@]})); then
        command -v apt-get >/dev/null || die "missing ${need[*]} and no apt-get: install them by hand"
        local sudo=""
        [[ $(id -u) -ne 0 ]] && sudo="sudo"
        say "installing Debian packages: ${need[*]}"
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
    fi
}

fetch_mlx_wheel() {
    local dest="$STATE/mlx-cpu-$MLX_VERSION"
    if [[ -f "$dest/mlx/share/cmake/MLX/MLXConfig.cmake" ]]; then return; fi
    say "downloading mlx-cpu==$MLX_VERSION from PyPI"
    local tmp
    tmp="$(mktemp -d)"
    python3 -m pip download --quiet --no-deps --only-binary=:all: "mlx-cpu==$MLX_VERSION" -d "$tmp" \
        || die "pip could not download mlx-cpu==$MLX_VERSION"
    rm -rf "$dest.partial"
    python3 -m zipfile -e "$tmp"/mlx_cpu-*.whl "$dest.partial"
    rm -rf "$tmp" "$dest"
    mv "$dest.partial" "$dest"
}

fetch_and_patch_mlx_sys() {
    local dest="$STATE/mlx-sys"
    local stamp="$dest/.mlx-spec-patch"
    local want
    want="$(cksum <"$ROOT/patches/mlx-sys-$MLX_SYS_VERSION.patch")"
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then return; fi
    say "fetching mlx-sys $MLX_SYS_VERSION with cargo and applying patches/mlx-sys-$MLX_SYS_VERSION.patch"
    # A throwaway manifest lets cargo download the crate without the workspace, whose
    # [patch] entry points at the folder this function is about to create.
    local tmp
    tmp="$(mktemp -d)"
    mkdir -p "$tmp/src"
    printf '[package]\nname = "fetch-mlx-sys"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\nmlx-sys = "=%s"\n' \
        "$MLX_SYS_VERSION" >"$tmp/Cargo.toml"
    echo 'fn main() {}' >"$tmp/src/main.rs"
    (cd "$tmp" && cargo fetch --quiet) || die "cargo could not fetch mlx-sys $MLX_SYS_VERSION"
    local crate
    crate="$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/mlx-sys-"$MLX_SYS_VERSION".crate | head -n 1)"
    [[ -f "$crate" ]] || die "mlx-sys-$MLX_SYS_VERSION.crate not found in the cargo cache"
    rm -rf "$dest" "$tmp/unpack"
    mkdir -p "$tmp/unpack"
    tar xzf "$crate" -C "$tmp/unpack"
    mv "$tmp/unpack/mlx-sys-$MLX_SYS_VERSION" "$dest"
    rm -rf "$tmp"
    (cd "$dest" && patch -s -p1 <"$ROOT/patches/mlx-sys-$MLX_SYS_VERSION.patch") \
        || die "patches/mlx-sys-$MLX_SYS_VERSION.patch did not apply"
    echo "$want" >"$stamp"
}

# Copies each built drafter library next to its plugins/<name>/plugin.toml, which is where the
# host looks for it (`--plugins-dir plugins`).
install_plugins() {
    local manifest lib
    for manifest in "$ROOT"/plugins/*/plugin.toml; do
        [[ -f "$manifest" ]] || continue
        lib="$(plugin_library "$manifest")"
        if [[ -f "$ROOT/target/release/$lib" ]]; then
            cp "$ROOT/target/release/$lib" "$(dirname "$manifest")/$lib"
        else
            say "warning: $lib (for $manifest) was not built"
        fi
    done
}

case "$(uname -s)" in
    Linux)
        install_debian_packages
        fetch_mlx_wheel
        ;;
    Darwin) ;;
    *) die "unsupported OS $(uname -s): mlx-spec builds on Linux and macOS" ;;
esac
fetch_and_patch_mlx_sys

if ((BUILD)); then
    say "building mlx-spec (release)"
    (cd "$ROOT" && cargo build --release --quiet --workspace)
    install_plugins
    say "done: $ROOT/target/release/mlx-spec"
fi
