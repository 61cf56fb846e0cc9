#!/usr/bin/env python3
"""How much could prompt lookup gain at this machine's verification costs? An offline replay.

Reads the JSON of `specdec bench --modes ar[,ngram,...] --json FILE` (its `ar` records carry the prompt
and output token ids, its calibration the measured r(m)) and replays greedy decoding of every prompt
with a plain longest-suffix lookup drafter (the newest of the longest earlier occurrences of the
context's end, its continuation running on into the draft), costing a round that verifies m tokens
r(m) target steps:

- `oracle`: each round drafts exactly the tokens the target will accept (none where the first is
  wrong). No drafter can know that; it bounds what any stopping rule over these drafts can reach.
- `best fixed`: the best policy "draft K tokens when the match is at least N long" (K, N searched
  over the whole set, so it is an in-sample optimum).
- `measured`: the bench's own per-prompt speedup of each other mode in the file.

Speedups are medians over prompts of (tokens / target steps), as the bench's `speedup` column is.
Usage: python3 scripts/lookup_ceiling.py BENCH.json [R1 R2 ... R16]
(the optional 16 numbers replace the file's r(m), e.g. with a `bench --cost-curve` of the same session).
"""

import json
import statistics
import sys
from collections import defaultdict

MAX_DRAFT = 15
MAX_MATCH = 32


def propose(ctx, max_len):
    """The continuation of the newest longest earlier match of ctx's suffix, and the match length."""
    n_ctx, last = len(ctx), ctx[-1]
    best, start = 0, None
    for i in range(n_ctx - 1, 0, -1):
        if ctx[i - 1] != last:
            continue
        n = 1
        while n < MAX_MATCH and n < i and ctx[i - 1 - n] == ctx[n_ctx - 1 - n]:
            n += 1
        if n > best:
            best, start = n, i
    if start is None:
        return [], 0
    full, out = list(ctx), []
    while len(out) < max_len:
        full.append(full[start + len(out)])
        out.append(full[-1])
    return out, best


def main():
    data = json.load(open(sys.argv[1]))
    r = data["calibration"]["r"]
    if len(sys.argv) > 2:
        try:
            r = [float(v) for v in sys.argv[2:]]
        except ValueError:
            sys.exit("r(m) must be numbers")
        if len(r) != 16:
            sys.exit("give r(m) for m = 1..16: 16 numbers")
    ar = [x for x in data["records"] if x["mode"] == "ar"]
    if not ar or "output_tokens" not in ar[0]:
        sys.exit("no token ids in this file: rerun `specdec bench ... --json FILE` (ar records carry them)")
    # Per prompt and position: how many drafted tokens the target would accept, and the match length.
    rows = {}
    for x in ar:
        prompt, output = x["prompt_tokens"], x["output_tokens"]
        per_pos = []
        for pos in range(len(output)):
            draft, n = propose(prompt + output[:pos], MAX_DRAFT)
            a = 0
            while a < len(draft) and pos + a < len(output) and draft[a] == output[pos + a]:
                a += 1
            per_pos.append((a, n))
        rows[x["id"]] = (x["category"], per_pos)

    def replay(policy):
        by_cat = defaultdict(list)
        for cat, per_pos in rows.values():
            pos, cost = 0, 0.0
            while pos < len(per_pos):
                a, n = per_pos[pos]
                k = policy(a, n)
                cost += r[k]  # r[k] is r(k + 1): k drafted tokens and the target's own
                pos += min(a, k) + 1
            by_cat[cat].append(len(per_pos) / cost if cost else 1.0)
        return by_cat

    results = {"oracle": replay(lambda a, n: a)}
    best = None
    for n0 in (1, 2, 3, 4, 6):
        for k in (1, 2, 3, 4, 6, 8):
            by_cat = replay(lambda a, n, n0=n0, k=k: k if n >= n0 else 0)
            score = statistics.median(s for v in by_cat.values() for s in v)
            if best is None or score > best[0]:
                best = (score, n0, k, by_cat)
    results[f"best fixed (K={best[2]} from N={best[1]})"] = best[3]
    for mode in sorted({x["mode"] for x in data["records"]} - {"ar"}):
        by_cat = defaultdict(list)
        for x in data["records"]:
            if x["mode"] == mode:
                by_cat[x["category"]].append(x["speedup_vs_ar"])
        results[f"measured {mode}"] = by_cat
    cats = sorted({c for c, _ in rows.values()})
    print("r(m) for m = 1..16: " + " ".join(f"{v:.2f}" for v in r))
    print(f"{'':32s}" + "".join(f"{c:>11s}" for c in cats + ["all"]))
    for name, by_cat in results.items():
        every = [s for v in by_cat.values() for s in v]
        cells = [statistics.median(by_cat[c]) if by_cat[c] else float("nan") for c in cats]
        print(f"{name:32s}" + "".join(f"{v:10.2f}x" for v in cells + [statistics.median(every)]))


if __name__ == "__main__":
    main()
