//! The forward pass on an NVIDIA GPU (cargo feature `cuda`): the same transformer as
//! [`crate::model`], its matrices held on the GPU as IEEE f16 (dequantised once at load), its KV
//! cache on the GPU as f16, and kernels of our own ([`kernels.cu`](SOURCE)) compiled by NVRTC for
//! the device at load. The CUDA libraries are loaded when the first model is (cudarc's dynamic
//! loading), so a build with the feature runs, and builds, on a machine with no CUDA at all.
//!
//! invariant: as on the CPU, the logits of a position do not depend on how the tokens were grouped
//! into blocks or sequences into batches: every kernel computes each output element in an order fixed
//! by the model's shape alone (see the source's header). Greedy speculative output on the GPU is
//! therefore identical to greedy plain output on the GPU. The GPU's logits are not the CPU's bit for
//! bit (f16 weights and f32 activations there, quantised activations here).
//!
//! The embedding rows are looked up on the host (from the model's own matrices) and copied up with
//! the rope table; the logits are copied down. Everything else stays on the device, on one stream.

use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use specdec_kernels::{ThreadPool, F16};

use crate::config::RopeStyle;
use crate::error::{Error, Result};
use crate::model::{Model, Part};
use crate::weights::{QWeight, MASKED};

/// The kernels, compiled when a model is loaded.
const SOURCE: &str = include_str!("kernels.cu");
/// Threads per block of every kernel (`BLOCK` in the source).
const BLOCK: u32 = 256;
/// The largest head the attention kernel holds (its query buffer in shared memory).
const MAX_HEAD_DIM: usize = 256;
/// Key positions per chunk of the split attention (`CHUNK` in the source).
const CHUNK: usize = 256;
/// The largest finite f16: the weights are held as f16 on the device.
const F16_MAX: f32 = 65504.0;

fn cuda(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Cuda(format!("{what}: {e}"))
}

/// A kernel argument: a device pointer, an `int` or a `float`.
#[derive(Clone, Copy)]
enum Arg {
    P(u64),
    I(usize),
    F(f32),
}

impl Arg {
    /// The argument in an 8-byte slot: the driver reads as many of its first bytes as the
    /// parameter has (little-endian, so an `int` or a `float` is the low half).
    fn slot(self) -> Result<u64> {
        Ok(match self {
            Arg::P(p) => p,
            Arg::I(i) => u64::from(
                u32::try_from(i32::try_from(i).map_err(|_| cuda("argument", "over i32"))?)
                    .map_err(|_| cuda("argument", "negative"))?,
            ),
            Arg::F(f) => u64::from(f.to_bits()),
        })
    }
}

/// The compiled kernels.
struct Kernels {
    matvec: CudaFunction,
    rms_norm: CudaFunction,
    rope: CudaFunction,
    kv_write: CudaFunction,
    attention_chunk: CudaFunction,
    attention_merge: CudaFunction,
    swiglu: CudaFunction,
    fill: CudaFunction,
}

/// One layer's weights on the device, the matrices that read the same input stacked into one
/// (one launch, and more rows to spread over the multiprocessors).
struct Layer {
    attn_norm: CudaSlice<f32>,
    /// `[wq; wk; wv]`: a row gives `[q, k, v]`.
    qkv: CudaSlice<u16>,
    qkv_bias: Option<CudaSlice<f32>>,
    wo: CudaSlice<u16>,
    ffn_norm: CudaSlice<f32>,
    /// `[w_gate; w_up]`.
    gate_up: CudaSlice<u16>,
    w_down: CudaSlice<u16>,
}

/// The device buffers of a pass, grown to the largest block seen.
#[derive(Default)]
struct Scratch {
    bufs: Vec<Option<CudaSlice<f32>>>,
    host_x: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// The buffers of [`Scratch`], by index.
#[derive(Clone, Copy)]
enum Buf {
    X,
    H,
    /// Rows of `[q, k, v]`.
    Qkv,
    Attn,
    /// Rows of `[gate, up]`.
    GateUp,
    /// The split attention's per-chunk records.
    Chunks,
    Logits,
    Cos,
    Sin,
}

const BUFS: usize = 9;

/// A model's weights and kernels on one GPU.
pub(crate) struct Gpu {
    stream: Arc<CudaStream>,
    ordinal: usize,
    name: String,
    kernels: Kernels,
    layers: Vec<Layer>,
    norm: CudaSlice<f32>,
    output: CudaSlice<u16>,
    /// [`Model::logits_also`], as `int` row indices.
    also: Option<CudaSlice<i32>>,
    bytes: usize,
    scratch: Mutex<Scratch>,
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // As `GpuCache`'s: the weights and buffers are freed in this device's context.
        let _ = self.stream.context().bind_to_thread();
    }
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("device", &self.name)
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

/// The dequantised rows of the matrices `ws`, stacked, as f16 bit patterns, on `pool`'s threads.
fn half_matrix(ws: &[&QWeight], pool: &ThreadPool) -> Result<Vec<u16>> {
    let mut out = vec![0u16; ws.iter().map(|w| w.rows() * w.cols()).sum()];
    let failed: Mutex<Option<Error>> = Mutex::new(None);
    let mut rest = &mut out[..];
    for w in ws {
        let (rows, cols) = (w.rows(), w.cols());
        let (part, after) = rest.split_at_mut(rows * cols);
        rest = after;
        // Whole rows per chunk, a few chunks per thread.
        let chunk = rows.div_ceil(4 * pool.threads()).max(1) * cols;
        pool.for_chunks_mut(part, chunk, &|start, dst| {
            if let Err(e) = half_rows(w, start / cols, dst) {
                failed
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(e);
            }
        });
    }
    match failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// Rows `first..` of `w` as f16 bit patterns into `dst` (whole rows); a value beyond f16's range is
/// an error.
fn half_rows(w: &QWeight, first: usize, dst: &mut [u16]) -> Result<()> {
    let mut row = vec![0f32; w.cols()];
    for (j, d) in dst.chunks_exact_mut(w.cols()).enumerate() {
        w.row_into(first + j, &mut row)?;
        if let Some(x) = row.iter().find(|x| x.abs() > F16_MAX) {
            return Err(cuda(
                "weights",
                format!("a weight of {x} is outside f16's range"),
            ));
        }
        for (h, &x) in d.iter_mut().zip(&row) {
            *h = F16::from_f32(x).0;
        }
    }
    Ok(())
}

/// One `matvec` launch: `y[t, r] (+)= w[r] · x[t] (+ bias[r])` for `n` rows of the f16 matrix
/// `w` (`k` columns) and `m` tokens (device pointers).
struct Product {
    w: u64,
    x: u64,
    y: u64,
    bias: Option<u64>,
    /// The matrix rows to compute, as `int`s, when not `0..n`.
    rows: Option<u64>,
    n: usize,
    k: usize,
    m: usize,
    /// The distance between two tokens' inputs in `x`.
    ldx: usize,
    /// The distance between two tokens' outputs in `y`.
    ldy: usize,
    /// Add into `y` (the residual) rather than overwrite it.
    accumulate: bool,
}

impl Product {
    /// `y[t, 0..n] = w · x[t]`, no bias, every row.
    fn new(
        w: u64,
        (x, ldx): (u64, usize),
        (y, ldy): (u64, usize),
        (n, k, m): (usize, usize, usize),
    ) -> Self {
        Self {
            w,
            x,
            y,
            bias: None,
            rows: None,
            n,
            k,
            m,
            ldx,
            ldy,
            accumulate: false,
        }
    }
}

impl Gpu {
    /// Copies `model`'s weights to GPU `ordinal` and compiles the kernels for it.
    pub(crate) fn new(model: &Model, ordinal: usize) -> Result<Self> {
        let c = model.config();
        if c.head_dim > MAX_HEAD_DIM {
            return Err(cuda(
                "model",
                format!(
                    "heads of {} values (the GPU path holds at most {MAX_HEAD_DIM})",
                    c.head_dim
                ),
            ));
        }
        for k in [c.n_embd, c.q_dim(), c.n_ff] {
            if !k.is_multiple_of(8) {
                return Err(cuda(
                    "model",
                    format!("a matrix of {k} columns (the GPU path needs a multiple of 8)"),
                ));
            }
        }
        // SAFETY: only checks that a library can be opened; nothing is called yet.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(cuda(
                "driver",
                "libcuda could not be loaded (no NVIDIA driver on this machine?)",
            ));
        }
        // SAFETY: as above.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(cuda(
                "NVRTC",
                "libnvrtc could not be loaded (add the CUDA toolkit's lib64 to LD_LIBRARY_PATH)",
            ));
        }
        let count = CudaContext::device_count().map_err(|e| cuda("devices", e))?;
        if usize::try_from(count).map_or(true, |n| ordinal >= n) {
            return Err(cuda(
                "device",
                format!("no CUDA device {ordinal} ({count} present)"),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda("context", e))?;
        // One stream does everything in order: no events are needed between its operations.
        // SAFETY: nothing has been allocated or launched on this context yet.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let name = ctx.name().map_err(|e| cuda("device name", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| cuda("compute capability", e))?;
        let options = CompileOptions {
            options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
            ..CompileOptions::default()
        };
        let ptx = compile_ptx_with_opts(SOURCE, options).map_err(|e| cuda("NVRTC", e))?;
        let module = ctx.load_module(ptx).map_err(|e| cuda("module", e))?;
        let f = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| cuda(&format!("kernel {name}"), e))
        };
        let kernels = Kernels {
            matvec: f("matvec")?,
            rms_norm: f("rms_norm")?,
            rope: f("rope")?,
            kv_write: f("kv_write")?,
            attention_chunk: f("attention_chunk")?,
            attention_merge: f("attention_merge")?,
            swiglu: f("swiglu")?,
            fill: f("fill")?,
        };
        let mut bytes = 0;
        let mut up_f32 = |v: &[f32]| {
            bytes += 4 * v.len();
            stream.clone_htod(v).map_err(|e| cuda("copy", e))
        };
        let mut vectors = Vec::new();
        for l in &model.layers {
            vectors.push((
                up_f32(&l.attn_norm)?,
                up_f32(&l.ffn_norm)?,
                match &l.bias {
                    Some([q, k, v]) => Some(up_f32(&[&q[..], k, v].concat())?),
                    None => None,
                },
            ));
        }
        let norm = up_f32(&model.norm)?;
        let mut up_matrix = |ws: &[&QWeight]| -> Result<CudaSlice<u16>> {
            let h = half_matrix(ws, model.pool())?;
            bytes += 2 * h.len();
            stream.clone_htod(&h).map_err(|e| cuda("copy", e))
        };
        let mut layers = Vec::with_capacity(model.layers.len());
        for (l, (attn_norm, ffn_norm, qkv_bias)) in model.layers.iter().zip(vectors) {
            layers.push(Layer {
                attn_norm,
                qkv: up_matrix(&[&l.wq, &l.wk, &l.wv])?,
                qkv_bias,
                wo: up_matrix(&[&l.wo])?,
                ffn_norm,
                gate_up: up_matrix(&[&l.w_gate, &l.w_up])?,
                w_down: up_matrix(&[&l.w_down])?,
            });
        }
        let output = up_matrix(&[model.output.as_ref().unwrap_or(&model.embd)])?;
        let also = if model.logits_also.is_empty() {
            None
        } else {
            let ids: Vec<i32> = model
                .logits_also
                .iter()
                .map(|&i| i32::try_from(i).map_err(|_| cuda("logits_also", "id over i32")))
                .collect::<Result<_>>()?;
            Some(stream.clone_htod(&ids).map_err(|e| cuda("copy", e))?)
        };
        stream.synchronize().map_err(|e| cuda("synchronize", e))?;
        Ok(Self {
            stream,
            ordinal,
            name,
            kernels,
            layers,
            norm,
            output,
            also,
            bytes,
            scratch: Mutex::new(Scratch::default()),
        })
    }

    /// The device's ordinal.
    pub(crate) fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's name, as the driver gives it.
    pub(crate) fn device_name(&self) -> &str {
        &self.name
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    fn launch(&self, f: &CudaFunction, grid: (usize, usize, usize), args: &[Arg]) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            // Nothing to do (a part of no tokens, say).
            return Ok(());
        }
        let slots: Vec<u64> = args.iter().map(|a| a.slot()).collect::<Result<_>>()?;
        let dim = |n: usize| u32::try_from(n).map_err(|_| cuda("launch", "grid too large"));
        let cfg = LaunchConfig {
            grid_dim: (dim(grid.0)?, dim(grid.1)?, dim(grid.2)?),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(f);
        for s in &slots {
            b.arg(s);
        }
        // SAFETY: every launch below passes the arguments its kernel declares, in order, with
        // pointers to device buffers at least as long as the kernel's indexing reaches (the
        // buffers are grown to the block's sizes before the layers run).
        unsafe { b.launch(cfg) }.map_err(|e| cuda("launch", e))?;
        Ok(())
    }

    /// Launches `matvec` for `p`.
    fn matvec(&self, p: Product) -> Result<()> {
        let per_block = BLOCK as usize / 32;
        self.launch(
            &self.kernels.matvec,
            (p.n.div_ceil(per_block), 1, 1),
            &[
                Arg::P(p.w),
                Arg::P(p.x),
                Arg::P(p.y),
                Arg::P(p.bias.unwrap_or(0)),
                Arg::P(p.rows.unwrap_or(0)),
                Arg::I(p.n),
                Arg::I(p.k),
                Arg::I(p.m),
                Arg::I(p.ldx),
                Arg::I(p.ldy),
                Arg::I(usize::from(p.accumulate)),
            ],
        )
    }

    /// `out[r] = x[r] / rms(x[r]) · w` for `rows` rows of `d` values.
    fn rms_norm(
        &self,
        x: u64,
        w: u64,
        out: u64,
        (rows, d): (usize, usize),
        eps: f32,
    ) -> Result<()> {
        self.launch(
            &self.kernels.rms_norm,
            (rows, 1, 1),
            &[Arg::P(x), Arg::P(w), Arg::P(out), Arg::I(d), Arg::F(eps)],
        )
    }

    fn elementwise(&self, f: &CudaFunction, n: usize, args: &[Arg]) -> Result<()> {
        self.launch(f, (n.div_ceil(BLOCK as usize), 1, 1), args)
    }

    /// [`Model::forward_parts`] on the device: `m` tokens in all, logits of `wanted` rows.
    pub(crate) fn forward_parts(
        &self,
        model: &Model,
        parts: &mut [Part<'_>],
        m: usize,
        wanted: usize,
    ) -> Result<()> {
        let c = model.config();
        let d = c.n_embd;
        let (q_dim, kv_dim, half) = (c.q_dim(), c.kv_dim(), c.rope_dim / 2);
        let qkv = q_dim + 2 * kv_dim;
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let sc = &mut *guard;
        sc.host_x.clear();
        sc.host_x.resize(m * d, 0.0);
        let tokens = parts.iter().flat_map(|p| p.tokens.iter());
        // `Model::forward_parts` checked every token against the vocabulary.
        for (row, &t) in sc.host_x.chunks_exact_mut(d).zip(tokens) {
            model.embd.row_into(t as usize, row)?;
        }
        sc.cos.clear();
        sc.sin.clear();
        let mut span = 0;
        for p in parts.iter_mut() {
            model.rope_table(p.cache.len(), p.tokens.len(), &mut sc.cos, &mut sc.sin);
            span = span.max(p.cache.len() + p.tokens.len());
            match &p.cache.gpu {
                Some(g) if g.ordinal != self.ordinal => return Err(Error::CacheShape),
                Some(_) => {}
                None => {
                    p.cache.gpu = Some(GpuCache::new(
                        &self.stream,
                        self.ordinal,
                        c.n_layer,
                        (c.n_head_kv, p.cache.capacity(), c.head_dim),
                    )?);
                }
            }
        }
        let chunks = span.div_ceil(CHUNK);
        let sizes = [
            (Buf::X, m * d),
            (Buf::H, m * d),
            (Buf::Qkv, m * qkv),
            (Buf::Attn, m * q_dim),
            (Buf::GateUp, m * 2 * c.n_ff),
            (Buf::Chunks, m * c.n_head * chunks * (c.head_dim + 2)),
            (Buf::Logits, wanted * c.vocab),
            (Buf::Cos, m * half),
            (Buf::Sin, m * half),
        ];
        sc.bufs.resize_with(BUFS, || None);
        let mut at = [0u64; BUFS];
        for (b, len) in sizes {
            let slot = &mut sc.bufs[b as usize];
            if slot.as_ref().is_none_or(|s| s.len() < len) {
                *slot = None;
                *slot = Some(
                    self.stream
                        .alloc_zeros::<f32>(len.max(1))
                        .map_err(|e| cuda("allocate", e))?,
                );
            }
            if let Some(s) = slot.as_ref() {
                at[b as usize] = self.ptr(s);
            }
        }
        let buf = |b: Buf| at[b as usize];
        let f32s = |b: Buf, rows: usize, width: usize| buf(b) + (rows * width * 4) as u64;
        {
            let [x, .., cos, sin] = &mut sc.bufs[..] else {
                return Err(cuda("scratch", "buffers missing"));
            };
            let copy = |dst: &mut Option<CudaSlice<f32>>, src: &[f32]| -> Result<()> {
                let dst = dst
                    .as_mut()
                    .ok_or_else(|| cuda("scratch", "buffer missing"))?;
                self.stream
                    .memcpy_htod(src, &mut dst.slice_mut(..src.len()))
                    .map_err(|e| cuda("copy", e))
            };
            copy(x, &sc.host_x)?;
            copy(cos, &sc.cos)?;
            copy(sin, &sc.sin)?;
        }
        let k = &self.kernels;
        let neox = usize::from(c.rope_style == RopeStyle::Neox);
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        for (li, l) in self.layers.iter().enumerate() {
            self.rms_norm(
                buf(Buf::X),
                self.ptr(&l.attn_norm),
                buf(Buf::H),
                (m, d),
                c.rms_eps,
            )?;
            self.matvec(Product {
                bias: l.qkv_bias.as_ref().map(|b| self.ptr(b)),
                ..Product::new(
                    self.ptr(&l.qkv),
                    (buf(Buf::H), d),
                    (buf(Buf::Qkv), qkv),
                    (qkv, d, m),
                )
            })?;
            // q at the start of each row, k after it.
            for (offset, heads) in [(0, c.n_head), (q_dim, c.n_head_kv)] {
                self.elementwise(
                    &k.rope,
                    m * heads * half,
                    &[
                        Arg::P(buf(Buf::Qkv) + (offset * 4) as u64),
                        Arg::P(buf(Buf::Cos)),
                        Arg::P(buf(Buf::Sin)),
                        Arg::I(m),
                        Arg::I(heads),
                        Arg::I(c.head_dim),
                        Arg::I(half),
                        Arg::I(neox),
                        Arg::I(qkv),
                    ],
                )?;
            }
            let mut row = 0;
            for p in parts.iter() {
                let (pos, n) = (p.cache.len(), p.tokens.len());
                let cache = p
                    .cache
                    .gpu
                    .as_ref()
                    .ok_or_else(|| cuda("cache", "not on the device"))?;
                let (kc, vc) = (self.ptr(&cache.k[li]), self.ptr(&cache.v[li]));
                let cap = p.cache.capacity();
                let rows = f32s(Buf::Qkv, row, qkv);
                self.elementwise(
                    &k.kv_write,
                    n * kv_dim,
                    &[
                        Arg::P(rows + (q_dim * 4) as u64),
                        Arg::P(rows + ((q_dim + kv_dim) * 4) as u64),
                        Arg::P(kc),
                        Arg::P(vc),
                        Arg::I(n),
                        Arg::I(c.n_head_kv),
                        Arg::I(c.head_dim),
                        Arg::I(cap),
                        Arg::I(pos),
                        Arg::I(qkv),
                    ],
                )?;
                let parts_at = f32s(Buf::Chunks, row, c.n_head * chunks * (c.head_dim + 2));
                self.launch(
                    &k.attention_chunk,
                    (c.n_head, n, (pos + n).div_ceil(CHUNK)),
                    &[
                        Arg::P(rows),
                        Arg::P(kc),
                        Arg::P(vc),
                        Arg::P(parts_at),
                        Arg::I(c.n_head),
                        Arg::I(c.n_head_kv),
                        Arg::I(c.head_dim),
                        Arg::I(cap),
                        Arg::I(pos),
                        Arg::I(chunks),
                        Arg::F(scale),
                        Arg::I(qkv),
                    ],
                )?;
                self.launch(
                    &k.attention_merge,
                    (c.n_head, n, 1),
                    &[
                        Arg::P(parts_at),
                        Arg::P(f32s(Buf::Attn, row, q_dim)),
                        Arg::I(c.n_head),
                        Arg::I(c.head_dim),
                        Arg::I(pos),
                        Arg::I(chunks),
                    ],
                )?;
                row += n;
            }
            self.matvec(Product {
                accumulate: true,
                ..Product::new(
                    self.ptr(&l.wo),
                    (buf(Buf::Attn), q_dim),
                    (buf(Buf::X), d),
                    (d, q_dim, m),
                )
            })?;
            self.rms_norm(
                buf(Buf::X),
                self.ptr(&l.ffn_norm),
                buf(Buf::H),
                (m, d),
                c.rms_eps,
            )?;
            let gu = 2 * c.n_ff;
            self.matvec(Product::new(
                self.ptr(&l.gate_up),
                (buf(Buf::H), d),
                (buf(Buf::GateUp), gu),
                (gu, d, m),
            ))?;
            self.elementwise(
                &k.swiglu,
                m * c.n_ff,
                &[Arg::P(buf(Buf::GateUp)), Arg::I(m), Arg::I(c.n_ff)],
            )?;
            // The gates, now silu(gate) · up, are the first half of each row.
            self.matvec(Product {
                accumulate: true,
                ..Product::new(
                    self.ptr(&l.w_down),
                    (buf(Buf::GateUp), gu),
                    (buf(Buf::X), d),
                    (d, c.n_ff, m),
                )
            })?;
        }
        // The final norm of the rows whose logits are asked, into `h`.
        let (mut row, mut out_row) = (0, 0);
        for p in parts.iter() {
            let n = p.tokens.len();
            self.rms_norm(
                f32s(Buf::X, row + n - p.logits_rows, d),
                self.ptr(&self.norm),
                f32s(Buf::H, out_row, d),
                (p.logits_rows, d),
                c.rms_eps,
            )?;
            row += n;
            out_row += p.logits_rows;
        }
        if wanted > 0 {
            let logits = buf(Buf::Logits);
            let limit = model.logits_vocab();
            if limit < c.vocab {
                self.elementwise(
                    &k.fill,
                    wanted * c.vocab,
                    &[Arg::P(logits), Arg::F(MASKED), Arg::I(wanted * c.vocab)],
                )?;
            }
            let out = self.ptr(&self.output);
            self.matvec(Product::new(
                out,
                (buf(Buf::H), d),
                (logits, c.vocab),
                (limit, d, wanted),
            ))?;
            if let Some(also) = &self.also {
                self.matvec(Product {
                    rows: Some(self.ptr(also)),
                    ..Product::new(
                        out,
                        (buf(Buf::H), d),
                        (logits, c.vocab),
                        (also.len(), d, wanted),
                    )
                })?;
            }
        }
        let all = sc.bufs[Buf::Logits as usize]
            .as_ref()
            .ok_or_else(|| cuda("scratch", "logits missing"))?;
        let mut at = 0;
        for p in parts.iter_mut() {
            let n = p.logits_rows * c.vocab;
            p.logits.clear();
            p.logits.resize(n, 0.0);
            if n > 0 {
                self.stream
                    .memcpy_dtoh(&all.slice(at..at + n), &mut p.logits[..])
                    .map_err(|e| cuda("copy", e))?;
            }
            at += n;
        }
        self.stream
            .synchronize()
            .map_err(|e| cuda("synchronize", e))?;
        for p in parts.iter_mut() {
            let len = p.cache.len() + p.tokens.len();
            p.cache.set_len(len);
        }
        Ok(())
    }
}

/// A sequence's keys and values on the device: per layer `[heads, capacity, head_dim]` f16.
/// Allocated by the first pass that writes it. A clone copies them on the device (cudarc's clone
/// panics if the device is out of memory).
#[derive(Clone)]
pub(crate) struct GpuCache {
    stream: Arc<CudaStream>,
    /// The device it lives on: a model on another refuses it.
    ordinal: usize,
    k: Vec<CudaSlice<u16>>,
    v: Vec<CudaSlice<u16>>,
}

impl Drop for GpuCache {
    fn drop(&mut self) {
        // cudarc frees a slice without making its context current: on a thread that has made no
        // CUDA call the free would fail and the memory leak. The fields are dropped after this.
        let _ = self.stream.context().bind_to_thread();
    }
}

impl std::fmt::Debug for GpuCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuCache")
            .field("layers", &self.k.len())
            .finish_non_exhaustive()
    }
}

impl GpuCache {
    fn new(
        stream: &Arc<CudaStream>,
        ordinal: usize,
        layers: usize,
        (heads, capacity, hd): (usize, usize, usize),
    ) -> Result<Self> {
        let per_layer = heads
            .checked_mul(capacity)
            .and_then(|n| n.checked_mul(hd))
            .ok_or_else(|| {
                cuda(
                    "KV cache",
                    format!("{capacity} positions do not fit in memory"),
                )
            })?;
        let alloc = || {
            stream
                .alloc_zeros::<u16>(per_layer.max(1))
                .map_err(|e| cuda("allocate the KV cache", e))
        };
        Ok(Self {
            stream: Arc::clone(stream),
            ordinal,
            k: (0..layers).map(|_| alloc()).collect::<Result<_>>()?,
            v: (0..layers).map(|_| alloc()).collect::<Result<_>>()?,
        })
    }

    /// Copies the first `n` positions of every head of `src` (whose capacity is `from`) into
    /// `dst` (of capacity `to`), allocating `dst` if it is not yet: `heads` heads of `hd` values.
    pub(crate) fn copy_prefix(
        dst: &mut Option<GpuCache>,
        src: &GpuCache,
        (heads, hd, n): (usize, usize, usize),
        (from, to): (usize, usize),
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if dst.is_none() {
            *dst = Some(GpuCache::new(
                &src.stream,
                src.ordinal,
                src.k.len(),
                (heads, to, hd),
            )?);
        }
        let Some(dst) = dst.as_mut() else {
            return Ok(());
        };
        if dst.ordinal != src.ordinal {
            return Err(Error::CacheShape);
        }
        let stream = Arc::clone(&src.stream);
        let pairs = dst
            .k
            .iter_mut()
            .zip(&src.k)
            .chain(dst.v.iter_mut().zip(&src.v));
        for (d, s) in pairs {
            for h in 0..heads {
                let a = h * from * hd;
                let b = h * to * hd;
                stream
                    .memcpy_dtod(&s.slice(a..a + n * hd), &mut d.slice_mut(b..b + n * hd))
                    .map_err(|e| cuda("copy", e))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::GgmlDType;

    use super::*;

    #[test]
    fn stacked_matrices_are_their_rows_in_f16() {
        let pool = ThreadPool::new(2).unwrap();
        let values = |rows: usize, seed: f32| -> Vec<f32> {
            (0..rows * 64)
                .map(|i| (i as f32 * 0.37 + seed).sin() * 3.0)
                .collect()
        };
        let a = QWeight::quantize(&values(37, 0.0), 37, 64, GgmlDType::Q8_0).unwrap();
        let b = QWeight::quantize(&values(5, 1.0), 5, 64, GgmlDType::F32).unwrap();
        let got = half_matrix(&[&a, &b], &pool).unwrap();
        let mut want = Vec::new();
        let mut row = vec![0f32; 64];
        for w in [&a, &b] {
            for r in 0..w.rows() {
                w.row_into(r, &mut row).unwrap();
                want.extend(row.iter().map(|&x| F16::from_f32(x).0));
            }
        }
        assert_eq!(got, want);
    }

    #[test]
    fn a_weight_beyond_f16_is_refused() {
        let pool = ThreadPool::new(2).unwrap();
        let mut v = vec![1.0f32; 8 * 64];
        v[5 * 64 + 3] = 1e5;
        let w = QWeight::quantize(&v, 8, 64, GgmlDType::F32).unwrap();
        let e = half_matrix(&[&w], &pool).unwrap_err();
        assert!(e.to_string().contains("outside f16's range"), "{e}");
    }
}
