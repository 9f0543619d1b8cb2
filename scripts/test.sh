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
cargo test --release --workspace
