"""Device time of one decode step, kernel by kernel, from an Nsight Compute CSV export
(`ncu --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum ...` of an mlx-spec
`generate` run). The step is the run's last forward: the kernels after the second-to-last
arg-reduce (the greedy pick that ends each forward) up to the last one.

Prints the step's kernel count, device time if its kernels ran back to back, bytes read from
DRAM and the rate that makes, then a markdown table by kernel kind, slowest first. Nsight
Compute runs each kernel alone with caches flushed, so small kernels look slower than they
are inside a pipelined step; the large products are close to their real time.

    python3 profile_step.py profile.csv [label]
"""
import csv
import re
import sys
from collections import defaultdict

TIME = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
SIZE = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}


def number(text):
    return float(text.replace(",", ""))


def kind(name):
    """A short name for a kernel: the function without its template arguments or hashes."""
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    name = re.sub(r"_[0-9a-f]{8,}$", "", name)
    return name[:70]


def main():
    path = sys.argv[1]
    label = sys.argv[2] if len(sys.argv) > 2 else path
    kernels = {}
    order = []
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    for row in csv.DictReader(lines):
        kid = row["ID"]
        if kid not in kernels:
            kernels[kid] = {"name": row["Kernel Name"], "us": 0.0, "bytes": 0.0}
            order.append(kid)
        unit, value = row["Metric Unit"], row["Metric Value"]
        if row["Metric Name"] == "gpu__time_duration.sum":
            kernels[kid]["us"] = number(value) * TIME.get(unit, 1.0)
        elif row["Metric Name"] == "dram__bytes_read.sum":
            kernels[kid]["bytes"] = number(value) * SIZE.get(unit, 1.0)
    ends = [i for i, kid in enumerate(order) if "arg_reduce" in kernels[kid]["name"].lower()]
    if len(ends) < 2:
        sys.exit(f"{label}: fewer than two arg-reduce kernels among {len(order)}: no whole step")
    step = [kernels[kid] for kid in order[ends[-2] + 1 : ends[-1] + 1]]
    total_us = sum(k["us"] for k in step)
    total_bytes = sum(k["bytes"] for k in step)
    print(f"## {label}: one decode step on the device")
    print(
        f"{len(step)} kernels, {total_us:.0f} µs back to back, {total_bytes / 1e9:.2f} GB read "
        f"from DRAM, {total_bytes / total_us / 1e6:.2f} TB/s over the kernels' time"
    )
    by_kind = defaultdict(lambda: [0, 0.0, 0.0])
    for k in step:
        entry = by_kind[kind(k["name"])]
        entry[0] += 1
        entry[1] += k["us"]
        entry[2] += k["bytes"]
    print("| kernel | calls | µs | µs each | share | MB read | TB/s |")
    print("|---|---|---|---|---|---|---|")
    for name, (calls, us, read) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
        rate = read / us / 1e6 if us else 0.0
        print(
            f"| {name} | {calls} | {us:.0f} | {us / calls:.1f} | {100 * us / total_us:.1f} % "
            f"| {read / 1e6:.1f} "
            f"| {rate:.2f} |"
        )


if __name__ == "__main__":
    main()
