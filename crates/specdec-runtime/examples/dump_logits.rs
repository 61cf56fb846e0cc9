//! Tokenizes a text file with a model's tokenizer and writes the model's logits at every position, for
//! comparison with an independent implementation (`scripts/agreement.py`):
//! `dump_logits MODEL.gguf TEXT_FILE OUT_PREFIX` writes OUT_PREFIX.tokens (one id a line) and
//! OUT_PREFIX.f32 (`[positions, vocab]` little-endian f32).
use std::io::Write;
use std::sync::Arc;

use specdec_runtime::{Gguf, LoadOptions, Model, Session, Tokenizer};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, model, text, out] = &args[..] else {
        return Err("usage: dump_logits MODEL.gguf TEXT_FILE OUT_PREFIX".into());
    };
    let g = Gguf::open(model)?;
    let tok = Tokenizer::from_gguf(&g)?;
    // The reference forward uses plain f32 weights, so compare against the file's own types.
    let m = Arc::new(Model::from_gguf(
        &g,
        &LoadOptions {
            requantize_q5: false,
            ..LoadOptions::default()
        },
    )?);
    let ids = tok.encode(&std::fs::read_to_string(text)?, true)?;
    let mut s = Session::new(m, ids.len() + 1);
    let logits = s.feed(&ids, ids.len())?;
    std::fs::write(
        format!("{out}.tokens"),
        ids.iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join("\n"),
    )?;
    let mut f = std::io::BufWriter::new(std::fs::File::create(format!("{out}.f32"))?);
    for v in logits {
        f.write_all(&v.to_le_bytes())?;
    }
    eprintln!("{} positions", ids.len());
    Ok(())
}
