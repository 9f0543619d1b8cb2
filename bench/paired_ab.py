#!/usr/bin/env python3
"""Paired A/B of two drafters (or two checkpoints of one) from two `mlx-spec bench --json`
runs over the same prompt set, target and settings, temperature 0: prompts are the pairing
unit. For each prompt, the acceptance length (1 + accepted tokens / drafted rounds) and the
speculative request's seconds; the mean paired difference of each with a 95 % interval
(t with n - 1 degrees of freedom), and the totals.

  mlx-spec bench --drafter X --drafter-set checkpoint=A --prompt-set P --json > a.json
  mlx-spec bench --drafter X --drafter-set checkpoint=B --prompt-set P --json > b.json
  python3 bench/paired_ab.py a.json b.json
"""

import json
import math
import sys

# Two-sided 95 % quantiles of Student's t, by degrees of freedom (larger: normal).
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
       10: 2.23, 12: 2.18, 15: 2.13, 19: 2.09, 20: 2.09, 25: 2.06, 30: 2.04, 40: 2.02}


def t95(df):
    return T95.get(df) or next((v for k, v in sorted(T95.items()) if k >= df), 1.96)


def paired(xs, ys):
    d = [y - x for x, y in zip(xs, ys)]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1)) if n > 1 else 0.0
    return mean, t95(n - 1) * sd / math.sqrt(n) if n > 1 else float("inf")


def acceptance(p):
    return 1 + p["num_accepted_tokens"] / p["num_drafts"] if p["num_drafts"] else None


def main(a_path, b_path):
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    pa, pb = a["per_prompt"], b["per_prompt"]
    if len(pa) != len(pb):
        sys.exit("the two runs have different prompt counts: not the same prompt set")
    pairs = [(acceptance(x), acceptance(y)) for x, y in zip(pa, pb)]
    pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
    acc_d, acc_ci = paired([x for x, _ in pairs], [y for _, y in pairs])
    sec_d, sec_ci = paired([x["spec_seconds"] for x in pa], [y["spec_seconds"] for y in pb])
    mean_spec_a = sum(x["spec_seconds"] for x in pa) / len(pa)
    print(json.dumps({
        "prompts": len(pa), "prompts_drafted_in_both": len(pairs),
        "acceptance_length": [a["mean_acceptance_length"], b["mean_acceptance_length"]],
        "acceptance_change": b["mean_acceptance_length"] / a["mean_acceptance_length"] - 1,
        "paired_acceptance_difference": [acc_d, acc_ci],
        "target_forwards": [a["target_forwards"], b["target_forwards"]],
        "speedup": [a["speedup"], b["speedup"]],
        "drafter_us_per_forward": [a["drafter_us_per_forward"], b["drafter_us_per_forward"]],
        "paired_spec_seconds_change": [sec_d / mean_spec_a, sec_ci / mean_spec_a],
    }, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
