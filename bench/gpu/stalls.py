"""What the warps of our decode kernels wait on, from an Nsight Compute CSV export
(`ncu --csv --metrics regex:^smsp__average_warps_issue_stalled_...,gpu__time_duration.sum,...`
of an mlx-spec `generate` run, `run.sh stalls`).

Why: a kernel that runs well over the time its bytes need while reading DRAM below its peak
is waiting on something else (memory latency, a grid-wide barrier's spinning, the issue of
its own instructions). Nsight Compute's warp-state metrics say which: for each reason, the
warps stalled on it per instruction issued, averaged over the kernel.

Prints, for each kernel (one instantiation of its template arguments), the mean duration,
how busy the schedulers were, how many warps were resident, DRAM throughput, then the stall
reasons, largest first.

    python3 stalls.py stalls.csv [label]
"""
import csv
import re
import sys
from collections import defaultdict

from profile_step import TIME, number

STALL = re.compile(r"^smsp__average_warps_issue_stalled_(.*)_per_issue_active\.ratio$")
SUMMARY = {
    "gpu__time_duration.sum": "duration (µs)",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "schedulers issuing (%)",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "warps resident (% of peak)",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM throughput (% of peak)",
}

def kind(name):
    """A kernel's name without its signature: one instantiation (template arguments, which
    tell a sliding layer's kernel from a full one's) each."""
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"\(.*", "", name)
    name = re.sub(r"^mlx::core::cu::", "", name)
    name = re.sub(r"^custom_kernel_", "", name)
    return name[:90]


def main():
    path = sys.argv[1]
    label = sys.argv[2] if len(sys.argv) > 2 else path
    # kind -> metric -> values (one a launch)
    values = defaultdict(lambda: defaultdict(list))
    launches = defaultdict(set)
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    for row in csv.DictReader(lines):
        k = kind(row["Kernel Name"])
        launches[k].add(row["ID"])
        metric, unit = row["Metric Name"], row["Metric Unit"]
        try:
            value = number(row["Metric Value"])
        except ValueError:
            continue
        if metric == "gpu__time_duration.sum":
            value *= TIME.get(unit, 1.0)
        values[k][metric].append(value)
    if not values:
        sys.exit(f"{label}: no kernel in {path}")
    print(f"## {label}: what the warps wait on")
    for k, metrics in values.items():
        mean = {m: sum(v) / len(v) for m, v in metrics.items()}
        summary = ", ".join(f"{text} {mean[m]:.1f}" for m, text in SUMMARY.items() if m in mean)
        print(f"\n### {k} ({len(launches[k])} launches): {summary}\n")
        stalls = sorted(((STALL.match(m).group(1), v) for m, v in mean.items() if STALL.match(m)),
                        key=lambda s: -s[1])
        total = sum(v for _, v in stalls)
        print("| stall reason | warps stalled per issue | share |")
        print("|---|---|---|")
        for reason, v in stalls:
            if v >= 0.01:
                print(f"| {reason} | {v:.2f} | {100 * v / max(total, 1e-9):.0f} % |")


if __name__ == "__main__":
    main()
