"""Where a pipelined decode step's device time goes, from an Nsight Systems kernel trace
(`nsys stats --report cuda_gpu_trace --format csv` of an mlx-spec `generate` run profiled
with `--cuda-graph-trace=node`). Unlike Nsight Compute, Nsight Systems neither serialises
kernels nor flushes caches: the durations are those of a normal run, and the gaps between
kernels show how long the device waited for the host.

A step is the span from the end of one greedy pick (an arg-reduce kernel) to the end of the
next. Everything up to the second pick is skipped (warm-up); the steps after it are averaged.

Prints the step's span on the device (and the rate it makes), the time its kernels ran, the
idle time between them, then a markdown table by kernel kind, slowest first.

    python3 timeline_step.py trace.csv [label]
"""
import csv
import sys
from collections import defaultdict

from profile_step import kind  # the same short kernel names as the Nsight Compute tables


def column(header, prefix):
    for name in header:
        if name.strip().startswith(prefix):
            return name
    sys.exit(f"no column starting with {prefix!r} in {header}")


def main():
    path = sys.argv[1]
    label = sys.argv[2] if len(sys.argv) > 2 else path
    with open(path, newline="") as f:
        lines = [line for line in f if line.strip()]
    # nsys prints notes before the table; the table starts at the header line.
    start = next((i for i, line in enumerate(lines) if "Duration" in line and "Name" in line), None)
    if start is None:
        sys.exit(f"{label}: no kernel trace table in {path}")
    rows = list(csv.DictReader(lines[start:]))
    header = rows[0].keys() if rows else []
    begin_col, length_col, name_col = column(header, "Start"), column(header, "Duration"), column(header, "Name")
    kernels = []
    for row in rows:
        name = row[name_col]
        if name.startswith("["):  # copies and memsets
            continue
        begin = float(row[begin_col].replace(",", ""))
        kernels.append((begin, float(row[length_col].replace(",", "")), name))
    kernels.sort()
    picks = [i for i, k in enumerate(kernels) if "arg_reduce" in k[2].lower()]
    if len(picks) < 4:
        sys.exit(f"{label}: fewer than four arg-reduce kernels among {len(kernels)}: too few steps")
    spans, busy, counts = [], [], []
    by_kind = defaultdict(lambda: [0, 0.0])
    steps = list(zip(picks[1:-1], picks[2:]))
    for a, b in steps:
        step = kernels[a + 1 : b + 1]
        end_before = kernels[a][0] + kernels[a][1]
        end = kernels[b][0] + kernels[b][1]
        spans.append(end - end_before)
        busy.append(sum(k[1] for k in step))
        counts.append(len(step))
        for _, length, name in step:
            entry = by_kind[kind(name)]
            entry[0] += 1
            entry[1] += length
    n = len(steps)
    span_us = sum(spans) / n / 1e3
    busy_us = sum(busy) / n / 1e3
    print(f"## {label}: a pipelined decode step on the device (mean of {n} steps)")
    print(
        f"{sum(counts) / n:.0f} kernels; span {span_us:.0f} µs ({1e6 / span_us:.1f} tok/s); kernels "
        f"running {busy_us:.0f} µs ({100 * busy_us / span_us:.1f} %); device idle between them "
        f"{span_us - busy_us:.0f} µs"
    )
    print("| kernel | calls a step | µs a step | µs each | share of the span |")
    print("|---|---|---|---|---|")
    for name, (calls, total) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
        per_step = total / n / 1e3
        print(
            f"| {name} | {calls / n:.0f} | {per_step:.0f} | {total / calls / 1e3:.1f} "
            f"| {100 * per_step / span_us:.1f} % |"
        )


if __name__ == "__main__":
    main()
