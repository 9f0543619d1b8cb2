#!/usr/bin/env bash
# The full test suite: setup (idempotent), formatting, lints, then every test of the workspace.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
./scripts/setup.sh
cargo fmt --all -- --check
cargo clippy --release --workspace --all-targets --quiet -- -D warnings
# Plugin libraries (ngram, the test drafters) must exist before the tests load them.
cargo build --release --workspace --quiet
# One test at a time in each test binary: the tests of a binary share one process and one
# MLX, whose evaluation is not safe from several threads at once (mlx-spec itself drives MLX
# from one thread). Run in parallel, about 1 in 60 runs of the oracle tests ended in a heap
# corruption on a loaded 2-core machine; none in 80 run this way.
cargo test --release --workspace -- --test-threads=1
# The server against the official openai Python client, pinned, in a venv under target/
# (CI has only what this script installs).
OPENAI_VERSION=3.60.0
VENV="$ROOT/target/test-venv"
if ! "$VENV/bin/python" -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION')" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "openai==$OPENAI_VERSION"
fi
timeout 600 "$VENV/bin/python" tests/serve_openai.py target/release/mlx-spec
