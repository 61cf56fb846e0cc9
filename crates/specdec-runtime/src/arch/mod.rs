//! Architectures. Each file says how one family maps onto the shared transformer in
//! [`crate::model`]: its GGUF tensor names and its few differences (rope pairing, biases).

pub mod llama;
pub mod qwen2;
