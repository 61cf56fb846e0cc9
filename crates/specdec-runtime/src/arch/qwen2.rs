//! Qwen2 and Qwen2.5 (the default pair: Qwen2.5-Coder 1.5B and 0.5B Instruct).
//!
//! The Llama block layout plus biases on q, k and v (`blk.N.attn_{q,k,v}.bias`), grouped-query
//! attention (12 query heads over 2 key/value heads in the 1.5B), rope pairing each dimension with the
//! one half a head away, `freq_base` 1e6. `output.weight` may be absent (tied to `token_embd`).

use crate::config::RopeStyle;

/// Rope pairing of Qwen2.
pub const ROPE: RopeStyle = RopeStyle::Neox;
