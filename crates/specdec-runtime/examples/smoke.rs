//! Greedy generation with a model file: `cargo run --release --example smoke -- MODEL.gguf "prompt"`.
use std::sync::Arc;
use std::time::Instant;

use specdec_core::{generate, GenerateConfig, NoDraft, SamplingParams};
use specdec_runtime::{Gguf, LoadOptions, Model, Session, Tokenizer};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let g = Gguf::open(&args[1])?;
    let t0 = Instant::now();
    let tok = Tokenizer::from_gguf(&g)?;
    let model = Arc::new(Model::from_gguf(&g, &LoadOptions::default())?);
    eprintln!(
        "loaded in {:.1}s: {:?}",
        t0.elapsed().as_secs_f64(),
        model.config()
    );
    let prompt = tok.encode(&args[2], true)?;
    let mut s = Session::new(model, 4096);
    let config = GenerateConfig {
        max_new_tokens: 32,
        sampling: SamplingParams::greedy(),
        stop_tokens: tok.stop_tokens().to_vec(),
        ..GenerateConfig::default()
    };
    let out = generate(&mut s, &mut NoDraft, &prompt, &config, &mut |_| {
        std::ops::ControlFlow::Continue(())
    })?;
    println!("{}", tok.decode(&out.tokens)?);
    let m = &out.metrics;
    eprintln!(
        "prefill {:.2}s for {} tokens, decode {:.1} tok/s",
        m.prefill_secs,
        prompt.len(),
        m.decode_tokens_per_s()
    );
    Ok(())
}
