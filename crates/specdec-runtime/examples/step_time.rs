//! Median time of a single-token step of a model, optionally with a restricted logits vocabulary:
//! `cargo run --release -p specdec-runtime --example step_time -- MODEL.gguf [LOGITS_VOCAB]`
//! (`STEP_TIME_CONTEXT=N` sets the context before the timed steps, default 64; `STEP_TIME_STEPS=N`
//! the number of timed steps, default 64; `STEP_TIME_THREADS=N` the kernel threads; `STEP_TIME_BLOCK=M`
//! times verification-shaped steps instead: M tokens scored in one pass with M logits rows, then rolled
//! back; `STEP_TIME_QUANT=q4_0|q4_k|q8_0` re-quantises every matrix at load, as `--draft-quant` does;
//! `STEP_TIME_DEVICE=cuda` runs the model on the GPU (a build with `--features cuda`);
//! `STEP_TIME_PROFILE=1` also prints the milliseconds per timed step of each stage of the forward
//! pass, from the model's trace spans: `qkv` (norm, q/k/v, rope), `attention` (cache write and
//! attention), `wo` (output projection and residual), `gate_up` (norm, gate/up, SwiGLU), `down`, and
//! `logits` (final norm and output matrix)).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use specdec_runtime::{LoadOptions, Model, Session};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// One stage span of the forward pass: its wall time summed, and when it was last entered.
struct Stage {
    name: &'static str,
    spent: Duration,
    entered: Option<Instant>,
}

/// Wall time spent in each of the forward pass's stage spans (every span but `layer`), in order of
/// first appearance.
#[derive(Default)]
struct Stages {
    stages: Mutex<Vec<Stage>>,
}

impl Stages {
    fn with<T>(&self, f: impl FnOnce(&mut Vec<Stage>) -> T) -> T {
        f(&mut self.stages.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// One id per stage name: the forward pass never nests a stage in itself.
impl Subscriber for &'static Stages {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.is_span() && metadata.name() != "layer"
    }

    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let name = span.metadata().name();
        let i = self.with(|s| {
            s.iter()
                .position(|stage| stage.name == name)
                .unwrap_or_else(|| {
                    s.push(Stage {
                        name,
                        spent: Duration::ZERO,
                        entered: None,
                    });
                    s.len() - 1
                })
        });
        Id::from_u64(i as u64 + 1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, _: &Event<'_>) {}

    fn enter(&self, span: &Id) {
        let i = span.into_u64() as usize - 1;
        self.with(|s| s[i].entered = Some(Instant::now()));
    }

    fn exit(&self, span: &Id) {
        let i = span.into_u64() as usize - 1;
        self.with(|s| {
            if let Some(t) = s[i].entered.take() {
                s[i].spent += t.elapsed();
            }
        });
    }
}

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
    let device = std::env::var("STEP_TIME_DEVICE")
        .map_or(Ok(specdec_runtime::Device::Cpu), |s| s.parse())?;
    let options = LoadOptions {
        logits_vocab,
        threads,
        requantize,
        device,
        ..LoadOptions::default()
    };
    let stages: Option<&'static Stages> = std::env::var_os("STEP_TIME_PROFILE")
        .map(|_| -> Result<_, Box<dyn std::error::Error>> {
            let stages: &'static Stages = Box::leak(Box::default());
            tracing::subscriber::set_global_default(stages)?;
            Ok(stages)
        })
        .transpose()?;
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
    if let Some(stages) = stages {
        stages.with(|s| s.iter_mut().for_each(|stage| stage.spent = Duration::ZERO));
    }
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
    if let Some(stages) = stages {
        let total: f64 = times.iter().sum::<f64>() * 1e3 / f64::from(steps);
        println!("per timed step (mean), {total:.2} ms in all:");
        stages.with(|s| {
            for stage in s.iter() {
                let ms = stage.spent.as_secs_f64() * 1e3 / f64::from(steps);
                println!(
                    "  {:10} {ms:7.3} ms  {:5.1}%",
                    stage.name,
                    100.0 * ms / total
                );
            }
        });
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
