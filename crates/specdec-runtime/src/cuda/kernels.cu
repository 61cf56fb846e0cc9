// The forward pass's kernels, compiled by NVRTC when a model is loaded onto a GPU.
//
// invariant: every output element is one chain of operations in an order fixed by the model's shape
// alone (a row's position in its block, the block's size and the batch never enter it), so a block
// of drafted tokens scores exactly as the same tokens one by one, as on the CPU. Sums over a warp
// or a block are trees of a fixed shape; no atomics.

typedef unsigned short half_bits;

// IEEE half <-> float, by the instructions themselves (no header: NVRTC compiles this alone).
__device__ __forceinline__ float h2f(half_bits h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ half_bits f2h(float f) {
    half_bits h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

#define FULL 0xffffffffu
// Tokens per pass over a weight row: each lane keeps one sum per token.
#define TILE 8
// Threads of the row-wise kernels (norm, attention): a power of two.
#define BLOCK 256

// y[t, r] (= or +=) sum_k W[r, k] x[t, k] + bias[r] for the rows r of W listed in `rows` (all of
// 0..n when null), t in 0..m. W is f16 [rows, K] with K a multiple of 8; x is f32 with rows of
// `ldx` values (a multiple of 4); y has rows of `ldy` values. One warp per weight row: its lanes read 8 weights at a time, 256 apart,
// and keep a sum per token of the tile; the warp's sums meet in a butterfly of fixed shape.
extern "C" __global__ void matvec(const half_bits* __restrict__ w, const float* __restrict__ x,
                                  float* __restrict__ y, const float* __restrict__ bias,
                                  const int* __restrict__ rows, int n, int K, int m, int ldx,
                                  int ldy, int accumulate) {
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= n) return;
    int r = rows ? rows[warp] : warp;
    const half_bits* wr = w + (size_t)r * K;
    for (int t0 = 0; t0 < m; t0 += TILE) {
        int mt = min(TILE, m - t0);
        float acc[TILE];
#pragma unroll
        for (int i = 0; i < TILE; i++) acc[i] = 0.0f;
        for (int k = lane * 8; k < K; k += 256) {
            uint4 raw = *reinterpret_cast<const uint4*>(wr + k);
            const unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
            float wf[8];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                wf[2 * j] = h2f((half_bits)(words[j] & 0xffffu));
                wf[2 * j + 1] = h2f((half_bits)(words[j] >> 16));
            }
#pragma unroll
            for (int i = 0; i < TILE; i++) {
                if (i < mt) {
                    const float4* xr = reinterpret_cast<const float4*>(x + (size_t)(t0 + i) * ldx + k);
                    float4 a = xr[0];
                    float4 b = xr[1];
                    float s = acc[i];
                    s = __fmaf_rn(wf[0], a.x, s);
                    s = __fmaf_rn(wf[1], a.y, s);
                    s = __fmaf_rn(wf[2], a.z, s);
                    s = __fmaf_rn(wf[3], a.w, s);
                    s = __fmaf_rn(wf[4], b.x, s);
                    s = __fmaf_rn(wf[5], b.y, s);
                    s = __fmaf_rn(wf[6], b.z, s);
                    s = __fmaf_rn(wf[7], b.w, s);
                    acc[i] = s;
                }
            }
        }
#pragma unroll
        for (int i = 0; i < TILE; i++) {
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) acc[i] = __fadd_rn(acc[i], __shfl_xor_sync(FULL, acc[i], off));
        }
        if (lane == 0) {
            float b = bias ? bias[r] : 0.0f;
            for (int i = 0; i < mt; i++) {
                float v = __fadd_rn(acc[i], b);
                float* out = y + (size_t)(t0 + i) * ldy + r;
                *out = accumulate ? __fadd_rn(*out, v) : v;
            }
        }
    }
}

// A block's sum of one value per thread, as a tree of fixed shape; every thread gets it.
__device__ float block_sum(float v, float* shared) {
    int tid = threadIdx.x;
    shared[tid] = v;
    __syncthreads();
    for (int o = BLOCK / 2; o > 0; o >>= 1) {
        if (tid < o) shared[tid] = __fadd_rn(shared[tid], shared[tid + o]);
        __syncthreads();
    }
    float s = shared[0];
    __syncthreads();
    return s;
}

__device__ float block_max(float v, float* shared) {
    int tid = threadIdx.x;
    shared[tid] = v;
    __syncthreads();
    for (int o = BLOCK / 2; o > 0; o >>= 1) {
        if (tid < o) shared[tid] = fmaxf(shared[tid], shared[tid + o]);
        __syncthreads();
    }
    float s = shared[0];
    __syncthreads();
    return s;
}

// out[row] = x[row] / rms(x[row]) * w, one block of BLOCK threads per row of d values.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                    float* __restrict__ out, int d, float eps) {
    __shared__ float shared[BLOCK];
    const float* xr = x + (size_t)blockIdx.x * d;
    float* orow = out + (size_t)blockIdx.x * d;
    float acc = 0.0f;
    for (int i = threadIdx.x; i < d; i += BLOCK) acc = __fmaf_rn(xr[i], xr[i], acc);
    float ss = block_sum(acc, shared);
    float s = 1.0f / sqrtf(__fadd_rn(ss / (float)d, eps));
    for (int i = threadIdx.x; i < d; i += BLOCK) orow[i] = __fmul_rn(__fmul_rn(xr[i], s), w[i]);
}

// Rotates the first 2 * half dimensions of every head of every row of x (rows of `ld` values, the
// heads first) by the
// angles whose cosines and sines are given per row ([m, half]); `neox` pairs i with i + half,
// otherwise 2i with 2i + 1.
extern "C" __global__ void rope(float* __restrict__ x, const float* __restrict__ cosines,
                                const float* __restrict__ sines, int m, int heads, int hd, int half,
                                int neox, int ld) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m * heads * half) return;
    int p = i % half;
    int h = (i / half) % heads;
    int r = i / (half * heads);
    float* head = x + (size_t)r * ld + (size_t)h * hd;
    int a = neox ? p : 2 * p;
    int b = neox ? p + half : 2 * p + 1;
    float c = cosines[r * half + p];
    float s = sines[r * half + p];
    float x0 = head[a];
    float x1 = head[b];
    head[a] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    head[b] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

// Writes the keys and values of rows 0..m (f32, rows of `ld` values) at positions pos.. of one layer's
// cache ([heads, cap, hd], f16, rounded to nearest even).
extern "C" __global__ void kv_write(const float* __restrict__ k, const float* __restrict__ v,
                                    half_bits* __restrict__ kc, half_bits* __restrict__ vc, int m, int heads,
                                    int hd, int cap, int pos, int ld) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m * heads * hd) return;
    int d = i % hd;
    int h = (i / hd) % heads;
    int r = i / (hd * heads);
    size_t at = ((size_t)h * cap + pos + r) * hd + d;
    size_t from = (size_t)r * ld + (size_t)h * hd + d;
    kc[at] = f2h(k[from]);
    vc[at] = f2h(v[from]);
}

// Causal attention, split over the keys (flash-decoding): `attention_chunk` takes query head
// blockIdx.x of row blockIdx.y (at position p = pos + row) over keys CHUNK * blockIdx.z .. of its
// KV head, up to p, and leaves that chunk's largest score, its sum of e^(score - largest) and its
// weighted sum of values; `attention_merge` adds the chunks up in order. The chunks are fixed
// spans of key positions and every sum has a fixed order, so a row's result depends on p alone,
// not on the block it was scored in. `parts` holds, per (row, head), `chunks` records of
// [largest, sum, hd values].
#define WARPS (BLOCK / 32)
#define CHUNK 256
// A chunk's weights are one per thread; heads of at most 256 values (the host checks).
static_assert(CHUNK <= BLOCK, "a chunk has at most one key per thread");
extern "C" __global__ void attention_chunk(const float* __restrict__ q,
                                           const half_bits* __restrict__ kc,
                                           const half_bits* __restrict__ vc,
                                           float* __restrict__ parts, int n_head, int kv_heads,
                                           int hd, int cap, int pos, int chunks, float scale,
                                           int ldq) {
    __shared__ float shared[BLOCK];
    __shared__ float qs[256];
    __shared__ float s[CHUNK];
    __shared__ float partial[WARPS][256];
    int h = blockIdx.x;
    int r = blockIdx.y;
    int c = blockIdx.z;
    int tid = threadIdx.x;
    int warp = tid >> 5;
    int lane = tid & 31;
    int p = pos + r;
    int first = c * CHUNK;
    if (first > p) return;
    int n = min(CHUNK, p + 1 - first);
    int kvh = h / (n_head / kv_heads);
    const float* qr = q + (size_t)r * ldq + (size_t)h * hd;
    const half_bits* keys = kc + ((size_t)kvh * cap + first) * hd;
    const half_bits* values = vc + ((size_t)kvh * cap + first) * hd;
    float* rec = parts + (((size_t)r * n_head + h) * chunks + c) * (hd + 2);
    for (int d = tid; d < hd; d += BLOCK) qs[d] = qr[d];
    __syncthreads();
    float mx = __int_as_float(0xff800000);
    for (int j = warp; j < n; j += WARPS) {
        const half_bits* kr = keys + (size_t)j * hd;
        float acc = 0.0f;
        for (int d = lane; d < hd; d += 32) acc = __fmaf_rn(qs[d], h2f(kr[d]), acc);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(FULL, acc, off));
        acc = __fmul_rn(acc, scale);
        if (lane == 0) s[j] = acc;
        mx = fmaxf(mx, acc);
    }
    mx = block_max(mx, shared);
    float e = 0.0f;
    if (tid < n) {
        e = expf(__fsub_rn(s[tid], mx));
        s[tid] = e;
    }
    float sum = block_sum(e, shared);
    // block_sum's barriers make every thread's weights visible to the others.
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i] = 0.0f;
    for (int j = warp; j < n; j += WARPS) {
        float w = s[j];
        const half_bits* vr = values + (size_t)j * hd;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int d = lane + 32 * i;
            if (d < hd) acc[i] = __fmaf_rn(w, h2f(vr[d]), acc[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int d = lane + 32 * i;
        if (d < hd) partial[warp][d] = acc[i];
    }
    __syncthreads();
    if (tid == 0) {
        rec[0] = mx;
        rec[1] = sum;
    }
    for (int d = tid; d < hd; d += BLOCK) {
        float v = partial[0][d];
        for (int w = 1; w < WARPS; w++) v = __fadd_rn(v, partial[w][d]);
        rec[2 + d] = v;
    }
}

extern "C" __global__ void attention_merge(const float* __restrict__ parts, float* __restrict__ out,
                                           int n_head, int hd, int pos, int chunks) {
    int h = blockIdx.x;
    int r = blockIdx.y;
    int used = (pos + r) / CHUNK + 1;
    const float* recs = parts + ((size_t)r * n_head + h) * chunks * (hd + 2);
    float mx = __int_as_float(0xff800000);
    for (int c = 0; c < used; c++) mx = fmaxf(mx, recs[(size_t)c * (hd + 2)]);
    float total = 0.0f;
    for (int c = 0; c < used; c++) {
        const float* rec = recs + (size_t)c * (hd + 2);
        total = __fmaf_rn(rec[1], expf(__fsub_rn(rec[0], mx)), total);
    }
    float inv = 1.0f / total;
    float* o = out + ((size_t)r * n_head + h) * hd;
    for (int d = threadIdx.x; d < hd; d += BLOCK) {
        float v = 0.0f;
        for (int c = 0; c < used; c++) {
            const float* rec = recs + (size_t)c * (hd + 2);
            v = __fmaf_rn(rec[2 + d], expf(__fsub_rn(rec[0], mx)), v);
        }
        o[d] = __fmul_rn(v, inv);
    }
}

// gate = silu(gate) * up, for rows of [gate (n_ff values), up (n_ff values)]; gate in place.
extern "C" __global__ void swiglu(float* __restrict__ gu, int m, int n_ff) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m * n_ff) return;
    float* row = gu + (size_t)(i / n_ff) * 2 * n_ff;
    int c = i % n_ff;
    float g = row[c];
    row[c] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), row[n_ff + c]);
}

// y[0..n] = value.
extern "C" __global__ void fill(float* __restrict__ y, float value, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = value;
}
