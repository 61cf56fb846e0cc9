//! Writes a tiny random-weight model for experiments and for `scripts/agreement.py`:
//! `cargo run -p specdec-runtime --features testing --example write_tiny -- OUT.gguf [qwen2|llama]
//! [--dtype f32|f16|q8_0|q4_0|q4_k|...] [--head-dim N] [--rope-freqs] [--rope-linear FACTOR]
//! [--ctx N] [--heads Q,KV] [--layers N] [--embd N] [--ff N] [--vocab N]`.
//!
//! `--embd 1536 --ff 8960 --heads 12,2 --vocab 151936 --dtype q4_k` gives the 1.5B target's matrix
//! shapes (random weights; `--layers` as few as a measurement needs), for `step_time` on a machine
//! the real model cannot reach.
//!
//! `--rope-freqs` writes Llama 3.1-style `rope_freqs.weight` factors (factor 8, low/high frequency
//! factors 1 and 4, an original context of 256 so that a few hundred positions feel them);
//! `--rope-linear F` writes `rope.scaling.type = "linear"` and `rope.scaling.factor = F`;
//! `--head-dim N` writes `attention.key_length = attention.value_length = N`.
use candle_core::quantized::GgmlDType;
use specdec_runtime::testing::{llama3_rope_freqs, TinySpec};
use specdec_runtime::Arch;

const USAGE: &str = "usage: write_tiny OUT.gguf [qwen2|llama] [--dtype f32|f16|q8_0|q4_0|q4_1|q5_0|q4_k|q5_k|q6_k] [--head-dim N] [--rope-freqs] [--rope-linear FACTOR] [--ctx N] [--heads Q,KV] [--layers N] [--embd N] [--ff N] [--vocab N]";

fn dtype(s: &str) -> Option<GgmlDType> {
    Some(match s {
        "f32" => GgmlDType::F32,
        "f16" => GgmlDType::F16,
        "q8_0" => GgmlDType::Q8_0,
        "q4_0" => GgmlDType::Q4_0,
        "q4_1" => GgmlDType::Q4_1,
        "q5_0" => GgmlDType::Q5_0,
        "q4_k" => GgmlDType::Q4K,
        "q5_k" => GgmlDType::Q5K,
        "q6_k" => GgmlDType::Q6K,
        _ => return None,
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args.first().ok_or(USAGE)?;
    let mut arch = Arch::Qwen2;
    let mut ty = GgmlDType::Q8_0;
    let mut head_dim = None;
    let mut rope_freqs = false;
    let mut rope_linear = None;
    let mut ctx = 4096;
    let mut heads = None;
    let mut layers = None;
    let (mut embd, mut ff, mut vocab) = (None, None, None);
    let mut it = args[1..].iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or(USAGE);
        match a.as_str() {
            "llama" => arch = Arch::Llama,
            "qwen2" => arch = Arch::Qwen2,
            "--dtype" => ty = dtype(value()?).ok_or(USAGE)?,
            "--head-dim" => head_dim = Some(value()?.parse::<usize>()?),
            "--rope-freqs" => rope_freqs = true,
            "--rope-linear" => rope_linear = Some(value()?.parse::<f32>()?),
            "--ctx" => ctx = value()?.parse::<usize>()?,
            "--heads" => {
                let (q, kv) = value()?.split_once(',').ok_or(USAGE)?;
                heads = Some((q.parse::<usize>()?, kv.parse::<usize>()?));
            }
            "--layers" => layers = Some(value()?.parse::<usize>()?),
            "--embd" => embd = Some(value()?.parse::<usize>()?),
            "--ff" => ff = Some(value()?.parse::<usize>()?),
            "--vocab" => vocab = Some(value()?.parse::<usize>()?),
            _ => return Err(format!("unknown argument `{a}`\n{USAGE}").into()),
        }
    }
    let mut base = TinySpec::new(arch, ty);
    if let Some((q, kv)) = heads {
        (base.n_head, base.n_head_kv) = (q, kv);
    }
    base.n_layer = layers.unwrap_or(base.n_layer);
    base.n_embd = embd.unwrap_or(base.n_embd);
    base.n_ff = ff.unwrap_or(base.n_ff);
    base.vocab = vocab.unwrap_or(base.vocab);
    let rope_dim = head_dim.unwrap_or(base.n_embd / base.n_head);
    TinySpec {
        ctx,
        head_dim,
        rope_freqs: rope_freqs.then(|| llama3_rope_freqs(10_000.0, rope_dim, 8.0, (1.0, 4.0), 256)),
        rope_scaling: rope_linear.map(|f| ("linear".to_string(), f)),
        ..base
    }
    .write(path)?;
    Ok(())
}
