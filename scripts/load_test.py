#!/usr/bin/env python3
"""Load and concurrency tests for an OpenAI-compatible server (specdec serve, llama-server).

  load:         CLIENTS concurrent streaming clients send REQUESTS chat requests in all. A 429 is
                counted and the request retried after Retry-After, so none is lost. Every response
                must end with `data: [DONE]`, carry a finish_reason and usage; prints throughput and
                p50/p99 time to first token, time per output token and request latency.
  concurrency:  the same greedy requests one at a time, then CLIENTS at once: prints the aggregate
                tokens/s of both and their ratio, and checks that every concurrent answer equals its
                solo answer.
  shared:       requests over the same documents (bench/long.jsonl's ten, about 1,500 tokens), each
                with its own question: one answering at length (--first-max-tokens), then, once its
                first token is out, CLIENTS - 1 more at once (--max-tokens; 2 to 10 requests in
                all, one per question). Prints each request's time to first token and latency:
                what a server that copies a running request's prefix saves the later ones. With
                --together all of them are sent at once (each with --max-tokens): what a server
                that computes their shared prefix once saves them.

--prompts FILE.jsonl replaces the built-in chat prompts of load and concurrency with the "prompt"
fields of a `specdec bench` prompt file (e.g. bench/grounded.jsonl), optionally only those whose
category is --category, in file order.

Exit status 1 if a response is lost or malformed, if --expect-429 saw no 429, or (concurrency) if an
answer differs. Needs httpx (installed with the openai package).
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import httpx

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash map is in two sentences.",
    "Write a bash one-liner that counts the lines of all .py files in a directory.",
    "Translate to French: The weather is nice today and we are going to the park.",
    "Summarise in one sentence: Rust is a systems programming language focused on safety, speed and concurrency.",
    "Write a SQL query that returns the ten most recent orders with their customer names.",
    "What is the difference between a list and a tuple in Python?",
    "Refactor this to use a list comprehension: result = []\nfor x in xs:\n    if x > 0:\n        result.append(x * 2)",
]


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def one(client, args, prompt, stats, first_token=None):
    """One streaming request, retried after 429. Returns (text, completion_tokens) or raises; sets
    the event `first_token` (if given) when the first piece of text arrives."""
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **args.extra,
    }
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    while True:
        t0 = time.perf_counter()
        async with client.stream("POST", args.base + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code == 429:
                stats["rejected_429"] += 1
                await r.aread()
                await asyncio.sleep(min(float(r.headers.get("retry-after", "1")), 1.0))
                continue
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            text, first, finish, usage, done, chunks = "", None, None, None, False, 0
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue
                if done:
                    raise RuntimeError("data after [DONE]")
                j = json.loads(data)
                if "error" in j:
                    raise RuntimeError(f"error event: {j['error']}")
                if j.get("usage"):
                    usage = j["usage"]
                for ch in j.get("choices", []):
                    piece = (ch.get("delta") or {}).get("content") or ""
                    if piece:
                        chunks += 1
                        if first is None:
                            first = time.perf_counter()
                            if first_token is not None:
                                first_token.set()
                        text += piece
                    finish = ch.get("finish_reason") or finish
            t1 = time.perf_counter()
        if not done or finish is None:
            raise RuntimeError(f"incomplete stream: done={done} finish={finish}")
        n = usage["completion_tokens"] if usage else chunks
        if usage is None and args.require_usage:
            raise RuntimeError("no usage chunk")
        if first is not None:
            stats["ttft"].append(first - t0)
            if n > 1:
                stats["tpot"].append((t1 - first) / (n - 1))
        stats["latency"].append(t1 - t0)
        stats["tokens"] += n
        return text, n


async def load(args):
    stats = {"ttft": [], "tpot": [], "latency": [], "tokens": 0, "rejected_429": 0, "ok": 0, "failed": []}
    todo = list(range(args.requests))
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        async def worker():
            while todo:
                i = todo.pop()
                try:
                    await one(client, args, PROMPTS[i % len(PROMPTS)], stats)
                    stats["ok"] += 1
                except Exception as e:  # noqa: BLE001 - every failure is reported
                    stats["failed"].append(f"request {i}: {e}")
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.clients)))
        wall = time.perf_counter() - t0
    report = {
        "clients": args.clients,
        "requests": args.requests,
        "ok": stats["ok"],
        "failed": len(stats["failed"]),
        "rejected_429_then_retried": stats["rejected_429"],
        "completion_tokens": stats["tokens"],
        "wall_s": round(wall, 2),
        "throughput_tok_s": round(stats["tokens"] / wall, 2),
        "requests_per_s": round(stats["ok"] / wall, 3),
        "ttft_p50_s": round(pct(stats["ttft"], 50), 3),
        "ttft_p99_s": round(pct(stats["ttft"], 99), 3),
        "tpot_p50_ms": round(1000 * pct(stats["tpot"], 50), 1),
        "tpot_p99_ms": round(1000 * pct(stats["tpot"], 99), 1),
        "latency_p50_s": round(pct(stats["latency"], 50), 2),
        "latency_p99_s": round(pct(stats["latency"], 99), 2),
    }
    print(json.dumps(report, indent=1))
    for f in stats["failed"][:10]:
        print("FAILED", f, file=sys.stderr)
    bad = bool(stats["failed"]) or stats["ok"] != args.requests
    if args.expect_429 and stats["rejected_429"] == 0:
        print("FAILED: expected some 429 answers under this load, saw none", file=sys.stderr)
        bad = True
    return 1 if bad else 0


async def concurrency(args):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.clients)]
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout)) as client:
        # Warm up.
        s = {"ttft": [], "tpot": [], "latency": [], "tokens": 0, "rejected_429": 0}
        await one(client, args, "Hello", s)
        solo_stats = {"ttft": [], "tpot": [], "latency": [], "tokens": 0, "rejected_429": 0}
        solo = []
        t0 = time.perf_counter()
        for p in prompts:
            solo.append(await one(client, args, p, solo_stats))
        solo_wall = time.perf_counter() - t0
        con_stats = {"ttft": [], "tpot": [], "latency": [], "tokens": 0, "rejected_429": 0}
        t0 = time.perf_counter()
        together = await asyncio.gather(*(one(client, args, p, con_stats) for p in prompts))
        con_wall = time.perf_counter() - t0
    same = [a[0] == b[0] for a, b in zip(solo, together)]
    report = {
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "solo_tokens": solo_stats["tokens"],
        "solo_wall_s": round(solo_wall, 2),
        "solo_tok_s": round(solo_stats["tokens"] / solo_wall, 2),
        "concurrent_tokens": con_stats["tokens"],
        "concurrent_wall_s": round(con_wall, 2),
        "concurrent_tok_s": round(con_stats["tokens"] / con_wall, 2),
        "aggregate_speedup": round((con_stats["tokens"] / con_wall) / (solo_stats["tokens"] / solo_wall), 2),
        "identical_to_solo": f"{sum(same)}/{len(same)}",
    }
    print(json.dumps(report, indent=1))
    return 0 if all(same) else 1


async def shared(args):
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(here, "bench", "long.jsonl")) as f:
        raw = [json.loads(line)["prompt"] for line in f]
    docs = raw[0][: raw[0].rindex("Question:")]
    prompts = [docs + p[p.rindex("Question:"):] for p in raw][: max(args.clients, 2)]
    stats = [{"ttft": [], "tpot": [], "latency": [], "tokens": 0, "rejected_429": 0} for _ in prompts]
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout)) as client:
        if args.together:
            answers = await asyncio.gather(*(one(client, args, p, s) for p, s in zip(prompts, stats)))
            return shared_report(stats, answers)
        first_args = argparse.Namespace(**{**vars(args), "max_tokens": args.first_max_tokens})
        started = asyncio.Event()
        first = asyncio.create_task(one(client, first_args, prompts[0], stats[0], started))
        waiting = asyncio.create_task(started.wait())
        await asyncio.wait([first, waiting], return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        rest = await asyncio.gather(*(one(client, args, p, s) for p, s in zip(prompts[1:], stats[1:])))
        answers = [await first] + rest
    return shared_report(stats, answers)


def shared_report(stats, answers):
    report = [
        {"request": i, "ttft_s": round(s["ttft"][0], 2), "latency_s": round(s["latency"][0], 2),
         "tokens": n, "answer": text[:60]}
        for i, (s, (text, n)) in enumerate(zip(stats, answers))
    ]
    print(json.dumps(report, indent=1))
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["load", "concurrency", "shared"])
    ap.add_argument("--base", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default="specdec")
    ap.add_argument("--api-key")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--first-max-tokens", type=int, default=400, help="shared: the first request's max_tokens")
    ap.add_argument("--together", action="store_true", help="shared: send every request at once")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--extra", type=json.loads, default={},
                    help='JSON object merged into every request, e.g. \'{"drafter": "none"}\'')
    ap.add_argument("--prompts", help="load, concurrency: a JSONL prompt file in place of the chat prompts")
    ap.add_argument("--category", help="with --prompts: only this category's prompts")
    ap.add_argument("--expect-429", action="store_true", help="fail unless some request was answered 429")
    ap.add_argument("--require-usage", action="store_true", help="fail when a stream has no usage chunk")
    args = ap.parse_args()
    if args.prompts:
        with open(args.prompts) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        PROMPTS[:] = [r["prompt"] for r in rows if args.category in (None, r.get("category"))]
        if not PROMPTS:
            sys.exit(f"no prompts in {args.prompts}" + (f" of category {args.category}" if args.category else ""))
    run = {"load": load, "concurrency": concurrency, "shared": shared}[args.mode]
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
