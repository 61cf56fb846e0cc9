#!/usr/bin/env python3
"""Compares two `specdec bench --json` runs prompt by prompt.

    python3 scripts/compare_bench.py BASE.json NEW.json [--mode hybrid]

A prompt's speedup is its mode's decode tokens/s over `ar`'s in the same run, so each run is
measured against its own plain decoding. For every category (and `all`) the script prints the
geometric mean of NEW's speedup over BASE's across the prompts both runs measured, and how many
of them NEW ran faster. On a noisy shared machine this pairing says more than the two runs'
medians side by side: a prompt's speedup moves less between runs than the tokens/s of either
mode, and the median of one run can jump between prompts.
"""

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict


def speedups(path, mode):
    """{prompt id: (category, speedup over ar)} for `mode` in the bench JSON at `path`.

    With `bench --repeat N` a prompt's runs carry their repetition (`repeat`): each run is measured
    against the plain run of its own repetition, and the prompt's speedup is the median of them.
    """
    with open(path, encoding="utf-8") as f:
        run = json.load(f)
    ar, other = {}, defaultdict(list)
    for record in run["records"]:
        key = (record["id"], record.get("repeat", 0))
        rate = record["decode_tokens_per_s"]
        if record["mode"] == "ar":
            ar[key] = rate
        elif record["mode"] == mode:
            other[record["id"]].append((record["category"], key, rate))
    result = {}
    for pid, runs in other.items():
        ratios = [rate / ar[key] for _, key, rate in runs if ar.get(key, 0) > 0]
        if ratios:
            result[pid] = (runs[0][0], statistics.median(ratios))
    return result


def compare(base, new):
    """[(category, prompts, geometric mean of new / base, prompts faster in new)], `all` first."""
    logs = defaultdict(list)
    for pid, (category, before) in base.items():
        if pid not in new or before <= 0 or new[pid][1] <= 0:
            continue
        ratio = math.log(new[pid][1] / before)
        logs[category].append(ratio)
        logs["all"].append(ratio)
    rows = []
    for category in ["all"] + sorted(c for c in logs if c != "all"):
        if category not in logs:
            continue
        values = logs[category]
        rows.append(
            (
                category,
                len(values),
                math.exp(sum(values) / len(values)),
                sum(1 for v in values if v > 0),
            )
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("new")
    parser.add_argument("--mode", default="hybrid", help="the mode to compare (default: hybrid)")
    args = parser.parse_args(argv)
    base = speedups(args.base, args.mode)
    new = speedups(args.new, args.mode)
    rows = compare(base, new)
    if not rows:
        print(f"no prompt has mode {args.mode!r} and ar in both runs", file=sys.stderr)
        return 1
    print(f"{'category':10} {'prompts':>7} {'new/base':>9} {'faster':>7}")
    for category, n, ratio, faster in rows:
        print(f"{category:10} {n:7d} {ratio:8.3f}x {faster:4d}/{n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
