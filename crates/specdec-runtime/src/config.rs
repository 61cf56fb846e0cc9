//! The model configuration: every GGUF metadata key the runtime reads, in one place.

use candle_core::quantized::gguf_file::Value;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::gguf::Gguf;

/// `{arch}.` keys the configuration reads and implements.
const READ_KEYS: &[&str] = &[
    "block_count",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    // Accepted only when equal to `attention.key_length`.
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scale_linear",
    "context_length",
];

/// `{arch}.` keys known not to change the forward pass: informational, or used by llama.cpp only to pick
/// defaults (the trained context before scaling, whether the model was fine-tuned with scaling).
const INERT_KEYS: &[&str] = &[
    "vocab_size",
    "rope.scaling.original_context_length",
    "rope.scaling.finetuned",
    // Old converters' note that q and k were permuted for llama.cpp's rope, which is what we expect.
    "tensor_data_layout",
];

/// A supported architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Llama 3, SmolLM2 (and Llama 2 and TinyLlama, whose SentencePiece tokenizers the loader
    /// refuses): see [`crate::arch::llama`].
    Llama,
    /// Qwen2 and Qwen2.5: see [`crate::arch::qwen2`].
    Qwen2,
}

/// How rotary position embeddings pair up the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i + 1)`: llama.cpp's "normal" rope, for GGUF llama weights (permuted at
    /// conversion).
    Interleaved,
    /// Halves `(i, i + d/2)`: GPT-NeoX style, used by Qwen2.
    Neox,
}

/// How rope angles are stretched to run past the trained context (besides the per-dimension factors of
/// a `rope_freqs.weight` tensor, which the model reads with its weights).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeScaling {
    /// The angle of position `p`, pair `i` is `p * base^(-2i/rope_dim)`.
    None,
    /// Linear (position-interpolation) scaling: every angle is divided by `factor`, as llama.cpp's
    /// `freq_scale = 1 / factor`.
    Linear {
        /// `{arch}.rope.scaling.factor` (or the older `{arch}.rope.scale_linear`).
        factor: f32,
    },
}

impl RopeScaling {
    /// The multiplier of every rope angle: `1 / factor`.
    pub fn freq_scale(&self) -> f64 {
        match self {
            RopeScaling::None => 1.0,
            RopeScaling::Linear { factor } => 1.0 / f64::from(*factor),
        }
    }
}

/// Hyper-parameters of a decoder-only transformer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelConfig {
    /// The architecture.
    pub arch: Arch,
    /// `general.name`, when present.
    pub name: String,
    /// `{arch}.block_count`.
    pub n_layer: usize,
    /// `{arch}.embedding_length`.
    pub n_embd: usize,
    /// `{arch}.attention.head_count`.
    pub n_head: usize,
    /// `{arch}.attention.head_count_kv` (defaults to `n_head`).
    pub n_head_kv: usize,
    /// `{arch}.attention.key_length` (defaults to `n_embd / n_head`), the size of every query, key and
    /// value head; `{arch}.attention.value_length` must equal it.
    pub head_dim: usize,
    /// `{arch}.feed_forward_length`.
    pub n_ff: usize,
    /// `{arch}.rope.freq_base` (defaults to 10000).
    pub rope_theta: f32,
    /// `{arch}.rope.dimension_count` (defaults to `head_dim`).
    pub rope_dim: usize,
    /// How rope pairs dimensions (by architecture).
    pub rope_style: RopeStyle,
    /// `{arch}.rope.scaling.type` and `{arch}.rope.scaling.factor`.
    pub rope_scaling: RopeScaling,
    /// `{arch}.attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// `{arch}.context_length`: the trained context.
    pub ctx_train: usize,
    /// Rows of `token_embd.weight`.
    pub vocab: usize,
    /// Whether q, k and v have biases (Qwen2).
    pub qkv_bias: bool,
}

/// The largest head size a file may declare (the largest in use is 256): it sizes the rope tables
/// before any tensor is read.
pub const MAX_HEAD_DIM: usize = 1024;

impl ModelConfig {
    /// Reads the configuration from GGUF metadata; the vocabulary comes from the embedding table.
    ///
    /// Every `{arch}.` key must be one the runtime implements or one known not to change the forward
    /// pass; any other key (sliding windows, mixtures of experts, YaRN, logit soft-capping, ...) is
    /// [`Error::UnsupportedKey`], never silently ignored.
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let arch_name = g.str("general.architecture")?.to_string();
        let arch = match arch_name.as_str() {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            _ => {
                return Err(Error::UnsupportedArch {
                    path: g.path().to_path_buf(),
                    arch: arch_name,
                })
            }
        };
        check_keys(g, &arch_name)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let n_embd = g.usize(&key("embedding_length"))?;
        let n_head = g.usize(&key("attention.head_count"))?;
        let n_head_kv = g
            .usize_opt(&key("attention.head_count_kv"))?
            .unwrap_or(n_head);
        if n_head == 0 || n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(Error::BadKey {
                path: g.path().to_path_buf(),
                key: key("attention.head_count_kv"),
                expected: "a positive divisor of attention.head_count",
            });
        }
        let head_dim = g
            .usize_opt(&key("attention.key_length"))?
            .unwrap_or(n_embd / n_head);
        if let Some(v) = g.usize_opt(&key("attention.value_length"))? {
            if v != head_dim {
                return Err(unsupported(g, &key("attention.value_length")));
            }
        }
        let rope_dim = g
            .usize_opt(&key("rope.dimension_count"))?
            .unwrap_or(head_dim);
        if head_dim == 0 || head_dim % 2 != 0 || head_dim > MAX_HEAD_DIM {
            return Err(Error::BadKey {
                path: g.path().to_path_buf(),
                key: key("attention.key_length"),
                expected: "an even head size of at most 1024",
            });
        }
        if rope_dim < 2 || rope_dim > head_dim || rope_dim % 2 != 0 {
            return Err(Error::BadKey {
                path: g.path().to_path_buf(),
                key: key("rope.dimension_count"),
                expected: "an even rope dimension from 2 to the head size",
            });
        }
        // Every size is checked before any allocation rests on it: a zero-width matrix holds no
        // bytes, so the tensors' fit in the file bounds nothing where a size is 0, and a product
        // of sizes must not wrap.
        let bad = |k: &str, expected: &'static str| Error::BadKey {
            path: g.path().to_path_buf(),
            key: key(k),
            expected,
        };
        if n_embd == 0 {
            return Err(bad("embedding_length", "a positive embedding length"));
        }
        if n_head.checked_mul(head_dim).is_none() {
            return Err(bad(
                "attention.head_count",
                "a head count whose query width fits in memory",
            ));
        }
        let n_ff = g.usize(&key("feed_forward_length"))?;
        if n_ff == 0 {
            return Err(bad("feed_forward_length", "a positive feed-forward length"));
        }
        let ctx_train = g.usize(&key("context_length"))?;
        if ctx_train == 0 {
            return Err(bad("context_length", "a positive context length"));
        }
        let rope_theta = g.f32_opt(&key("rope.freq_base"))?.unwrap_or(10_000.0);
        if !(rope_theta.is_finite() && rope_theta > 0.0) {
            return Err(bad("rope.freq_base", "a finite positive rope base"));
        }
        let rms_eps = g.f32(&key("attention.layer_norm_rms_epsilon"))?;
        if !(rms_eps.is_finite() && rms_eps >= 0.0) {
            return Err(bad(
                "attention.layer_norm_rms_epsilon",
                "a finite non-negative epsilon",
            ));
        }
        let (rope_style, qkv_bias) = match arch {
            Arch::Llama => (crate::arch::llama::ROPE, false),
            Arch::Qwen2 => (crate::arch::qwen2::ROPE, true),
        };
        let rope_scaling = rope_scaling(g, &key)?;
        let vocab = g
            .tensor_info("token_embd.weight")?
            .shape
            .dims()
            .first()
            .copied()
            .unwrap_or(0);
        // Every token of the tokenizer must have a row of the embedding table (llama.cpp wants as
        // many rows as tokens, as its converter writes them; more rows than tokens are fine
        // here): else a prompt holding a token past the table fails only when scored.
        if g.array_len("tokenizer.ggml.tokens")
            .is_ok_and(|n| n > vocab)
        {
            return Err(Error::BadKey {
                path: g.path().to_path_buf(),
                key: "tokenizer.ggml.tokens".into(),
                expected: "no more tokens than the rows of `token_embd.weight`",
            });
        }
        // The layer count sizes loops and allocations before any layer's tensors are read: it
        // must be what the file's tensors hold (the last layer's first tensor present, and no
        // more layers than tensors), not whatever a corrupt header says.
        let n_layer = g.usize(&key("block_count"))?;
        if n_layer == 0
            || n_layer > g.content().tensor_infos.len()
            || !g.has_tensor(&format!("blk.{}.attn_norm.weight", n_layer - 1))
        {
            return Err(Error::BadKey {
                path: g.path().to_path_buf(),
                key: key("block_count"),
                expected: "a positive number of layers, whose tensors the file holds",
            });
        }
        Ok(Self {
            arch,
            name: g.str("general.name").unwrap_or_default().to_string(),
            n_layer,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_ff,
            rope_theta,
            rope_dim,
            rope_style,
            rope_scaling,
            rms_eps,
            ctx_train,
            vocab,
            qkv_bias,
        })
    }

    /// Width of the key and value projections.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Width of the query projection.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }
}

/// Rejects every `{arch}.` key that is neither read nor known to leave the forward pass unchanged.
/// Keys are visited in sorted order so the error is the same on every run.
fn check_keys(g: &Gguf, arch: &str) -> Result<()> {
    let prefix = format!("{arch}.");
    let mut keys: Vec<(&str, &Value)> = g
        .content()
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with(&prefix))
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    keys.sort_by(|a, b| a.0.cmp(b.0));
    for (k, v) in keys {
        let rest = &k[prefix.len()..];
        if READ_KEYS.contains(&rest) || INERT_KEYS.contains(&rest) {
            continue;
        }
        // Keys whose default value leaves a dense llama-style model as it is.
        let neutral = match rest {
            "expert_count" | "expert_used_count" => g.usize(k).is_ok_and(|n| n == 0),
            "rope.scaling.attn_factor" => g.f32(k).is_ok_and(|f| f == 1.0),
            "attention.causal" => matches!(v, Value::Bool(true)),
            // Some converters write 0 for "no sliding window".
            "attention.sliding_window" => g.usize(k).is_ok_and(|n| n == 0),
            _ => false,
        };
        if !neutral {
            return Err(unsupported(g, k));
        }
    }
    Ok(())
}

/// Linear scaling as llama.cpp reads it: the factor from `rope.scaling.factor`, else the older
/// `rope.scale_linear`; the type defaults to linear, and `none` ignores the factor.
fn rope_scaling(g: &Gguf, key: &dyn Fn(&str) -> String) -> Result<RopeScaling> {
    let mut factor = None;
    for k in [key("rope.scaling.factor"), key("rope.scale_linear")] {
        if let Some(f) = g.f32_opt(&k)? {
            if f == 0.0 {
                // llama.cpp reads a factor of 0 as "not set".
                continue;
            }
            if !(f.is_finite() && f > 0.0) {
                return Err(Error::BadKey {
                    path: g.path().to_path_buf(),
                    key: k,
                    expected: "a positive, finite rope scaling factor",
                });
            }
            factor = Some(f);
            break;
        }
    }
    let type_key = key("rope.scaling.type");
    let kind = if g.has(&type_key) {
        g.str(&type_key)?
    } else {
        "linear"
    };
    match (kind, factor) {
        ("none", _) | ("linear", None) => Ok(RopeScaling::None),
        ("linear", Some(factor)) => Ok(RopeScaling::Linear { factor }),
        _ => Err(unsupported(g, &type_key)),
    }
}

/// [`Error::UnsupportedKey`] for `key`, with its value as the file has it.
fn unsupported(g: &Gguf, key: &str) -> Error {
    let value = g
        .content()
        .metadata
        .get(key)
        .map_or_else(|| "(absent)".to_string(), show);
    Error::UnsupportedKey {
        path: g.path().to_path_buf(),
        key: key.to_string(),
        value,
    }
}

/// A metadata value for an error message: strings quoted, arrays by length.
fn show(v: &Value) -> String {
    match v {
        Value::U8(x) => x.to_string(),
        Value::I8(x) => x.to_string(),
        Value::U16(x) => x.to_string(),
        Value::I16(x) => x.to_string(),
        Value::U32(x) => x.to_string(),
        Value::I32(x) => x.to_string(),
        Value::U64(x) => x.to_string(),
        Value::I64(x) => x.to_string(),
        Value::F32(x) => x.to_string(),
        Value::F64(x) => x.to_string(),
        Value::Bool(x) => x.to_string(),
        Value::String(s) => format!("{s:?}"),
        Value::Array(a) => format!("an array of {} values", a.len()),
    }
}
