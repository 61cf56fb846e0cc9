#!/usr/bin/env python3
"""llama.cpp's speculative decoding on specdec's benchmark prompts, for a same-session comparison.

Runs, per prompt, llama.cpp's plain decoding (llama-completion), its draft-model speculation
(llama-speculative-simple) and its prompt lookup (llama-lookup), greedy, 2 threads, 128 new tokens,
and prints per category the median tokens/s and the median per-prompt speedup over llama.cpp's own
plain decoding, plus acceptance.

  python3 scripts/llama_spec.py --bin "$(../shared/peer/build-llama.sh)" --limit 2 [--draft-max 4]

Chat prompts get Qwen2.5's ChatML with its default system message (what specdec's template gives);
HumanEval prompts are raw text, as in `specdec bench`.
"""
import argparse
import gzip
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
HOME = pathlib.Path(os.environ.get("SPECDEC_HOME", pathlib.Path.home() / ".cache" / "specdec"))
SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def prompts(limit):
    rows = []
    he = HOME / "data" / "HumanEval.jsonl.gz"
    if he.exists():
        with gzip.open(he, "rt") as f:
            for line in list(f)[:20]:
                t = json.loads(line)
                rows.append({"id": t["task_id"], "category": "humaneval", "chat": False, "prompt": t["prompt"]})
    else:
        print(f"note: {he} missing (run `specdec bench` once); HumanEval skipped", file=sys.stderr)
    for name in ["grounded.jsonl", "chat.jsonl"]:
        for line in open(ROOT / "bench" / name):
            rows.append(json.loads(line))
    seen, out = {}, []
    for r in rows:
        seen[r["category"]] = seen.get(r["category"], 0) + 1
        if seen[r["category"]] <= limit:
            out.append(r)
    return out


def text_of(r):
    if not r["chat"]:
        return r["prompt"]
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{r['prompt']}<|im_end|>\n"
            "<|im_start|>assistant\n")


def run(cmd, env):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    return p.stdout + p.stderr


def num(pattern, text, default=None):
    m = re.search(pattern, text)
    return float(m.group(1)) if m else default


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--draft-max", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json")
    a = ap.parse_args()
    models = HOME / "models"
    target = models / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    draft = models / "qwen2.5-coder-0.5b-instruct.gguf"
    env = dict(os.environ, LD_LIBRARY_PATH=a.bin)
    b = pathlib.Path(a.bin)
    common = ["-t", "2", "-n", str(a.tokens), "--temp", "0", "-c", "4096", "--seed", "1"]
    recs = []
    for r in prompts(a.limit):
        pf = pathlib.Path("/tmp/llama_spec_prompt.txt")
        pf.write_text(text_of(r))
        plain = run([str(b / "llama-completion"), "-m", str(target), "-f", str(pf), "-no-cnv",
                     "--no-display-prompt"] + common, env)
        plain_tps = num(r"eval time =.*?([\d.]+) tokens per second\)", re.sub(r"prompt eval time.*\n", "", plain))
        spec = run([str(b / "llama-speculative-simple"), "-m", str(target), "-md", str(draft), "-f", str(pf),
                    "--spec-type", "draft-simple", "--spec-draft-n-max", str(a.draft_max)] + common, env)
        spec_tps = num(r"decoded .*speed:\s*([\d.]+) t/s", spec)
        spec_acc = num(r"accept\s*=\s*([\d.]+)%", spec)
        look = run([str(b / "llama-lookup"), "-m", str(target), "-f", str(pf),
                    "--spec-draft-n-max", str(a.draft_max)] + common, env)
        look_tps = num(r"decoded .*speed:\s*([\d.]+) t/s", look)
        look_acc = None
        nd, na = num(r"n_drafted\s*=\s*(\d+)", look), num(r"n_accept\s*=\s*(\d+)", look)
        if nd:
            look_acc = 100.0 * (na or 0) / nd
        rec = {"id": r["id"], "category": r["category"], "plain_tps": plain_tps, "spec_tps": spec_tps,
               "spec_accept": spec_acc, "lookup_tps": look_tps, "lookup_accept": look_acc}
        if plain_tps is None or spec_tps is None or look_tps is None:
            rec["log_tail"] = {"plain": plain[-800:], "spec": spec[-800:], "lookup": look[-800:]}
        recs.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "log_tail"}), file=sys.stderr)
    cats = sorted({r["category"] for r in recs}) + ["all"]
    print(f"{'category':<10} {'prompts':>7} {'plain tok/s':>11} {'spec tok/s':>10} {'spec x':>7} {'accept':>7}"
          f" {'lookup tok/s':>12} {'lookup x':>8} {'accept':>7}")
    for c in cats:
        rs = [r for r in recs if c == "all" or r["category"] == c]
        rs = [r for r in rs if r["plain_tps"] and r["spec_tps"] and r["lookup_tps"]]
        if not rs:
            continue
        med = lambda k: statistics.median(r[k] for r in rs)
        sx = statistics.median(r["spec_tps"] / r["plain_tps"] for r in rs)
        lx = statistics.median(r["lookup_tps"] / r["plain_tps"] for r in rs)
        acc = lambda k: statistics.median([r[k] for r in rs if r[k] is not None] or [float("nan")])
        print(f"{c:<10} {len(rs):>7} {med('plain_tps'):>11.2f} {med('spec_tps'):>10.2f} {sx:>6.2f}x"
              f" {acc('spec_accept'):>6.1f}% {med('lookup_tps'):>12.2f} {lx:>7.2f}x {acc('lookup_accept'):>6.1f}%")
    if a.json:
        json.dump(recs, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
