//! Median time of a single-token step of a model, optionally with a restricted logits vocabulary:
//! `cargo run --release -p specdec-runtime --example step_time -- MODEL.gguf [LOGITS_VOCAB]`
//! (`STEP_TIME_CONTEXT=N` sets the context before the timed steps, default 64; `STEP_TIME_STEPS=N`
//! the number of timed steps, default 64; `STEP_TIME_THREADS=N` the kernel threads; `STEP_TIME_BLOCK=M`
//! times verification-shaped steps instead: M tokens scored in one pass with M logits rows, then rolled
//! back; `STEP_TIME_QUANT=q4_0|q4_k|q8_0` re-quantises every matrix at load, as `--draft-quant` does).

use std::sync::Arc;
use std::time::Instant;

use specdec_runtime::{LoadOptions, Model, Session};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or("usage: step_time MODEL.gguf [LOGITS_VOCAB]")?;
    let logits_vocab = args.next().map(|s| s.parse::<usize>()).transpose()?;
    let threads = std::env::var("STEP_TIME_THREADS")
        .ok()
        .map(|s| s.parse::<usize>())
        .transpose()?;
    let requantize = match std::env::var("STEP_TIME_QUANT").as_deref() {
        Ok("q4_0") => Some(specdec_runtime::GgmlDType::Q4_0),
        Ok("q8_0") => Some(specdec_runtime::GgmlDType::Q8_0),
        Ok("q4_k") => Some(specdec_runtime::GgmlDType::Q4K),
        Ok(other) => return Err(format!("STEP_TIME_QUANT: unknown type {other}").into()),
        Err(_) => None,
    };
    let options = LoadOptions {
        logits_vocab,
        threads,
        requantize,
        ..LoadOptions::default()
    };
    let model = Arc::new(Model::load(&path, &options)?);
    // Token ids within any vocabulary, tiny test models' included.
    let vocab = model.config().vocab as u32;
    let context: u32 = std::env::var("STEP_TIME_CONTEXT").map_or(Ok(64), |s| s.parse())?;
    let steps: u32 = std::env::var("STEP_TIME_STEPS").map_or(Ok(64), |s| s.parse())?;
    let block: usize = std::env::var("STEP_TIME_BLOCK").map_or(Ok(1), |s| s.parse())?;
    let mut s = Session::new(model, (context + steps) as usize + block + 1);
    let ctx: Vec<u32> = (0..context)
        .map(|i| (1000 + 7 * (i % 4000)) % vocab)
        .collect();
    let start = Instant::now();
    s.feed(&ctx, 1)?;
    let prefill = start.elapsed().as_secs_f64();
    let mut times = Vec::new();
    for i in 0..steps {
        let tokens: Vec<u32> = (0..block as u32)
            .map(|j| (2000 + i + 13 * j) % vocab)
            .collect();
        let start = Instant::now();
        s.feed(&tokens, block)?;
        times.push(start.elapsed().as_secs_f64());
        if block > 1 {
            // Keep one token, as verification commits at least one.
            let keep = s.tokens().len() - block + 1;
            s.rollback(keep)?;
        }
    }
    times.sort_by(f64::total_cmp);
    println!(
        "logits vocab {:?}, block {block}: prefill {:.1} tok/s, median step {:.2} ms, fastest {:.2} ms",
        logits_vocab,
        ctx.len() as f64 / prefill,
        times[times.len() / 2] * 1e3,
        times[0] * 1e3
    );
    Ok(())
}
