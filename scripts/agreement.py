#!/usr/bin/env python3
"""Agreement of specdec's logits with an independent implementation.

The reference is a plain numpy forward pass of the Qwen2 / Llama architecture over weights dequantised
by the `gguf` Python package (llama.cpp's own reader and dequantisers), written from the architecture,
not from specdec's code. Both sides score the same tokens; the script reports top-1 agreement and the
mean absolute difference of log-probabilities, and exits non-zero below the thresholds.

    python3 scripts/agreement.py MODEL.gguf [--min-top1 0.99] [--max-dlogp 1e-4] [--text FILE]

Rope follows llama.cpp's `rope_ext`: the angle of position p, pair i is
p * freq_scale * base^(-2i/rope_dim) / rope_freqs[i], where freq_scale = 1 / `rope.scaling.factor` (or the
older `rope.scale_linear`) for linear scaling (the default type; `none` ignores the factor) and
`rope_freqs.weight` (Llama 3.1+) holds per-pair factors. Head sizes come from `attention.key_length`.
Any other scaling type is refused, as specdec refuses it.

`--max-dlogp` bounds the mean |dlogp| over the vocabulary: with an F32 model (no quantised activations
on either side) the two should agree to float rounding, so a small bound checks rope, scaling and head
sizes tightly, not just the argmax.

Needs `pip install numpy gguf` and a release build of the `dump_logits` example
(`cargo build --release -p specdec-runtime --example dump_logits`).
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

TEXT = '''import heapq
from collections import defaultdict


def dijkstra(graph, source):
    """Shortest distances from source in a graph given as {node: [(neighbour, weight), ...]}."""
    dist = defaultdict(lambda: float("inf"))
    dist[source] = 0
    queue = [(0, source)]
    while queue:
        d, node = heapq.heappop(queue)
        if d > dist[node]:
            continue
        for neighbour, weight in graph.get(node, []):
            candidate = d + weight
            if candidate < dist[neighbour]:
                dist[neighbour] = candidate
                heapq.heappush(queue, (candidate, neighbour))
    return dict(dist)


class LRUCache:
    """A least-recently-used cache with O(1) get and put."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items = {}
        self.order = []

    def get(self, key):
        if key not in self.items:
            return None
        self.order.remove(key)
        self.order.append(key)
        return self.items[key]

    def put(self, key, value):
        if key in self.items:
            self.order.remove(key)
        elif len(self.items) >= self.capacity:
            oldest = self.order.pop(0)
            del self.items[oldest]
        self.items[key] = value
        self.order.append(key)


if __name__ == "__main__":
    graph = {"a": [("b", 1), ("c", 4)], "b": [("c", 2), ("d", 5)], "c": [("d", 1)]}
    print(dijkstra(graph, "a"))
'''


def field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def tensor(reader, name):
    for t in reader.tensors:
        if t.name == name:
            w = dequantize(t.data, t.tensor_type).astype(np.float32)
            shape = [int(d) for d in reversed(t.shape)]
            return w.reshape(shape)
    return None


def rope_inv_freq(theta, dim, freq_scale, factors):
    """Frequency of each dimension pair: freq_scale * theta^(-2i/dim) / factors[i] (llama.cpp)."""
    inv = freq_scale * theta ** (-np.arange(0, dim // 2, dtype=np.float64) * 2.0 / dim)
    if factors is not None:
        assert factors.shape == (dim // 2,), f"rope_freqs.weight has shape {factors.shape}, expected {(dim // 2,)}"
        inv = inv / factors.astype(np.float64)
    return inv


def rope(x, pos, inv, neox):
    # x: [T, H, D]; rotates the first 2 * len(inv) dimensions of each head.
    half = len(inv)
    dim = 2 * half
    ang = np.outer(pos.astype(np.float64), inv)  # [T, half]
    cos = np.cos(ang)[:, None, :].astype(np.float32)
    sin = np.sin(ang)[:, None, :].astype(np.float32)
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:dim]
    else:
        a, b = x[..., 0:dim:2], x[..., 1:dim:2]
    ra = a * cos - b * sin
    rb = a * sin + b * cos
    if neox:
        out[..., :half], out[..., half:dim] = ra, rb
    else:
        out[..., 0:dim:2], out[..., 1:dim:2] = ra, rb
    return out


def rms(x, w, eps):
    return x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps).astype(np.float32) * w


def reference_logits(path, ids):
    r = GGUFReader(path)
    arch = field(r, "general.architecture")
    get = lambda k, d=None: field(r, f"{arch}.{k}", d)
    n_layer, n_head = int(get("block_count")), int(get("attention.head_count"))
    n_kv = int(get("attention.head_count_kv", n_head))
    eps, theta = float(get("attention.layer_norm_rms_epsilon")), float(get("rope.freq_base", 10000.0))
    emb = tensor(r, "token_embd.weight")
    d = emb.shape[1]
    hd = int(get("attention.key_length", d // n_head))
    if int(get("attention.value_length", hd)) != hd:
        sys.exit("attention.value_length != attention.key_length is not implemented here either")
    rope_dim = int(get("rope.dimension_count", hd))
    # llama.cpp: the factor from rope.scaling.factor, else rope.scale_linear; type linear by default.
    factor = float(get("rope.scaling.factor", get("rope.scale_linear", 0.0)))
    kind = get("rope.scaling.type", "linear")
    if kind not in ("linear", "none"):
        sys.exit(f"rope scaling type {kind!r} is not implemented here either")
    freq_scale = 1.0 / factor if kind == "linear" and factor != 0.0 else 1.0
    inv = rope_inv_freq(theta, rope_dim, freq_scale, tensor(r, "rope_freqs.weight"))
    print(f"  head size {hd}, rope dims {rope_dim}, scaling {kind} freq_scale {freq_scale}, "
          f"rope_freqs {'yes' if tensor(r, 'rope_freqs.weight') is not None else 'no'}", file=sys.stderr)
    neox = arch == "qwen2"
    x = emb[np.array(ids)]
    T = len(ids)
    pos = np.arange(T)
    mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
    for i in range(n_layer):
        p = lambda s: tensor(r, f"blk.{i}.{s}")
        h = rms(x, p("attn_norm.weight"), eps)
        q, k, v = h @ p("attn_q.weight").T, h @ p("attn_k.weight").T, h @ p("attn_v.weight").T
        if arch == "qwen2":
            q, k, v = q + p("attn_q.bias"), k + p("attn_k.bias"), v + p("attn_v.bias")
        q = rope(q.reshape(T, n_head, hd), pos, inv, neox)
        k = rope(k.reshape(T, n_kv, hd), pos, inv, neox)
        v = v.reshape(T, n_kv, hd)
        # specdec's KV cache holds f16 (rounded to nearest, ties to even, as numpy's astype does).
        k = k.astype(np.float16).astype(np.float32)
        v = v.astype(np.float16).astype(np.float32)
        rep = n_head // n_kv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = np.einsum("hts,shd->thd", s, v).reshape(T, n_head * hd)
        x = x + a @ p("attn_output.weight").T
        h = rms(x, p("ffn_norm.weight"), eps)
        g, u = h @ p("ffn_gate.weight").T, h @ p("ffn_up.weight").T
        x = x + ((g / (1 + np.exp(-g))) * u) @ p("ffn_down.weight").T
        print(f"  layer {i + 1}/{n_layer}", end="\r", file=sys.stderr)
    out = tensor(r, "output.weight")
    if out is None:
        out = emb
    return rms(x, tensor(r, "output_norm.weight"), eps) @ out.T


def log_softmax(z):
    z = z.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--text")
    ap.add_argument("--min-top1", type=float, default=0.99)
    ap.add_argument("--max-dlogp", type=float, default=None,
                    help="fail if the mean |dlogp| over the vocabulary exceeds this")
    ap.add_argument("--bin", default="target/release/examples/dump_logits")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        text = args.text or os.path.join(tmp, "text.txt")
        if not args.text:
            open(text, "w").write(TEXT)
        prefix = os.path.join(tmp, "ours")
        subprocess.run([args.bin, args.model, text, prefix], check=True)
        ids = [int(t) for t in open(prefix + ".tokens").read().split()]
        ours = np.fromfile(prefix + ".f32", dtype="<f4").reshape(len(ids), -1)
    print(f"{args.model}: {len(ids)} positions", file=sys.stderr)
    ref = reference_logits(args.model, ids)
    lo, lr = log_softmax(ours), log_softmax(ref)
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).mean())
    at_ref_top = np.abs(lo - lr)[np.arange(len(ids)), ref.argmax(-1)].mean()
    full = float(np.abs(lo - lr).mean())
    # Agreement on the next token the text actually has (the model's loss), another sanity check.
    nll_o = -lo[np.arange(len(ids) - 1), ids[1:]].mean()
    nll_r = -lr[np.arange(len(ids) - 1), ids[1:]].mean()
    print(f"positions {len(ids)}  top-1 agreement {top1:.4f}  "
          f"mean |dlogp| at the reference's top token {at_ref_top:.4g}  over the vocabulary {full:.4g}  "
          f"text NLL ours {nll_o:.4f} reference {nll_r:.4f}")
    if len(ids) < 200:
        sys.exit(f"only {len(ids)} positions; need at least 200")
    if top1 < args.min_top1:
        sys.exit(f"top-1 agreement {top1:.4f} is below {args.min_top1}")
    if args.max_dlogp is not None and not full <= args.max_dlogp:
        sys.exit(f"mean |dlogp| over the vocabulary {full:.3g} is above {args.max_dlogp}")


if __name__ == "__main__":
    main()
