"""Each set's rate in every round of a `lab --compare-fused -v` run, from its log (stderr):
the spread that a median hides, and how often each set led its round. Rounds after the first
(the first compiles kernels and warms caches) count.

    python3 compare_rounds.py bench.err
"""
import re
import statistics
import sys

LINE = re.compile(r"compare-fused: ([0-9.]+) tok/s round=([0-9]+) set=(.*)$")


def main():
    rounds = {}
    for line in open(sys.argv[1], errors="replace"):
        m = LINE.search(line.strip())
        if m and int(m.group(2)) > 0:
            rate, rnd, name = float(m.group(1)), int(m.group(2)), m.group(3)
            rounds.setdefault(name, {})[rnd] = rate
    if not rounds:
        print("no compare-fused rounds in", sys.argv[1])
        return
    numbers = sorted({r for per in rounds.values() for r in per})
    leads = {name: 0 for name in rounds}
    for r in numbers:
        here = {name: per[r] for name, per in rounds.items() if r in per}
        leads[max(here, key=here.get)] += 1
    print("| set | median tok/s | min | max | rounds led | every round |")
    print("|---|---|---|---|---|---|")
    for name, per in rounds.items():
        rates = [per[r] for r in sorted(per)]
        print(f"| {name} | {statistics.median(rates):.1f} | {min(rates):.1f} | {max(rates):.1f} | "
              f"{leads[name]} | {' '.join(f'{x:.0f}' for x in rates)} |")


if __name__ == "__main__":
    main()
