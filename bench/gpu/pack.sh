#!/usr/bin/env bash
# Prepares what an H200 (CUDA) run needs, on a Linux build machine with registry access:
#   .gpu/bin/mlx-spec           the host built against the CPU wheel's headers, without the
#                               OpenBLAS link (the CUDA libmlx brings its own BLAS)
#   .gpu/bin/mlx-spec-lab       the developer lab, built the same way
#   .gpu/bin/plugins/           the drafter plugins
#   .gpu/bin.tar.xz             all of .gpu/bin packed (~7 MB): the file a call carries
#   .gpu/part-0 ... part-4      mlx-cuda-13==0.32.2's libmlx, JIT headers (cccl, cute,
#                               cutlass) and bundled libraries, xz-compressed (~73 MB) and split
#                               in five, because one transfer to the GPU machine carries 64 MiB
#                               together with the working tree (~50 MB with the default model
#                               and the assistant's checkpoint)
# Then run bench/gpu/run.sh there (see bench/gpu/README.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUTDIR="$ROOT/.gpu"
MLX_VERSION=0.32.2
mkdir -p "$OUTDIR/bin"
cd "$ROOT"
./scripts/setup.sh --no-build
MLX_SPEC_BLAS=none cargo build --release --quiet --workspace
cp target/release/mlx-spec target/release/mlx-spec-lab "$OUTDIR/bin/"
strip "$OUTDIR/bin/mlx-spec" "$OUTDIR/bin/mlx-spec-lab"
# Every drafter plugin, each in its folder as in plugins/ (--plugins-dir "$G/bin/plugins").
rm -rf "$OUTDIR/bin/plugins"
source scripts/plugin-library.sh
for manifest in plugins/*/plugin.toml; do
    name="$(basename "$(dirname "$manifest")")"
    library="$(plugin_library "$manifest")"
    mkdir -p "$OUTDIR/bin/plugins/$name"
    cp "$manifest" "$OUTDIR/bin/plugins/$name/"
    cp "target/release/$library" "$OUTDIR/bin/plugins/$name/"
    strip "$OUTDIR/bin/plugins/$name/$library"
done
# One file to carry: the binaries compress to about a quarter (run.sh unpacks it).
tar -C "$OUTDIR" -cf - bin | xz -T0 -6 >"$OUTDIR/bin.tar.xz"
# Restore the normal (OpenBLAS) build for this machine.
cargo build --release --quiet --workspace

if [[ ! -f "$OUTDIR/part-4" ]]; then
    tmp="$(mktemp -d)"
    python3 -m pip download --quiet --no-deps --only-binary=:all: "mlx-cuda-13==$MLX_VERSION" -d "$tmp"
    mkdir "$tmp/x"
    python3 -m zipfile -e "$tmp"/mlx_cuda_13-*.whl "$tmp/x"
    (cd "$tmp/x" && tar cf - mlx/lib mlx/include/cccl mlx/include/cute mlx/include/cutlass mlx_cuda_13.libs) \
        | xz -T0 -6 >"$tmp/mlx-cuda.tar.xz"
    rm -f "$OUTDIR"/part-[0-9]
    split -n 5 -d -a 1 "$tmp/mlx-cuda.tar.xz" "$OUTDIR/part-"
    rm -rf "$tmp"
fi
ls -la "$OUTDIR" "$OUTDIR/bin"
