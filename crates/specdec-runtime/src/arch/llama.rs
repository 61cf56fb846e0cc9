//! Llama (Llama 2/3, SmolLM2, TinyLlama, Mistral-style GGUFs).
//!
//! Per block `blk.N.`: `attn_norm`, `attn_q`, `attn_k`, `attn_v`, `attn_output`, `ffn_norm`,
//! `ffn_gate`, `ffn_up`, `ffn_down`; then `output_norm` and `output` (absent when the embedding is tied,
//! as in SmolLM2). No biases. llama.cpp's converter permutes the q and k rows of Llama checkpoints so
//! that rope pairs adjacent dimensions.

use crate::config::RopeStyle;

/// Rope pairing of GGUF llama weights.
pub const ROPE: RopeStyle = RopeStyle::Interleaved;
