#!/usr/bin/env python3
"""Offline estimate of token-tree verification for the draft model's top-2, greedy.

Input: the JSONL of `examples/draft_predictions` (specdec-runtime), which holds, for every prompt
of a greedy `specdec bench --json` run, the target's answer and the draft model's two likeliest
tokens (`pred`, `pred2`) and their probabilities (`conf`, `conf2`) after the prompt and each
prefix of the answer; and that bench JSON, for its calibration (c and r(m)).

Each round starts where the last one ended. A *chain* drafts the draft's greedy walk while its
confidence is at least `th1`, at most `k` tokens. A *tree* drafts the same chain plus, at each chain
position whose second choice has probability at least `th2`, that second choice as a sibling,
extended by up to `ext` tokens of the draft's greedy walk after it. Greedy verification accepts the
longest path of the tree that the target's answer follows and adds the target's next token.

Costs, in target steps: `c` per draft pass, one per chain position drafted and one more where the
confidence stopped the chain (the sibling comes from the same pass; where a round extends
siblings, each of its passes costs `slope` more, as if the extensions' rows rode along in them),
plus r(nodes + 1) for the verification. That undercharges extensions that reach past the chain's
end and rounds extending several siblings, so it leans towards the tree. r(m) is the
calibration's, made non-decreasing (pool adjacent violators) unless `--raw`; `--flat S` prices
r(m) = 1 + S (m - 1) instead, to ask what flatter verification would change.

What the answer cannot tell: past a chain's first rejected position the draft's own walk leaves the
target's answer, so its confidence there is unknown; the answer's positions stand in for it. That
moves only the rounds' costs, never what they accept.

For every category it prints the best chain and the best tree over a grid of their parameters
(median over prompts of answer tokens per target step; the chains' grid holds plain decoding, k = 0,
and the trees' grid every chain without siblings, so a tree is never worse), and their ratio.

    python3 scripts/model_tree_sim.py PREDICTIONS.jsonl BENCH.json [--raw] [--flat S] [--slope S]
"""

import argparse
import json
import statistics
import sys
from collections import defaultdict


def non_decreasing(v: list) -> list:
    blocks = [[x, 1] for x in v]
    i = 0
    while i < len(blocks) - 1:
        if blocks[i][0] > blocks[i + 1][0]:
            (a, n), (b, m) = blocks[i], blocks[i + 1]
            blocks[i : i + 2] = [[(a * n + b * m) / (n + m), n + m]]
            i = max(i - 1, 0)
        else:
            i += 1
    return [x for x, n in blocks for _ in range(n)]


def rate(rec: dict, k: int, th1: float, th2: float, ext: int, *, c: float, r, slope: float):
    """Answer tokens per target step over `rec`'s answer (not empty) with draft length `k` (0:
    plain decoding), the chain's confidence stop `th1`, siblings from `th2` and `ext` tokens
    extending each.
    `r(m)` prices verifying m rows."""
    out, pred, pred2 = rec["output"], rec["pred"], rec["pred2"]
    conf, conf2 = rec["conf"], rec["conf2"]
    n = len(out)
    p, cost = 0, 0.0
    while p < n:
        depth = 0
        while depth < min(k, n - p) and conf[p + depth] >= th1:
            depth += 1
        # A chain stopped by its confidence paid for the draft pass that showed it.
        passes = depth + (depth < min(k, n - p))
        sibs = {d for d in range(1, depth + 1) if conf2[p + d - 1] >= th2}
        nodes = depth + len(sibs) * (1 + ext)
        cost += c * passes * (1 + (slope if sibs and ext else 0)) + r(nodes + 1)
        acc = 0
        for d in range(1, depth + 1):
            t = out[p + d - 1]
            if pred[p + d - 1] == t:
                acc = d
                continue
            if d in sibs and pred2[p + d - 1] == t:
                acc = d
                for j in range(p + d, min(p + d + ext, n)):
                    if pred[j] != out[j]:
                        break
                    acc += 1
            break
        p += acc + 1
    return n / cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("predictions")
    ap.add_argument("bench_json")
    ap.add_argument("--raw", action="store_true", help="the calibration's r(m) as it is")
    ap.add_argument("--flat", type=float, help="price r(m) = 1 + FLAT (m - 1)")
    ap.add_argument("--slope", type=float, default=0.05, help="a draft pass's cost per extra row")
    args = ap.parse_args()
    cal = json.load(open(args.bench_json))["calibration"]
    c = cal.get("c")
    if c is None:
        sys.exit(f"{args.bench_json}: the calibration has no draft cost c (no draft model?)")
    curve = cal["r"] if args.raw else non_decreasing(cal["r"])
    if args.flat is not None:
        curve = [1 + args.flat * i for i in range(16)]

    def r(m: int) -> float:
        if m <= len(curve):
            return curve[m - 1]
        return curve[-1] + (m - len(curve)) * (curve[-1] - curve[-4]) / 3

    # An empty answer has no rounds to replay.
    recs = [x for x in map(json.loads, open(args.predictions)) if x["output"]]
    cats = defaultdict(list)
    for rec in recs:
        cats[rec["category"]].append(rec)
    cats["all"] = recs
    print("r(m):", " ".join(f"{x:.2f}" for x in curve), f" c = {c:.3f}")
    print(f"{'category':10s} {'top1':>6s} {'top2|miss':>9s}   " + "best chain (k, th1)".ljust(21)
          + "best tree (k, th1, th2, ext)".ljust(31) + "gain")
    thresholds = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
    chains = [(0, 0.0)] + [(k, t1) for k in range(1, 11) for t1 in thresholds]
    for cat, group in cats.items():
        tot = sum(len(x["output"]) for x in group)
        top1 = sum(a == b for x in group for a, b in zip(x["pred"], x["output"]))
        top2 = sum(
            a != b and a2 == b
            for x in group
            for a, a2, b in zip(x["pred"], x["pred2"], x["output"])
        )

        def med(*params) -> float:
            return statistics.median(rate(x, *params, c=c, r=r, slope=args.slope) for x in group)

        chain = max((med(k, t1, 2.0, 0), k, t1) for k, t1 in chains)
        tree = max(
            (med(k, t1, t2, e), k, t1, t2, e)
            for k, t1 in chains
            for t2 in (0.05, 0.1, 0.15, 0.2, 0.3, 2.0)
            for e in (0, 1, 2)
        )
        print(
            f"{cat:10s} {top1 / tot:6.3f} {top2 / max(tot - top1, 1):9.3f}   "
            + f"{chain[0]:.3f} ({chain[1]}, {chain[2]})".ljust(21)
            + f"{tree[0]:.3f} ({tree[1]}, {tree[2]}, {tree[3]}, {tree[4]})".ljust(31)
            + f"{tree[0] / chain[0]:.3f}"
        )


if __name__ == "__main__":
    main()
