//! The model configuration: every GGUF metadata key the runtime reads, in one place.

use serde::Serialize;

use crate::error::{Error, Result};
use crate::gguf::Gguf;

/// A supported architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Llama 2/3, SmolLM2, TinyLlama: see [`crate::arch::llama`].
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
    /// `{arch}.attention.key_length` (defaults to `n_embd / n_head`).
    pub head_dim: usize,
    /// `{arch}.feed_forward_length`.
    pub n_ff: usize,
    /// `{arch}.rope.freq_base` (defaults to 10000).
    pub rope_theta: f32,
    /// `{arch}.rope.dimension_count` (defaults to `head_dim`).
    pub rope_dim: usize,
    /// How rope pairs dimensions (by architecture).
    pub rope_style: RopeStyle,
    /// `{arch}.attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// `{arch}.context_length`: the trained context.
    pub ctx_train: usize,
    /// Rows of `token_embd.weight`.
    pub vocab: usize,
    /// Whether q, k and v have biases (Qwen2).
    pub qkv_bias: bool,
}

impl ModelConfig {
    /// Reads the configuration from GGUF metadata; the vocabulary comes from the embedding table.
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
        let rope_dim = g
            .usize_opt(&key("rope.dimension_count"))?
            .unwrap_or(head_dim);
        if head_dim == 0 || head_dim % 2 != 0 || rope_dim > head_dim || rope_dim % 2 != 0 {
            return Err(Error::BadKey {
                path: g.path().to_path_buf(),
                key: key("rope.dimension_count"),
                expected: "an even head size and rope dimension <= head size",
            });
        }
        let (rope_style, qkv_bias) = match arch {
            Arch::Llama => (crate::arch::llama::ROPE, false),
            Arch::Qwen2 => (crate::arch::qwen2::ROPE, true),
        };
        let vocab = g
            .tensor_info("token_embd.weight")?
            .shape
            .dims()
            .first()
            .copied()
            .unwrap_or(0);
        Ok(Self {
            arch,
            name: g.str("general.name").unwrap_or_default().to_string(),
            n_layer: g.usize(&key("block_count"))?,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_ff: g.usize(&key("feed_forward_length"))?,
            rope_theta: g.f32_opt(&key("rope.freq_base"))?.unwrap_or(10_000.0),
            rope_dim,
            rope_style,
            rms_eps: g.f32(&key("attention.layer_norm_rms_epsilon"))?,
            ctx_train: g.usize(&key("context_length"))?,
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
