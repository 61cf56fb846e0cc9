//! The decoder-only transformer shared by the supported architectures: immutable weights, shared
//! freely (wrap in `Arc`), and a forward pass over a block of tokens that writes the KV cache and
//! returns logits for as many of the block's last positions as asked.
//!
//! invariant: the logits of a position do not depend on how the tokens were grouped into blocks. Every
//! step is row-independent: matmuls (see [`crate::weights`]), norms, rope and attention, which visits
//! exactly the keys `0..=pos` of each row in one fixed order with no mask. So block scoring of k
//! drafted tokens equals k single-token steps bit for bit, which is what makes greedy speculative
//! output identical to greedy plain output on real models.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::quantized::GgmlDType;
use specdec_kernels::{Kernels, ThreadPool};

use crate::attention::attention;
use crate::config::{Arch, ModelConfig, RopeStyle};
use crate::error::{Error, Result};
use crate::gguf::Gguf;
use crate::kv::KvCache;
use crate::weights::{ActivationBuffers, Activations, QWeight};

/// How weights are prepared at load time.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadOptions {
    /// Re-quantise Q5_1 matrices to Q8_0, which our kernels cover (candle's Q5_1 dot product is
    /// scalar). Costs ~1.4x the bytes of those matrices; the embedding table is left as it is. Q5_0
    /// has a kernel of its own and is never re-quantised.
    pub requantize_q5: bool,
    /// Threads for the matrix kernels, the caller included; `None` means one per available core.
    /// Models loaded with the same count share one pool.
    pub threads: Option<usize>,
    /// Score only tokens `0..N` and give the others the logit [`crate::weights::MASKED`] (probability
    /// 0), skipping their rows of the output matrix. For a draft model: BPE vocabularies list their
    /// tokens roughly from most to least frequent, so the first tens of thousands cover nearly all
    /// text, and a draft restricted to them stays exact (the target still verifies every token; a
    /// token the draft cannot propose is simply never drafted). `None` scores the whole vocabulary.
    pub logits_vocab: Option<usize>,
    /// Token ids scored beside the first [`LoadOptions::logits_vocab`] when that restricts the
    /// vocabulary: the tokens that end a generation, which tokenizers list last. A draft that
    /// cannot propose the end of an answer has its draft rejected there, and pays a round for it
    /// at the end of every answer. Ids past the vocabulary are an error.
    pub logits_also: Vec<u32>,
    /// Re-quantise every matrix (the embedding table included, which a tied output matrix reads) to
    /// this type at load, when it is another: fewer bytes per step for a draft model, at some cost
    /// in acceptance. A K-quant applies to matrices whose rows are whole 256-value super-blocks; the
    /// others go to Q4_0, and those no 32-value block divides keep their type
    /// ([`requantized_type`]). `None` keeps the file's types.
    pub requantize: Option<GgmlDType>,
    /// Where the forward pass runs. [`Device::Cuda`] needs the cargo feature `cuda`.
    pub device: Device,
}

/// Where a model's forward pass runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// This machine's cores, on specdec's own kernels.
    #[default]
    Cpu,
    /// The NVIDIA GPU of this ordinal (cargo feature `cuda`): weights as f16 on the device, our
    /// own kernels compiled by NVRTC at load.
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;

    /// `cpu`, `cuda` (GPU 0) or `cuda:N`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device `{s}` (cpu, cuda or cuda:N)")),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            requantize_q5: true,
            threads: None,
            logits_vocab: None,
            logits_also: Vec::new(),
            requantize: None,
            device: Device::Cpu,
        }
    }
}

/// The kernel thread pool of `threads` threads (one per core for `None`, at most
/// [`specdec_kernels::MAX_THREADS`]; more is [`Error::Threads`]), shared by every model that
/// asks for the same count: the draft and the target never run at the same time, and one pool's
/// workers do not compete with another's for the cores.
pub fn thread_pool(threads: Option<usize>) -> Result<Arc<ThreadPool>> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Arc<ThreadPool>>>> = OnceLock::new();
    let n = threads
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(specdec_kernels::MAX_THREADS)
        })
        .max(1);
    let mut pools = POOLS
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(p) = pools.get(&n) {
        return Ok(Arc::clone(p));
    }
    let pool =
        Arc::new(ThreadPool::new(n).map_err(|source| Error::Threads { threads: n, source })?);
    pools.insert(n, Arc::clone(&pool));
    Ok(pool)
}

#[derive(Debug)]
pub(crate) struct Layer {
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) wq: QWeight,
    pub(crate) wk: QWeight,
    pub(crate) wv: QWeight,
    pub(crate) bias: Option<[Vec<f32>; 3]>,
    pub(crate) wo: QWeight,
    pub(crate) ffn_norm: Vec<f32>,
    pub(crate) w_gate: QWeight,
    pub(crate) w_up: QWeight,
    pub(crate) w_down: QWeight,
}

/// A loaded model.
#[derive(Debug)]
pub struct Model {
    config: ModelConfig,
    pub(crate) embd: QWeight,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Vec<f32>,
    /// `None` when the output projection is tied to the embedding.
    pub(crate) output: Option<QWeight>,
    /// The rope frequency of each dimension pair, scaling included (see [`inv_freq`]).
    inv_freq: Vec<f64>,
    /// The threads the matrix kernels run on.
    pool: Arc<ThreadPool>,
    /// Tokens `0..logits_vocab` are scored (the whole vocabulary unless restricted at load).
    logits_vocab: usize,
    /// And these, past `logits_vocab` ([`LoadOptions::logits_also`]), ascending.
    pub(crate) logits_also: Vec<u32>,
    /// The weights on a GPU, which then runs every pass ([`LoadOptions::device`]).
    #[cfg(feature = "cuda")]
    gpu: Option<crate::cuda::Gpu>,
}

/// The type [`LoadOptions::requantize`] gives a matrix of `cols` columns when it asks for `t`: `t`
/// itself, or Q4_0 (as many bits per weight as Q4_K) where `t` is a K-quant whose 256-value
/// super-blocks do not divide the rows (the 0.5B draft's 896-wide matrices; llama.cpp's quantiser
/// falls back to Q5_0 there, a draft wants the bytes); `None`, keeping the file's type, where not
/// even Q4_0's 32-value blocks divide them (a float matrix of another width).
pub fn requantized_type(t: GgmlDType, cols: usize) -> Option<GgmlDType> {
    [t, GgmlDType::Q4_0]
        .into_iter()
        .find(|t| cols.is_multiple_of(t.block_size()))
}

impl Model {
    /// Loads a GGUF model.
    pub fn load(path: impl AsRef<Path>, options: &LoadOptions) -> Result<Self> {
        let g = Gguf::open(path)?;
        Self::from_gguf(&g, options)
    }

    /// Loads the weights of an open GGUF file.
    pub fn from_gguf(g: &Gguf, options: &LoadOptions) -> Result<Self> {
        #[cfg(not(feature = "cuda"))]
        if let Device::Cuda(_) = options.device {
            // Before the weights are read: a large model would take seconds to refuse.
            return Err(Error::NoCuda);
        }
        let c = ModelConfig::from_gguf(g)?;
        check_tensors(g, &c)?;
        let prep = |w: QWeight| -> Result<QWeight> {
            match options
                .requantize
                .and_then(|t| requantized_type(t, w.cols()))
            {
                Some(t) if w.dtype() != t => return w.requantize(t),
                Some(_) => return Ok(w),
                None => {}
            }
            if options.requantize_q5 && w.dtype() == GgmlDType::Q5_1 {
                w.requantize(GgmlDType::Q8_0)
            } else {
                Ok(w)
            }
        };
        let mat = |name: &str, rows: usize, cols: usize| g.matrix(name, rows, cols).and_then(prep);
        let embd = g.matrix("token_embd.weight", c.vocab, c.n_embd)?;
        let embd = match options
            .requantize
            .and_then(|t| requantized_type(t, embd.cols()))
        {
            Some(t) if embd.dtype() != t => embd.requantize(t)?,
            _ => embd,
        };
        let mut layers = Vec::with_capacity(c.n_layer);
        for i in 0..c.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            let bias = if c.qkv_bias {
                Some([
                    g.vector(&n("attn_q.bias"), c.q_dim())?,
                    g.vector(&n("attn_k.bias"), c.kv_dim())?,
                    g.vector(&n("attn_v.bias"), c.kv_dim())?,
                ])
            } else {
                None
            };
            layers.push(Layer {
                attn_norm: g.vector(&n("attn_norm.weight"), c.n_embd)?,
                wq: mat(&n("attn_q.weight"), c.q_dim(), c.n_embd)?,
                wk: mat(&n("attn_k.weight"), c.kv_dim(), c.n_embd)?,
                wv: mat(&n("attn_v.weight"), c.kv_dim(), c.n_embd)?,
                bias,
                wo: mat(&n("attn_output.weight"), c.n_embd, c.q_dim())?,
                ffn_norm: g.vector(&n("ffn_norm.weight"), c.n_embd)?,
                w_gate: mat(&n("ffn_gate.weight"), c.n_ff, c.n_embd)?,
                w_up: mat(&n("ffn_up.weight"), c.n_ff, c.n_embd)?,
                w_down: mat(&n("ffn_down.weight"), c.n_embd, c.n_ff)?,
            });
        }
        let output = if g.has_tensor("output.weight") {
            Some(mat("output.weight", c.vocab, c.n_embd)?)
        } else {
            None
        };
        let rope_freqs = if g.has_tensor(ROPE_FREQS) {
            let f = g.vector(ROPE_FREQS, c.rope_dim / 2)?;
            if !f.iter().all(|x| x.is_finite() && *x > 0.0) {
                return Err(Error::BadTensor {
                    path: g.path().to_path_buf(),
                    name: ROPE_FREQS.to_string(),
                    expected: "positive, finite rope frequency factors",
                });
            }
            Some(f)
        } else {
            None
        };
        let inv_freq = inv_freq(&c, rope_freqs.as_deref());
        let pool = thread_pool(options.threads)?;
        let logits_vocab = match options.logits_vocab {
            None => c.vocab,
            Some(n) if (1..=c.vocab).contains(&n) => n,
            Some(n) => {
                return Err(Error::LogitsVocab {
                    limit: n,
                    vocab: c.vocab,
                })
            }
        };
        if let Some(&id) = options
            .logits_also
            .iter()
            .find(|&&id| id as usize >= c.vocab)
        {
            return Err(Error::LogitsAlso { id, vocab: c.vocab });
        }
        // Only the ids the prefix leaves out, ascending.
        let mut logits_also: Vec<u32> = options
            .logits_also
            .iter()
            .copied()
            .filter(|&id| id as usize >= logits_vocab)
            .collect();
        logits_also.sort_unstable();
        logits_also.dedup();
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut model = Self {
            pool,
            logits_vocab,
            logits_also,
            norm: g.vector("output_norm.weight", c.n_embd)?,
            config: c,
            embd,
            layers,
            output,
            inv_freq,
            #[cfg(feature = "cuda")]
            gpu: None,
        };
        match options.device {
            Device::Cpu => {}
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => model.gpu = Some(crate::cuda::Gpu::new(&model, ordinal)?),
            // Refused before the weights were read (above); kept for the match.
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => return Err(Error::NoCuda),
        }
        Ok(model)
    }

    /// Where the forward pass runs, and the GPU's name when on one.
    pub fn device(&self) -> (Device, Option<&str>) {
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.gpu {
            return (Device::Cuda(g.ordinal()), Some(g.device_name()));
        }
        (Device::Cpu, None)
    }

    /// Whether the forward pass runs on a GPU.
    fn on_device(&self) -> bool {
        self.device().0 != Device::Cpu
    }

    /// The threads of the matrix kernels (and of the GPU path's load).
    #[cfg(feature = "cuda")]
    pub(crate) fn pool(&self) -> &ThreadPool {
        &self.pool
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Tokens `0..n` get real logits ([`LoadOptions::logits_vocab`]); `n` is the vocabulary size
    /// unless restricted.
    pub fn logits_vocab(&self) -> usize {
        self.logits_vocab
    }

    /// The token ids scored past [`Model::logits_vocab`] ([`LoadOptions::logits_also`]), ascending.
    pub fn logits_also(&self) -> &[u32] {
        &self.logits_also
    }

    /// Bytes of weights held.
    pub fn weight_bytes(&self) -> usize {
        self.layer_bytes()
            + self.embd.size_in_bytes()
            + self.output.as_ref().map_or(0, QWeight::size_in_bytes)
    }

    /// Bytes of every layer's matrices.
    fn layer_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| {
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                    .iter()
                    .map(|w| w.size_in_bytes())
                    .sum::<usize>()
            })
            .sum()
    }

    /// Bytes of weights a decode step reads: every layer's matrices and the rows of the output
    /// matrix (the embedding table when tied) that are scored ([`Model::logits_vocab`]); of the
    /// embedding table otherwise only a row, which is left out.
    pub fn step_bytes(&self) -> usize {
        let output = self.output.as_ref().unwrap_or(&self.embd);
        let vocab = self.config().vocab.max(1);
        self.layer_bytes()
            + output.size_in_bytes() / vocab * (self.logits_vocab + self.logits_also.len())
    }

    /// The distinct types of the matrices as loaded (after any re-quantisation), embedding and
    /// output included: the kernels a forward pass runs.
    pub fn matrix_types(&self) -> Vec<GgmlDType> {
        let mut types: Vec<GgmlDType> = Vec::new();
        let layers = self
            .layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]);
        for w in layers.chain([&self.embd]).chain(self.output.as_ref()) {
            if !types.contains(&w.dtype()) {
                types.push(w.dtype());
            }
        }
        types
    }

    /// A KV cache sized for this model (on its GPU when it is on one).
    pub fn cache(&self, capacity: usize) -> KvCache {
        #[cfg(feature = "cuda")]
        if self.gpu.is_some() {
            return KvCache::on_device(
                self.config.n_layer,
                self.config.n_head_kv,
                self.config.head_dim,
                capacity,
            );
        }
        KvCache::new(
            self.config.n_layer,
            self.config.n_head_kv,
            self.config.head_dim,
            capacity,
        )
    }

    /// Runs `tokens` at positions `cache.len()..`, appending their keys and values to `cache`, and
    /// writes into `logits` the logits of the last `logits_rows` positions (`[logits_rows, vocab]`).
    pub fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        logits_rows: usize,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        // The buffers of the last pass, grown if this block is larger, and put back at the end.
        let mut sc = std::mem::take(&mut cache.scratch);
        let r = self.forward_parts(
            &mut [Part {
                cache: &mut *cache,
                tokens,
                logits_rows,
                logits,
            }],
            &mut sc,
        );
        cache.scratch = sc;
        r
    }

    /// [`Model::forward`] for several sequences at once: the rows of every part go through the
    /// matrices together (one read of the weights for all of them), and each part's rows attend to
    /// its own cache. Row-independence makes every part's logits exactly those of a pass of its own.
    /// On an error no cache is marked longer.
    pub(crate) fn forward_parts(&self, parts: &mut [Part<'_>], sc: &mut Scratch) -> Result<()> {
        let c = &self.config;
        let mut m = 0;
        let mut wanted = 0;
        for p in parts.iter() {
            if p.cache.shape() != (c.n_layer, c.n_head_kv, c.head_dim, self.on_device()) {
                return Err(Error::CacheShape);
            }
            p.cache.reserve(p.cache.len(), p.tokens.len())?;
            if p.logits_rows > p.tokens.len() {
                return Err(Error::RowsOutOfRange {
                    rows: p.logits_rows,
                    tokens: p.tokens.len(),
                });
            }
            if let Some(&t) = p.tokens.iter().find(|&&t| t as usize >= c.vocab) {
                return Err(Error::TokenOutOfRange {
                    token: t,
                    vocab: c.vocab,
                });
            }
            m += p.tokens.len();
            wanted += p.logits_rows;
        }
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.gpu {
            return g.forward_parts(self, parts, m, wanted);
        }
        let d = c.n_embd;
        let Scratch {
            x,
            h,
            q,
            k,
            v,
            attn,
            o,
            gate,
            up,
            cos,
            sin,
            acts,
            logits: all_logits,
            scores,
        } = sc;
        for (buf, len) in [
            (&mut *x, m * d),
            (&mut *h, m * d),
            (&mut *q, m * c.q_dim()),
            (&mut *k, m * c.kv_dim()),
            (&mut *v, m * c.kv_dim()),
            (&mut *attn, m * c.q_dim()),
            (&mut *o, m * d),
            (&mut *gate, m * c.n_ff),
            (&mut *up, m * c.n_ff),
        ] {
            buf.clear();
            buf.resize(len, 0.0);
        }
        let tokens = parts.iter().flat_map(|p| p.tokens.iter());
        // Every token was checked against the vocabulary above.
        for (row, &t) in x.chunks_exact_mut(d).zip(tokens) {
            self.embd.row_into(t as usize, row)?;
        }
        cos.clear();
        sin.clear();
        for p in parts.iter() {
            self.rope_table(p.cache.len(), p.tokens.len(), cos, sin);
        }
        let pool = &*self.pool;
        let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
        // The spans below (one per stage of a layer, and the logits) cost nothing unless a
        // subscriber listens at trace level: `examples/step_time.rs` times them with
        // `STEP_TIME_PROFILE=1`.
        for (li, l) in self.layers.iter().enumerate() {
            let _span = tracing::trace_span!("layer", li).entered();
            let stage = tracing::trace_span!("qkv").entered();
            rms_norm(x, &l.attn_norm, c.rms_eps, h);
            let mut hq = Activations::new(h, m, acts);
            QWeight::matmul_many(&mut hq, [(&l.wq, &mut **q), (&l.wk, k), (&l.wv, v)], pool)?;
            if let Some([bq, bk, bv]) = &l.bias {
                add_rows(q, bq);
                add_rows(k, bk);
                add_rows(v, bv);
            }
            self.apply_rope(q, c.n_head, cos, sin);
            self.apply_rope(k, c.n_head_kv, cos, sin);
            drop(stage);
            let stage = tracing::trace_span!("attention").entered();
            let mut row = 0;
            for p in parts.iter_mut() {
                let (pos, n) = (p.cache.len(), p.tokens.len());
                let (a, b) = (row, row + n);
                p.cache.write(
                    li,
                    pos,
                    &k[a * kv_dim..b * kv_dim],
                    &v[a * kv_dim..b * kv_dim],
                );
                let (keys, values) = p.cache.layer(li);
                attention(
                    c,
                    &q[a * q_dim..b * q_dim],
                    (keys, values, p.cache.head_stride()),
                    pos,
                    &mut attn[a * q_dim..b * q_dim],
                    scores,
                    pool,
                );
                row = b;
            }
            drop(stage);
            let stage = tracing::trace_span!("wo").entered();
            l.wo.matmul(&mut Activations::new(attn, m, acts), o, pool)?;
            add(x, o);
            drop(stage);
            let stage = tracing::trace_span!("gate_up").entered();
            rms_norm(x, &l.ffn_norm, c.rms_eps, h);
            let mut hq = Activations::new(h, m, acts);
            QWeight::matmul_many(&mut hq, [(&l.w_gate, &mut **gate), (&l.w_up, up)], pool)?;
            swiglu(gate, up, pool);
            drop(stage);
            let _stage = tracing::trace_span!("down").entered();
            l.w_down
                .matmul(&mut Activations::new(gate, m, acts), o, pool)?;
            add(x, o);
        }
        let _stage = tracing::trace_span!("logits").entered();
        // The final norm of the rows whose logits are asked, into `h` (free now).
        let mut row = 0;
        let mut at = 0;
        for p in parts.iter() {
            let n = p.tokens.len();
            let last = &x[(row + n - p.logits_rows) * d..(row + n) * d];
            rms_norm(
                last,
                &self.norm,
                c.rms_eps,
                &mut h[at * d..(at + p.logits_rows) * d],
            );
            row += n;
            at += p.logits_rows;
        }
        let normed = &mut h[..wanted * d];
        let out = self.output.as_ref().unwrap_or(&self.embd);
        let mut acts = Activations::new(normed, wanted, acts);
        if let [p] = parts {
            // One part: straight into its buffer.
            // Every element is written below: no need to zero the buffer first.
            p.logits.resize(wanted * c.vocab, 0.0);
            out.matmul_prefix(
                &mut acts,
                self.logits_vocab,
                &self.logits_also,
                p.logits,
                pool,
            )?;
        } else {
            all_logits.resize(wanted * c.vocab, 0.0);
            out.matmul_prefix(
                &mut acts,
                self.logits_vocab,
                &self.logits_also,
                all_logits,
                pool,
            )?;
            let mut at = 0;
            for p in parts.iter_mut() {
                let n = p.logits_rows * c.vocab;
                p.logits.clear();
                p.logits.extend_from_slice(&all_logits[at..at + n]);
                at += n;
            }
        }
        for p in parts.iter_mut() {
            let len = p.cache.len() + p.tokens.len();
            p.cache.set_len(len);
        }
        Ok(())
    }

    /// `(cos, sin)` of every rope angle of positions `pos..pos + m`: `[m, rope_dim / 2]` each.
    /// Appended to `cos` and `sin`.
    pub(crate) fn rope_table(&self, pos: usize, m: usize, cos: &mut Vec<f32>, sin: &mut Vec<f32>) {
        for p in pos..pos + m {
            for &f in &self.inv_freq {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
    }

    /// Rotates the first `rope_dim` dimensions of each head of each row of `x` (`[m, heads * hd]`).
    fn apply_rope(&self, x: &mut [f32], heads: usize, cos: &[f32], sin: &[f32]) {
        let c = &self.config;
        let half = c.rope_dim / 2;
        for (row, (cr, sr)) in x
            .chunks_exact_mut(heads * c.head_dim)
            .zip(cos.chunks_exact(half).zip(sin.chunks_exact(half)))
        {
            for head in row.chunks_exact_mut(c.head_dim) {
                for i in 0..half {
                    let (a, b) = match c.rope_style {
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                        RopeStyle::Neox => (i, i + half),
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * cr[i] - x1 * sr[i];
                    head[b] = x0 * sr[i] + x1 * cr[i];
                }
            }
        }
    }
}

/// The buffers of a forward pass, kept with the KV cache so that a pass allocates nothing once they
/// have grown to the largest block seen.
#[derive(Clone, Debug, Default)]
pub(crate) struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    acts: ActivationBuffers,
    /// The logits of every part of a multi-part pass, before they are split.
    logits: Vec<f32>,
    /// Attention scores ([`attention`]).
    scores: Vec<f32>,
}

/// One sequence's share of [`Model::forward_parts`].
#[derive(Debug)]
pub(crate) struct Part<'a> {
    /// Its cache: the tokens go at positions `cache.len()..`.
    pub cache: &'a mut KvCache,
    /// Its tokens.
    pub tokens: &'a [u32],
    /// Logits of this many last positions...
    pub logits_rows: usize,
    /// ...written here (`[logits_rows, vocab]`).
    pub logits: &'a mut Vec<f32>,
}

/// Per-dimension-pair divisors of the rope frequencies (Llama 3.1 and later), `[rope_dim / 2]`.
const ROPE_FREQS: &str = "rope_freqs.weight";

/// The rope frequency of pair `i`, as llama.cpp's `rope_ext`:
/// `freq_scale * base^(-2i / rope_dim) / factor_i`, with `freq_scale = 1 / linear factor` and
/// `factor_i` from `rope_freqs.weight` (1 without it). The angle of position `p` is `p * inv_freq[i]`.
fn inv_freq(c: &ModelConfig, factors: Option<&[f32]>) -> Vec<f64> {
    let scale = c.rope_scaling.freq_scale();
    (0..c.rope_dim / 2)
        .map(|i| {
            let f = scale * f64::from(c.rope_theta).powf(-(2.0 * i as f64) / c.rope_dim as f64);
            factors.map_or(f, |ff| f / f64::from(ff[i]))
        })
        .collect()
}

/// Rejects tensors the forward pass would not read: a model that carries them (q/k norms, output
/// biases, a second set of experts, ...) needs something this runtime does not implement.
fn check_tensors(g: &Gguf, c: &ModelConfig) -> Result<()> {
    let mut known: HashSet<String> = ["token_embd.weight", "output_norm.weight", "output.weight"]
        .into_iter()
        .map(String::from)
        .collect();
    if c.arch == Arch::Llama {
        // Per-dimension rope factors are a Llama 3.1+ tensor; llama.cpp refuses them elsewhere.
        known.insert(ROPE_FREQS.to_string());
    }
    let per_layer: &[&str] = &[
        "attn_norm.weight",
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_output.weight",
        "ffn_norm.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
    ];
    let biases: &[&str] = if c.qkv_bias {
        &["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    } else {
        &[]
    };
    for i in 0..c.n_layer {
        known.extend(
            per_layer
                .iter()
                .chain(biases)
                .map(|s| format!("blk.{i}.{s}")),
        );
    }
    let mut unknown: Vec<&String> = g
        .content()
        .tensor_infos
        .keys()
        .filter(|n| !known.contains(*n))
        .collect();
    unknown.sort();
    match unknown.first() {
        Some(name) => Err(Error::UnsupportedTensor {
            path: g.path().to_path_buf(),
            name: name.to_string(),
        }),
        None => Ok(()),
    }
}

/// A dot product with 8 independent accumulators combined in a fixed order (the same values whether
/// the compiler vectorises it or not).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `gate ← silu(gate) · up`, on `pool`'s threads once there are enough values to pay for a job, in
/// 256-bit vectors where the CPU has AVX2 (the same operations, so the same bits: nothing is fused).
fn swiglu(gate: &mut [f32], up: &[f32], pool: &ThreadPool) {
    let chunk = gate.len().div_ceil(4 * pool.threads()).max(4096);
    let avx2 = Kernels::get().level().has_avx2();
    pool.for_chunks_mut(gate, chunk, &|start, part| {
        let up = &up[start..];
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: levels with AVX2 are only chosen on CPUs with AVX2.
            unsafe { swiglu_avx2(part, up) };
            return;
        }
        let _ = avx2;
        swiglu_part(part, up);
    });
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn swiglu_avx2(gate: &mut [f32], up: &[f32]) {
    swiglu_part(gate, up);
}

#[inline(always)]
fn swiglu_part(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + exp(-*g)) * u;
    }
}

/// `e^x` within 4 ulp (3 measured), for `x` clamped to `[-87, 88]` (where `e^x` is a normal `f32`), in plain
/// `f32` and integer operations (no fused multiply-add, no table, no call), so that a loop of it
/// vectorises and gives the same bits at every CPU level. Cody–Waite reduction `x = n ln 2 + r`,
/// `|r| ≤ ln 2 / 2`, then a degree-6 Taylor polynomial of `e^r` and `2^n` built from its bits.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    // 1.5 · 2^23: adding it rounds to an integer (to nearest even) and leaves that integer in the low
    // bits of the sum.
    const ROUND: f32 = 12_582_912.0;
    // ln 2 = LN2_HI + LN2_LO, with LN2_HI short enough that `n · LN2_HI` is exact for |n| ≤ 127.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let t = x * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // n in -126..=127, so 2^n is a normal f32.
    let n = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    p * f32::from_bits(((n + 127) << 23) as u32)
}

/// Row-wise RMS norm: `out = x / sqrt(mean(x²) + eps) * w`.
fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f32 = dot(xr, xr) / d as f32;
        let s = 1.0 / (ss + eps).sqrt();
        for ((o, &xv), &wv) in or.iter_mut().zip(xr).zip(w) {
            *o = xv * s * wv;
        }
    }
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Adds `bias` to every row of `x`.
fn add_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add(row, bias);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print() {
        for (s, d) in [
            ("cpu", Device::Cpu),
            ("cuda", Device::Cuda(0)),
            ("cuda:3", Device::Cuda(3)),
        ] {
            assert_eq!(s.parse::<Device>(), Ok(d));
        }
        assert_eq!(Device::Cuda(0).to_string(), "cuda:0");
        assert_eq!(Device::Cpu.to_string(), "cpu");
        for bad in [
            "gpu", "cuda:", "cuda:x", "cuda:-1", "cuda:+1", "cuda: 1", "",
        ] {
            let e = bad.parse::<Device>().unwrap_err();
            assert!(e.contains("cpu, cuda or cuda:N"), "{bad}: {e}");
        }
    }

    #[test]
    fn exp_is_within_four_ulp_of_the_library_over_its_range() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = f64::from(x).exp();
            let got = f64::from(exp(x));
            // One ulp of the true value.
            let ulp = f64::from(f32::EPSILON) * 2f64.powi(want.log2().floor() as i32);
            worst = worst.max((got - want).abs() / ulp);
            x += 0.000_37;
        }
        assert!(worst <= 4.0, "worst error {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-1000.0), exp(-87.0));
        assert!(exp(-87.0) > 0.0 && exp(-87.0).is_normal());
    }

    use crate::config::{Arch, RopeScaling};

    fn config(rope_scaling: RopeScaling) -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            name: String::new(),
            n_layer: 1,
            n_embd: 8,
            n_head: 1,
            n_head_kv: 1,
            head_dim: 8,
            n_ff: 8,
            rope_theta: 10_000.0,
            rope_dim: 8,
            rope_style: RopeStyle::Interleaved,
            rope_scaling,
            rms_eps: 1e-6,
            ctx_train: 16,
            vocab: 8,
            qkv_bias: false,
        }
    }

    #[test]
    fn inv_freq_follows_llama_cpp() {
        let plain = inv_freq(&config(RopeScaling::None), None);
        for (i, f) in plain.iter().enumerate() {
            assert!((f - 10f64.powi(-(i as i32))).abs() < 1e-15, "{i}: {f}");
        }
        let ones = inv_freq(&config(RopeScaling::None), Some(&[1.0; 4]));
        assert_eq!(ones, plain, "factors of 1 change nothing, bit for bit");
        let linear1 = inv_freq(&config(RopeScaling::Linear { factor: 1.0 }), None);
        assert_eq!(linear1, plain);
        let linear = inv_freq(&config(RopeScaling::Linear { factor: 4.0 }), None);
        let factors = inv_freq(&config(RopeScaling::None), Some(&[1.0, 2.0, 4.0, 8.0]));
        for i in 0..4 {
            assert_eq!(linear[i], plain[i] / 4.0);
            assert_eq!(factors[i], plain[i] / f64::from(1u32 << i));
        }
    }
}
