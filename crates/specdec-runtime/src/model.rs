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
use specdec_kernels::f16::f16_to_f32;
use specdec_kernels::{Kernels, ThreadPool};

use crate::config::{Arch, ModelConfig, RopeStyle};
use crate::error::{Error, Result};
use crate::gguf::Gguf;
use crate::kv::{KvCache, KEY_TILE};
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
    /// Re-quantise every matrix (the embedding table included, which a tied output matrix reads) to
    /// this type at load, when it is another: fewer bytes per step for a draft model, at some cost
    /// in acceptance. A K-quant applies to matrices whose rows are whole 256-value super-blocks; the
    /// others go to Q4_0 ([`requantized_type`]). `None` keeps the file's types.
    pub requantize: Option<GgmlDType>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            requantize_q5: true,
            threads: None,
            logits_vocab: None,
            requantize: None,
        }
    }
}

/// The kernel thread pool of `threads` threads (one per core for `None`), shared by every model that
/// asks for the same count: the draft and the target never run at the same time, and one pool's
/// workers do not compete with another's for the cores.
pub fn thread_pool(threads: Option<usize>) -> Result<Arc<ThreadPool>> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Arc<ThreadPool>>>> = OnceLock::new();
    let n = threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
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
struct Layer {
    attn_norm: Vec<f32>,
    wq: QWeight,
    wk: QWeight,
    wv: QWeight,
    bias: Option<[Vec<f32>; 3]>,
    wo: QWeight,
    ffn_norm: Vec<f32>,
    w_gate: QWeight,
    w_up: QWeight,
    w_down: QWeight,
}

/// A loaded model.
#[derive(Debug)]
pub struct Model {
    config: ModelConfig,
    embd: QWeight,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    /// `None` when the output projection is tied to the embedding.
    output: Option<QWeight>,
    /// The rope frequency of each dimension pair, scaling included (see [`inv_freq`]).
    inv_freq: Vec<f64>,
    /// The threads the matrix kernels run on.
    pool: Arc<ThreadPool>,
    /// Tokens `0..logits_vocab` are scored (the whole vocabulary unless restricted at load).
    logits_vocab: usize,
}

/// The type [`LoadOptions::requantize`] gives a matrix of `cols` columns when it asks for `t`: `t`
/// itself, or Q4_0 (as many bits per weight as Q4_K) where `t` is a K-quant whose 256-value
/// super-blocks do not divide the rows (the 0.5B draft's 896-wide matrices; llama.cpp's quantiser
/// falls back to Q5_0 there, a draft wants the bytes).
pub fn requantized_type(t: GgmlDType, cols: usize) -> GgmlDType {
    if cols.is_multiple_of(t.block_size()) {
        t
    } else {
        GgmlDType::Q4_0
    }
}

impl Model {
    /// Loads a GGUF model.
    pub fn load(path: impl AsRef<Path>, options: &LoadOptions) -> Result<Self> {
        let g = Gguf::open(path)?;
        Self::from_gguf(&g, options)
    }

    /// Loads the weights of an open GGUF file.
    pub fn from_gguf(g: &Gguf, options: &LoadOptions) -> Result<Self> {
        let c = ModelConfig::from_gguf(g)?;
        check_tensors(g, &c)?;
        let prep = |w: QWeight| -> Result<QWeight> {
            match options.requantize.map(|t| requantized_type(t, w.cols())) {
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
        let embd = match options.requantize.map(|t| requantized_type(t, embd.cols())) {
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
        Ok(Self {
            pool,
            logits_vocab,
            norm: g.vector("output_norm.weight", c.n_embd)?,
            config: c,
            embd,
            layers,
            output,
            inv_freq,
        })
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
        self.layer_bytes() + output.size_in_bytes() / vocab * self.logits_vocab
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

    /// A KV cache sized for this model.
    pub fn cache(&self, capacity: usize) -> KvCache {
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
            p.cache.reserve(p.cache.len(), p.tokens.len())?;
            if p.logits_rows > p.tokens.len() {
                return Err(Error::RowsOutOfRange {
                    rows: p.logits_rows,
                    tokens: p.tokens.len(),
                });
            }
            m += p.tokens.len();
            wanted += p.logits_rows;
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
        for (row, &t) in x.chunks_exact_mut(d).zip(tokens) {
            if t as usize >= c.vocab {
                return Err(Error::TokenOutOfRange {
                    token: t,
                    vocab: c.vocab,
                });
            }
            self.embd.row_into(t as usize, row)?;
        }
        cos.clear();
        sin.clear();
        for p in parts.iter() {
            self.rope_table(p.cache.len(), p.tokens.len(), cos, sin);
        }
        let pool = &*self.pool;
        let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
        for (li, l) in self.layers.iter().enumerate() {
            let _span = tracing::trace_span!("layer", li).entered();
            rms_norm(x, &l.attn_norm, c.rms_eps, h);
            let mut hq = Activations::new(h, m, acts);
            l.wq.matmul(&mut hq, q, pool)?;
            l.wk.matmul(&mut hq, k, pool)?;
            l.wv.matmul(&mut hq, v, pool)?;
            if let Some([bq, bk, bv]) = &l.bias {
                add_rows(q, bq);
                add_rows(k, bk);
                add_rows(v, bv);
            }
            self.apply_rope(q, c.n_head, cos, sin);
            self.apply_rope(k, c.n_head_kv, cos, sin);
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
            l.wo.matmul(&mut Activations::new(attn, m, acts), o, pool)?;
            add(x, o);
            rms_norm(x, &l.ffn_norm, c.rms_eps, h);
            let mut hq = Activations::new(h, m, acts);
            l.w_gate.matmul(&mut hq, gate, pool)?;
            l.w_up.matmul(&mut hq, up, pool)?;
            swiglu(gate, up, pool);
            l.w_down
                .matmul(&mut Activations::new(gate, m, acts), o, pool)?;
            add(x, o);
        }
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
            out.matmul_prefix(&mut acts, self.logits_vocab, p.logits, pool)?;
        } else {
            all_logits.resize(wanted * c.vocab, 0.0);
            out.matmul_prefix(&mut acts, self.logits_vocab, all_logits, pool)?;
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
    fn rope_table(&self, pos: usize, m: usize, cos: &mut Vec<f32>, sin: &mut Vec<f32>) {
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

/// Causal attention for rows at positions `pos..pos + m`: row `i` attends to keys `0..=pos + i`
/// exactly, in order, with no mask, so its result is independent of the other rows.
///
/// Two jobs on `pool` per [`ATTN_ROWS`] rows. Scores: the query heads that share a KV head, of all
/// the rows, in batches of at most [`BATCH_HEADS`], each batch reading the KV head's key tiles once
/// ([`HalfOps::score_tile`]). Then per (row, KV head): the softmax of each query head's scores, and
/// the weighted sums of the values, [`VALUE_LANES`] elements of every query head of the KV head at a
/// time, each value read once for all of them ([`HalfOps::value_lanes`]). Every score and every output
/// element is one sum in a fixed order, whichever batch, item or thread computes it.
#[allow(clippy::too_many_arguments)]
fn attention(
    c: &ModelConfig,
    q: &[f32],
    (keys, values, head_stride): (&[u16], &[u16], usize),
    pos: usize,
    out: &mut [f32],
    scores: &mut Vec<f32>,
    pool: &ThreadPool,
) {
    let q_dim = c.q_dim();
    let m = q.len() / q_dim;
    let avx2 = Kernels::get().level().has_avx2();
    for first in (0..m).step_by(ATTN_ROWS) {
        let rows = ATTN_ROWS.min(m - first);
        let at = first * q_dim..(first + rows) * q_dim;
        let job = AttentionRows {
            c,
            q: &q[at.clone()],
            keys,
            values,
            head_stride,
            pos: pos + first,
            span: pos + first + rows,
        };
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            job.run::<Avx2>(&mut out[at], scores, pool);
            continue;
        }
        let _ = avx2;
        job.run::<Portable>(&mut out[at], scores, pool);
    }
}

/// Rows of one [`attention`] call handled together (bounding the score buffer to `ATTN_ROWS ·
/// n_head · context` values).
const ATTN_ROWS: usize = 16;

/// The most query heads whose sums attention keeps in registers at once (two 8-lane vectors each).
const BATCH_HEADS: usize = 6;

/// Output elements of a query head that [`HalfOps::value_lanes`] computes at once.
const VALUE_LANES: usize = 16;

/// `f(H)` dispatched on a batch's number of heads (1 ..= [`BATCH_HEADS`]).
macro_rules! by_heads {
    ($n:expr, $f:ident::<$l:ty>($($arg:expr),*)) => {
        match $n {
            1 => $f::<$l, 1>($($arg),*),
            2 => $f::<$l, 2>($($arg),*),
            3 => $f::<$l, 3>($($arg),*),
            4 => $f::<$l, 4>($($arg),*),
            5 => $f::<$l, 5>($($arg),*),
            _ => $f::<$l, BATCH_HEADS>($($arg),*),
        }
    };
}

/// `0..n` in `n.div_ceil(BATCH_HEADS)` ranges of as even a size as possible.
fn batches(n: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let k = n.div_ceil(BATCH_HEADS);
    (0..k).map(move |b| b * n / k..(b + 1) * n / k)
}

/// At most [`ATTN_ROWS`] rows of [`attention`], the first at position `pos`.
struct AttentionRows<'a> {
    c: &'a ModelConfig,
    /// `[rows, q_dim]`.
    q: &'a [f32],
    keys: &'a [u16],
    values: &'a [u16],
    head_stride: usize,
    pos: usize,
    /// Keys visible to the last row: the length of a row of scores.
    span: usize,
}

impl AttentionRows<'_> {
    fn run<L: HalfOps>(&self, out: &mut [f32], scores: &mut Vec<f32>, pool: &ThreadPool) {
        let c = self.c;
        let (group, q_dim) = (c.n_head / c.n_head_kv, c.q_dim());
        let m = self.q.len() / q_dim;
        // Row `i`, query head `h`: scores at `(i · n_head + h) · span ..`, the first `pos + i + 1`.
        // Every score read is written first: the buffer only grows, without zeroing it each time.
        let need = m * c.n_head * self.span;
        if scores.len() < need {
            scores.resize(need, 0.0);
        }
        let shared = SharedMut(scores.as_mut_ptr());
        let out_ptr = SharedMut(out.as_mut_ptr());
        let heads = group * c.head_dim;
        if m == 1 {
            // One job: per KV head, its query heads' scores and then their values.
            pool.for_chunks(c.n_head_kv, 1, &|items| {
                let (shared, out_ptr) = (&shared, &out_ptr);
                for kvh in items {
                    // SAFETY: as for the two jobs below: each KV head's score rows and output
                    // values are its own.
                    unsafe {
                        for batch in batches(group) {
                            L::score_batch(self, kvh, batch, shared);
                        }
                        let o = std::slice::from_raw_parts_mut(out_ptr.0.add(kvh * heads), heads);
                        L::weigh_values(self, 0, kvh, shared, o);
                    }
                }
            });
            return;
        }
        // The query heads of one KV head, rows first: (row i, head g) is number `i · group + g`.
        let per_kv = m * group;
        let nb = per_kv.div_ceil(BATCH_HEADS);
        pool.for_chunks(c.n_head_kv * nb, 1, &|items| {
            let shared = &shared;
            for item in items {
                let (kvh, b) = (item / nb, item % nb);
                let heads = batches(per_kv).nth(b).unwrap_or_default();
                // SAFETY: a batch writes only the score rows of its own query heads, disjoint from
                // every other item's, within the buffer, which outlives the job; `L` is only
                // instantiated where the CPU supports it (`attention`).
                unsafe { L::score_batch(self, kvh, heads, shared) };
            }
        });
        pool.for_chunks(m * c.n_head_kv, 1, &|items| {
            let (shared, out_ptr) = (&shared, &out_ptr);
            for item in items {
                let (i, kvh) = (item / c.n_head_kv, item % c.n_head_kv);
                // SAFETY: items are disjoint (row, KV head) pairs: each reads and writes the score
                // rows and the output values of its own query heads, within buffers that outlive
                // the job. `L` as above.
                unsafe {
                    let o = std::slice::from_raw_parts_mut(
                        out_ptr.0.add(i * q_dim + kvh * heads),
                        heads,
                    );
                    L::weigh_values(self, i, kvh, shared, o);
                }
            }
        });
    }

    /// The scores of the query heads `heads` (numbered as in [`AttentionRows::run`]) of KV head
    /// `kvh`, at most [`BATCH_HEADS`].
    ///
    /// # Safety
    /// The CPU must support `L`; `scores` points at the score buffer of [`AttentionRows::run`], of
    /// which no other thread touches these heads' rows meanwhile.
    #[inline(always)]
    unsafe fn score_batch<L: HalfOps>(
        &self,
        kvh: usize,
        heads: std::ops::Range<usize>,
        scores: &SharedMut,
    ) {
        let first = heads.start;
        // SAFETY: the caller's contract.
        unsafe { by_heads!(heads.len(), score_heads::<L>(self, kvh, first, scores)) }
    }

    /// Row `i`'s softmax of the scores of KV head `kvh`'s query heads, then into `out` (`[group,
    /// head_dim]`) the weighted sums of the values, in batches of at most [`BATCH_HEADS`] query
    /// heads.
    ///
    /// # Safety
    /// The CPU must support `L`; `scores` points at the score buffer of [`AttentionRows::run`], of
    /// which no other thread touches these heads' rows of row `i` meanwhile.
    #[inline(always)]
    unsafe fn weigh_values<L: HalfOps>(
        &self,
        i: usize,
        kvh: usize,
        scores: &SharedMut,
        out: &mut [f32],
    ) {
        let c = self.c;
        let (hd, group) = (c.head_dim, c.n_head / c.n_head_kv);
        let n = self.pos + i + 1;
        for g in 0..group {
            let row = (i * c.n_head + kvh * group + g) * self.span;
            // SAFETY: the caller's contract; the first `n` scores of the row are in the buffer.
            let w = unsafe { std::slice::from_raw_parts_mut(scores.0.add(row), n) };
            let max = w.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            // The exponentials first (a loop the compiler vectorises), then their sum.
            for x in w.iter_mut() {
                *x = exp(*x - max);
            }
            let total = sum8(w);
            for x in w.iter_mut() {
                *x /= total;
            }
        }
        for heads in batches(group) {
            let o = &mut out[heads.start * hd..heads.end * hd];
            // SAFETY: the caller's contract.
            unsafe {
                by_heads!(
                    heads.len(),
                    weigh_heads::<L>(self, i, kvh, heads.start, scores, o)
                )
            }
        }
    }
}

/// [`AttentionRows::score_batch`] for the `H` heads from `first`: the KV head's key tiles in order,
/// each scored for all `H` query heads at once.
///
/// # Safety
/// As [`AttentionRows::score_batch`].
#[inline(always)]
unsafe fn score_heads<L: HalfOps, const H: usize>(
    rows: &AttentionRows<'_>,
    kvh: usize,
    first: usize,
    scores: &SharedMut,
) {
    let c = rows.c;
    let (hd, group, q_dim) = (c.head_dim, c.n_head / c.n_head_kv, c.q_dim());
    let scale = 1.0 / (hd as f32).sqrt();
    // Head number `first + h`: row `i`, query head `kvh · group + g`.
    let at = |h: usize| ((first + h) / group, kvh * group + (first + h) % group);
    let q: [&[f32]; H] = std::array::from_fn(|h| {
        let (i, head) = at(h);
        &rows.q[i * q_dim + head * hd..][..hd]
    });
    let n_max = rows.pos + at(H - 1).0 + 1;
    let base = kvh * rows.head_stride;
    let tile_len = KEY_TILE * hd;
    let mut sums = [[0.0f32; KEY_TILE]; H];
    for t in 0..n_max.div_ceil(KEY_TILE) {
        let tile = &rows.keys[base + t * tile_len..][..tile_len];
        if (t + 2) * KEY_TILE < n_max {
            // SAFETY: the caller's contract.
            unsafe { L::prefetch(&rows.keys[base + (t + 2) * tile_len..][..tile_len]) };
        }
        // SAFETY: as above.
        unsafe { L::score_tile(q, tile, &mut sums) };
        for (h, sums) in sums.iter().enumerate() {
            let (i, head) = at(h);
            let keys = t * KEY_TILE..((t + 1) * KEY_TILE).min(rows.pos + i + 1);
            let row = (i * c.n_head + head) * rows.span;
            // SAFETY: keys `..pos + i + 1` of this head's row, its own (the caller's contract).
            let dst = unsafe {
                std::slice::from_raw_parts_mut(scores.0.add(row + keys.start), keys.len())
            };
            for (s, &v) in dst.iter_mut().zip(sums) {
                *s = v * scale;
            }
        }
    }
}

/// The weighted sums of the values for the `H` query heads `first..` of KV head `kvh` (row `i`,
/// weights in place of its scores), into `out` (`[H, head_dim]`): per block of [`VALUE_ROWS`] value
/// rows (read from memory once, then from L1), [`VALUE_LANES`] elements at a time
/// ([`HalfOps::value_lanes`]); then the last `head_dim % VALUE_LANES` elements one by one. Each element
/// adds its rows in order.
///
/// # Safety
/// As [`AttentionRows::weigh_values`].
#[inline(always)]
unsafe fn weigh_heads<L: HalfOps, const H: usize>(
    rows: &AttentionRows<'_>,
    i: usize,
    kvh: usize,
    first: usize,
    scores: &SharedMut,
    out: &mut [f32],
) {
    let c = rows.c;
    let (hd, group) = (c.head_dim, c.n_head / c.n_head_kv);
    let n = rows.pos + i + 1;
    let w: [&[f32]; H] = std::array::from_fn(|h| {
        let row = (i * c.n_head + kvh * group + first + h) * rows.span;
        // SAFETY: the caller's contract; no thread writes these rows meanwhile.
        unsafe { std::slice::from_raw_parts(scores.0.add(row), n) }
    });
    let values = &rows.values[kvh * rows.head_stride..][..n * hd];
    let wide = hd - hd % VALUE_LANES;
    out.fill(0.0);
    for js in (0..n).step_by(VALUE_ROWS) {
        let block = js..(js + VALUE_ROWS).min(n);
        let wb: [&[f32]; H] = std::array::from_fn(|h| &w[h][block.clone()]);
        let vb = &values[block.start * hd..block.end * hd];
        if block.end + VALUE_ROWS <= n {
            // SAFETY: the caller's contract.
            unsafe { L::prefetch(&values[block.end * hd..(block.end + VALUE_ROWS) * hd]) };
        }
        for d in (0..wide).step_by(VALUE_LANES) {
            // SAFETY: as above.
            unsafe { L::value_lanes(wb, vb, hd, d, out) };
        }
    }
    for d in wide..hd {
        for (o, w) in out.chunks_exact_mut(hd).zip(&w) {
            o[d] = w.iter().enumerate().fold(0.0, |a, (j, &wj)| {
                wj.mul_add(f16_to_f32(values[j * hd + d]), a)
            });
        }
    }
}

/// Value rows [`weigh_heads`] applies together (8 KiB of f16 at head size 128).
const VALUE_ROWS: usize = 32;

/// A buffer shared by the threads of one attention job, each touching its own elements.
struct SharedMut(*mut f32);
// SAFETY: the threads touch disjoint elements and the buffer outlives the job (see `attention`).
unsafe impl Sync for SharedMut {}

/// The sum of `w`: eight partial sums of every eighth element, in order, then added in order from the
/// first, then the last `w.len() % 8` elements in order.
#[inline(always)]
fn sum8(w: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = w.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] += c[l];
        }
    }
    rest.iter().fold(acc.iter().sum::<f32>(), |a, &b| a + b)
}

/// The scores of `H` query heads against one tile of [`KEY_TILE`] keys (`tile[d · KEY_TILE + l]` is
/// element `d` of key `l`): `sums[h][l] = Σ_d q[h][d] · key_l[d]`, a fused multiply-add per element
/// in order from `d = 0`. The reference for [`HalfOps::score_tile`].
#[inline(always)]
fn score_tile_portable<const H: usize>(
    q: [&[f32]; H],
    tile: &[u16],
    sums: &mut [[f32; KEY_TILE]; H],
) {
    *sums = [[0.0; KEY_TILE]; H];
    for (d, keys) in tile.chunks_exact(KEY_TILE).take(q[0].len()).enumerate() {
        let keys: [f32; KEY_TILE] = std::array::from_fn(|l| f16_to_f32(keys[l]));
        for (q, sums) in q.iter().zip(sums.iter_mut()) {
            for (s, &k) in sums.iter_mut().zip(&keys) {
                *s = q[d].mul_add(k, *s);
            }
        }
    }
}

/// Adds to elements `d..d + VALUE_LANES` of the weighted sums of `H` query heads (`out` is `[H,
/// hd]`) the value rows `values[j · hd ..][..hd]` weighted by `w[h][j]`: `out[h][d + l] ← fma(w[h][j],
/// value_j[d + l], out[h][d + l])` for j = 0, 1, ... in order. The reference for
/// [`HalfOps::value_lanes`].
#[inline(always)]
fn value_lanes_portable<const H: usize>(
    w: [&[f32]; H],
    values: &[u16],
    hd: usize,
    d: usize,
    out: &mut [f32],
) {
    for j in 0..w[0].len() {
        let v: [f32; VALUE_LANES] = std::array::from_fn(|l| f16_to_f32(values[j * hd + d + l]));
        for (w, o) in w.iter().zip(out.chunks_exact_mut(hd)) {
            for (o, &v) in o[d..d + VALUE_LANES].iter_mut().zip(&v) {
                *o = w[j].mul_add(v, *o);
            }
        }
    }
}

/// The attention loops per CPU level: every implementation gives the same values (widening f16 is
/// exact; each sum is fused multiply-adds in one order).
trait HalfOps {
    /// [`AttentionRows::score_batch`], compiled for the implementation's instructions.
    ///
    /// # Safety
    /// The CPU must support the implementation's instructions; as [`AttentionRows::score_batch`].
    unsafe fn score_batch(
        rows: &AttentionRows<'_>,
        kvh: usize,
        heads: std::ops::Range<usize>,
        scores: &SharedMut,
    );

    /// [`AttentionRows::weigh_values`], compiled for the implementation's instructions.
    ///
    /// # Safety
    /// The CPU must support the implementation's instructions; as [`AttentionRows::weigh_values`].
    unsafe fn weigh_values(
        rows: &AttentionRows<'_>,
        i: usize,
        kvh: usize,
        scores: &SharedMut,
        out: &mut [f32],
    );

    /// [`score_tile_portable`]'s values.
    ///
    /// # Safety
    /// The CPU must support the implementation's instructions.
    unsafe fn score_tile<const H: usize>(
        q: [&[f32]; H],
        tile: &[u16],
        sums: &mut [[f32; KEY_TILE]; H],
    );

    /// [`value_lanes_portable`]'s values.
    ///
    /// # Safety
    /// The CPU must support the implementation's instructions.
    unsafe fn value_lanes<const H: usize>(
        w: [&[f32]; H],
        values: &[u16],
        hd: usize,
        d: usize,
        out: &mut [f32],
    );

    /// Asks for the cache lines of `src` ahead of their use (a hint: no effect on any value).
    ///
    /// # Safety
    /// The CPU must support the implementation's instructions.
    unsafe fn prefetch(src: &[u16]);
}

struct Portable;

impl HalfOps for Portable {
    unsafe fn score_batch(
        rows: &AttentionRows<'_>,
        kvh: usize,
        heads: std::ops::Range<usize>,
        scores: &SharedMut,
    ) {
        // SAFETY: the caller's contract.
        unsafe { rows.score_batch::<Self>(kvh, heads, scores) }
    }

    unsafe fn weigh_values(
        rows: &AttentionRows<'_>,
        i: usize,
        kvh: usize,
        scores: &SharedMut,
        out: &mut [f32],
    ) {
        // SAFETY: the caller's contract.
        unsafe { rows.weigh_values::<Self>(i, kvh, scores, out) }
    }

    #[inline(always)]
    unsafe fn score_tile<const H: usize>(
        q: [&[f32]; H],
        tile: &[u16],
        sums: &mut [[f32; KEY_TILE]; H],
    ) {
        score_tile_portable(q, tile, sums)
    }

    #[inline(always)]
    unsafe fn value_lanes<const H: usize>(
        w: [&[f32]; H],
        values: &[u16],
        hd: usize,
        d: usize,
        out: &mut [f32],
    ) {
        value_lanes_portable(w, values, hd, d, out)
    }

    #[inline(always)]
    unsafe fn prefetch(_: &[u16]) {}
}

#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl HalfOps for Avx2 {
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn score_batch(
        rows: &AttentionRows<'_>,
        kvh: usize,
        heads: std::ops::Range<usize>,
        scores: &SharedMut,
    ) {
        // SAFETY: the caller's contract.
        unsafe { rows.score_batch::<Self>(kvh, heads, scores) }
    }

    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn weigh_values(
        rows: &AttentionRows<'_>,
        i: usize,
        kvh: usize,
        scores: &SharedMut,
        out: &mut [f32],
    ) {
        // SAFETY: the caller's contract.
        unsafe { rows.weigh_values::<Self>(i, kvh, scores, out) }
    }

    /// Two 8-lane vectors of sums per query head, a lane per key: per element `d`, the tile's row
    /// widened once and multiplied into every head's sums with the head's `q[d]` broadcast.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn score_tile<const H: usize>(
        q: [&[f32]; H],
        tile: &[u16],
        sums: &mut [[f32; KEY_TILE]; H],
    ) {
        use std::arch::x86_64::*;
        let hd = q[0].len();
        assert!(tile.len() >= hd * KEY_TILE && q.iter().all(|q| q.len() >= hd));
        let tp = tile.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); 2]; H];
        // SAFETY: `d < hd`, so every load is within `tile` and each `q[h]` (asserted above).
        unsafe {
            for d in 0..hd {
                let row = tp.add(d * KEY_TILE);
                let k0 = _mm256_cvtph_ps(_mm_loadu_si128(row.cast()));
                let k1 = _mm256_cvtph_ps(_mm_loadu_si128(row.add(8).cast()));
                for (a, q) in acc.iter_mut().zip(&q) {
                    let qd = _mm256_set1_ps(*q.get_unchecked(d));
                    a[0] = _mm256_fmadd_ps(qd, k0, a[0]);
                    a[1] = _mm256_fmadd_ps(qd, k1, a[1]);
                }
            }
            for (a, s) in acc.iter().zip(sums.iter_mut()) {
                _mm256_storeu_ps(s.as_mut_ptr(), a[0]);
                _mm256_storeu_ps(s.as_mut_ptr().add(8), a[1]);
            }
        }
    }

    /// Two 8-lane vectors of sums per query head, a lane per output element, loaded from `out` and
    /// stored back: per value row, its 16 elements widened once and multiplied into every head's
    /// sums with the head's weight broadcast.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn value_lanes<const H: usize>(
        w: [&[f32]; H],
        values: &[u16],
        hd: usize,
        d: usize,
        out: &mut [f32],
    ) {
        use std::arch::x86_64::*;
        let n = w[0].len();
        assert!(
            d + VALUE_LANES <= hd
                && values.len() >= n * hd
                && out.len() >= H * hd
                && w.iter().all(|w| w.len() >= n)
        );
        let (vp, op) = (values.as_ptr(), out.as_mut_ptr());
        // SAFETY: `j < n`, `h < H` and `d + 16 <= hd`, so every access is within `values`, `out`
        // and each `w[h]` (asserted above).
        unsafe {
            let mut acc: [[__m256; 2]; H] = std::array::from_fn(|h| {
                let o = op.add(h * hd + d);
                [_mm256_loadu_ps(o), _mm256_loadu_ps(o.add(8))]
            });
            for j in 0..n {
                let row = vp.add(j * hd + d);
                let v0 = _mm256_cvtph_ps(_mm_loadu_si128(row.cast()));
                let v1 = _mm256_cvtph_ps(_mm_loadu_si128(row.add(8).cast()));
                for (a, w) in acc.iter_mut().zip(&w) {
                    let wj = _mm256_set1_ps(*w.get_unchecked(j));
                    a[0] = _mm256_fmadd_ps(wj, v0, a[0]);
                    a[1] = _mm256_fmadd_ps(wj, v1, a[1]);
                }
            }
            for (h, a) in acc.iter().enumerate() {
                let o = op.add(h * hd + d);
                _mm256_storeu_ps(o, a[0]);
                _mm256_storeu_ps(o.add(8), a[1]);
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    unsafe fn prefetch(src: &[u16]) {
        use std::arch::x86_64::*;
        // 32 halves per 64-byte line.
        for i in (0..src.len()).step_by(32) {
            // SAFETY: `i` is within `src`; a prefetch does not fault in any case.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(src.as_ptr().add(i).cast()) };
        }
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
fn exp(x: f32) -> f32 {
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

    use specdec_kernels::f16::f32_to_f16;

    /// Values with very different magnitudes, so that any change of the order of additions shows.
    fn spread(i: usize) -> f32 {
        let x = ((i * 2_654_435_761) % 1_000_003) as f32 / 1_000_003.0 - 0.5;
        x * 10f32.powi((i % 7) as i32 - 3)
    }

    /// The attention levels this CPU can run.
    fn levels() -> Vec<(&'static str, AttnFns)> {
        let mut levels: Vec<(&'static str, AttnFns)> = vec![(
            "portable",
            (
                |q, t, s| unsafe { Portable::score_tile(q, t, s) },
                |w, v, hd, d, s| unsafe { Portable::value_lanes(w, v, hd, d, s) },
            ),
        )];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c")
            && std::arch::is_x86_feature_detected!("fma")
        {
            levels.push((
                "avx2",
                (
                    |q, t, s| unsafe { Avx2::score_tile(q, t, s) },
                    |w, v, hd, d, s| unsafe { Avx2::value_lanes(w, v, hd, d, s) },
                ),
            ));
        }
        levels
    }

    type AttnFns = (
        fn([&[f32]; 3], &[u16], &mut [[f32; KEY_TILE]; 3]),
        fn([&[f32]; 3], &[u16], usize, usize, &mut [f32]),
    );

    #[test]
    fn score_tile_gives_the_reference_bits_at_every_level() {
        for hd in [8, 13, 64, 80, 128] {
            let qs: Vec<Vec<f32>> = (0..3)
                .map(|h| (0..hd).map(|d| spread(d + 1000 * h)).collect())
                .collect();
            let tile: Vec<u16> = (0..hd * KEY_TILE)
                .map(|i| f32_to_f16(spread(i + 7919)))
                .collect();
            // Key `l`'s element `d` is `tile[d * KEY_TILE + l]`; a fused multiply-add per element,
            // in order from the first.
            let want: Vec<Vec<u32>> = qs
                .iter()
                .map(|q| {
                    (0..KEY_TILE)
                        .map(|l| {
                            let mut s = 0.0f32;
                            for (d, &x) in q.iter().enumerate() {
                                s = x.mul_add(f16_to_f32(tile[d * KEY_TILE + l]), s);
                            }
                            s.to_bits()
                        })
                        .collect()
                })
                .collect();
            for (name, (score_tile, _)) in levels() {
                let mut sums = [[0.0f32; KEY_TILE]; 3];
                score_tile([&qs[0], &qs[1], &qs[2]], &tile, &mut sums);
                let got: Vec<Vec<u32>> = sums
                    .iter()
                    .map(|s| s.iter().map(|x| x.to_bits()).collect())
                    .collect();
                assert_eq!(got, want, "{name}, head size {hd}");
            }
        }
    }

    #[test]
    fn sum8_is_eight_partial_sums_in_order() {
        for n in [0, 1, 7, 8, 9, 64, 1000, 1003] {
            let w: Vec<f32> = (0..n).map(|i| spread(i + 11).abs()).collect();
            let mut lanes = [0.0f32; 8];
            for (i, &x) in w.iter().enumerate().take(n - n % 8) {
                lanes[i % 8] += x;
            }
            let mut want = 0.0f32;
            for l in lanes {
                want += l;
            }
            for &x in &w[n - n % 8..] {
                want += x;
            }
            assert_eq!(sum8(&w).to_bits(), want.to_bits(), "{n} values");
        }
    }

    #[test]
    fn value_lanes_add_rows_in_order_at_every_level() {
        for (hd, rows) in [(16, 3), (29, 5), (64, 32), (80, 7), (128, 33), (208, 1)] {
            let ws: Vec<Vec<f32>> = (0..3)
                .map(|h| (0..rows).map(|j| spread(j + 31 + 100 * h).abs()).collect())
                .collect();
            let values: Vec<u16> = (0..rows * hd)
                .map(|i| f32_to_f16(spread(i + 101)))
                .collect();
            let start: Vec<f32> = (0..3 * hd).map(|i| spread(i + 5)).collect();
            for d in (0..hd - hd % VALUE_LANES).step_by(VALUE_LANES) {
                let mut want = start.clone();
                for (h, w) in ws.iter().enumerate() {
                    for l in d..d + VALUE_LANES {
                        for (j, &wj) in w.iter().enumerate() {
                            let o = &mut want[h * hd + l];
                            *o = wj.mul_add(f16_to_f32(values[j * hd + l]), *o);
                        }
                    }
                }
                let want: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
                for (name, (_, value_lanes)) in levels() {
                    let mut out = start.clone();
                    value_lanes([&ws[0], &ws[1], &ws[2]], &values, hd, d, &mut out);
                    let got: Vec<u32> = out.iter().map(|x| x.to_bits()).collect();
                    assert_eq!(
                        got, want,
                        "{name}, head size {hd}, {rows} rows, lanes {d}.."
                    );
                }
            }
        }
    }

    #[test]
    fn head_batches_cover_the_heads_evenly() {
        for n in 1..40 {
            let b: Vec<_> = batches(n).collect();
            assert_eq!(b.len(), n.div_ceil(BATCH_HEADS));
            assert_eq!(b.first().map(|r| r.start), Some(0));
            assert_eq!(b.last().map(|r| r.end), Some(n));
            assert!(b.windows(2).all(|p| p[0].end == p[1].start));
            assert!(b.iter().all(|r| !r.is_empty() && r.len() <= BATCH_HEADS));
        }
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
