#!/usr/bin/env python3
"""Plot the training curve of a run: train loss (and held-out loss when eval_log.csv exists)
against tokens seen, plus the learning rate. Needs matplotlib.

Usage:  python plot_loss.py [RUN_DIR]      (default: out/run next to this script)
Reads RUN_DIR/train_log.csv and RUN_DIR/eval_log.csv, writes RUN_DIR/loss.png.
"""

import csv
import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def read_csv(path):
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def main():
    run = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "out" / "run"
    train = read_csv(run / "train_log.csv")
    evals = read_csv(run / "eval_log.csv")
    if not train:
        sys.exit(f"no rows in {run / 'train_log.csv'}")
    title = run.name
    metrics_path = run / "metrics.json"
    if metrics_path.exists():
        m = json.loads(metrics_path.read_text())
        title = (f"Gemma 4 text, {m['params'] / 1e6:.2f} M params, {m['steps']} steps, "
                 f"{m['tokens_seen'] / 1e6:.3g} M tokens, {m['device']}; "
                 f"held-out loss {m['heldout_loss']:.3f} (ppl {m['heldout_ppl']:.2f})")

    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(10, 7), sharex=True,
                                    gridspec_kw={"height_ratios": [3, 1]})
    tok = [r["tokens"] / 1e6 for r in train]
    ax.plot(tok, [r["train_loss"] for r in train], lw=1, label="train loss")
    if evals:
        ax.plot([r["tokens"] / 1e6 for r in evals], [r["heldout_loss"] for r in evals],
                "o-", ms=4, lw=1.5, label="held-out loss")
    ax.set_ylabel("cross-entropy (nats/token)")
    losses = sorted(r["train_loss"] for r in train)
    lo = min(losses + [r["heldout_loss"] for r in evals])
    # the first few logged losses (~9 nats) would squash the interesting part: clip the top
    hi = losses[int(0.97 * (len(losses) - 1))] + 0.5
    if evals:
        hi = max(hi, min(r["heldout_loss"] for r in evals) + 1.0)
    ax.set_ylim(max(0.0, math.floor(lo * 2) / 2 - 0.25), min(losses[-1] + 0.25, hi))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    ax_lr.plot(tok, [r["lr"] for r in train], color="gray", lw=1)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("tokens seen (millions)")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    out = run / "loss.png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
