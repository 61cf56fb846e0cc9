#!/usr/bin/env python3
"""Offline estimate of token-tree verification for prompt lookup, from a `specdec bench --json` run.

For every prompt, the plain (`ar`) run's prompt and output tokens are replayed round by round: the
longest suffix of the committed tokens (2..12 tokens) that occurred earlier gives the continuations
that followed its occurrences, grouped by their first token and ranked by count (the newest first
among equals). A chain drafts the best one; a tree drafts the best `--branches` together. Each round
costs the calibration's r(m) of every drafted row plus one, and emits the longest accepted prefix
plus one; a round without a match is a plain step. Prints the median speedup per category for both.

    python3 scripts/lookup_tree_sim.py BENCH.json [--len 8] [--branches 2]
"""

import argparse
import json
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json")
    ap.add_argument("--len", type=int, default=8, help="tokens per branch")
    ap.add_argument("--branches", type=int, default=2, help="branches of the tree")
    args = ap.parse_args()
    d = json.load(open(args.bench_json))
    r = d["calibration"]["r"]

    def cost(m: int) -> float:
        return r[m - 1] if m <= len(r) else r[-1] + (m - len(r)) * (r[-1] - r[-2])

    def candidates(ctx: list) -> list:
        n_ctx = len(ctx)
        for n in range(12, 1, -1):
            if n_ctx <= n:
                continue
            suffix = ctx[-n:]
            found = [j for j in range(n_ctx - n) if ctx[j : j + n] == suffix]
            if not found:
                continue
            groups: dict = {}
            for j in reversed(found):
                cont = ctx[j + n : j + n + args.len]
                if cont:
                    groups.setdefault(cont[0], []).append(cont)
            ranked = sorted(groups.values(), key=lambda g: -len(g))
            return [g[0] for g in ranked]
        return []

    def accepted(draft: list, truth: list) -> int:
        n = 0
        for a, b in zip(draft, truth):
            if a != b:
                break
            n += 1
        return n

    speed: dict = {}
    for rec in d["records"]:
        if rec["mode"] != "ar" or not rec.get("output_tokens"):
            continue
        prompt, out = rec["prompt_tokens"], rec["output_tokens"]
        for kind, width in (("chain", 1), ("tree", args.branches)):
            i, time = 0, 0.0
            while i < len(out):
                drafts = candidates(prompt + out[:i])[:width]
                if not drafts:
                    time, i = time + 1.0, i + 1
                    continue
                rows = sum(len(c) for c in drafts)
                time += cost(rows + 1)
                i += max(accepted(c, out[i:]) for c in drafts) + 1
            speed.setdefault((rec["category"], kind), []).append(len(out) / time)
    for cat in sorted({c for c, _ in speed}):
        chain = statistics.median(speed[(cat, "chain")])
        tree = statistics.median(speed[(cat, "tree")])
        print(f"{cat:<10} chain {chain:.2f}x  tree of {args.branches} {tree:.2f}x")


if __name__ == "__main__":
    main()
