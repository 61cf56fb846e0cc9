//! Writes a tiny random-weight model for experiments:
//! `cargo run -p specdec-runtime --features testing --example write_tiny -- out.gguf [qwen2|llama]`.
use candle_core::quantized::GgmlDType;
use specdec_runtime::testing::TinySpec;
use specdec_runtime::Arch;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .ok_or("usage: write_tiny OUT.gguf [qwen2|llama]")?;
    let arch = match args.get(2).map(String::as_str) {
        Some("llama") => Arch::Llama,
        _ => Arch::Qwen2,
    };
    TinySpec {
        ctx: 4096,
        ..TinySpec::new(arch, GgmlDType::Q8_0)
    }
    .write(path)?;
    Ok(())
}
