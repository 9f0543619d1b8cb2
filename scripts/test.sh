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
# The server against the official openai Python client, pinned, in a venv under target/,
# and its page in headless Chromium (Debian's package; a screenshot in target/test-artifacts).
# CI has only what this script installs.
OPENAI_VERSION=3.60.0
VENV="$ROOT/target/test-venv"
if ! "$VENV/bin/python" -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION')" 2>/dev/null; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "openai==$OPENAI_VERSION"
fi
timeout 600 "$VENV/bin/python" tests/serve_openai.py target/release/mlx-spec
CHROMIUM="$(command -v chromium || true)"
if [[ -z "$CHROMIUM" ]]; then
  command -v apt-get >/dev/null || { echo "error: the page test needs Chromium (Debian: apt-get install chromium)" >&2; exit 1; }
  sudo=""
  [[ $(id -u) -ne 0 ]] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium >/dev/null
  CHROMIUM="$(command -v chromium)"
fi
timeout 600 "$VENV/bin/python" tests/serve_page.py target/release/mlx-spec "$CHROMIUM" target/test-artifacts
