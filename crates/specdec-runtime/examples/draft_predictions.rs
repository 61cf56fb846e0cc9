//! The draft model's greedy prediction at every position of a greedy benchmark's answers, for
//! replaying whole decodes offline (`specdec-core`'s `decode_replay` example):
//! `draft_predictions DRAFT.gguf BENCH.json OUT.jsonl`.
//!
//! Reads the JSON of `specdec bench --json FILE` (its `ar` records carry each prompt's and answer's
//! token ids) and, for each, feeds the prompt and answer to the draft model loaded as the CLI's
//! defaults load it (re-quantised to Q4_0, scoring ids below `DP_VOCAB`, default 65536, and the
//! stop tokens). Writes one line per record: `id`, `category`, the `prompt` and `output` ids, and
//! `pred`, where `pred[j]` is the draft's most likely token after the prompt and the first `j`
//! answer tokens (`j = 0..=output.len()`), `conf`, where `conf[j]` is that token's probability (the
//! draft's confidence, at temperature 1), `pred2` and `conf2`, the second most likely token and
//! its probability (for `scripts/model_tree_sim.py`), and the `stop` tokens. With greedy
//! verification, a model draft made from a context the target committed is exactly this walk, so
//! a replay can decide acceptance without the models. `DP_THREADS` sets the kernel threads
//! (default 2).

use std::io::Write;
use std::sync::Arc;

use specdec_runtime::{GgmlDType, Gguf, LoadOptions, Model, ModelConfig, Session, Tokenizer};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
                .collect()
        })
        .unwrap_or_default()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, draft_path, bench, out] = &args[..] else {
        return Err("usage: draft_predictions DRAFT.gguf BENCH.json OUT.jsonl".into());
    };
    let g = Gguf::open(draft_path)?;
    let tok = Tokenizer::from_gguf(&g)?;
    let vocab = ModelConfig::from_gguf(&g)?.vocab;
    if vocab < 2 {
        return Err(format!("a vocabulary of {vocab} has no second choice").into());
    }
    // As the CLI loads a draft: the restricted vocabulary at most the whole one, and the stop
    // tokens within it scored beside it.
    let stops: Vec<u32> = tok
        .stop_tokens()
        .iter()
        .copied()
        .filter(|&t| (t as usize) < vocab)
        .collect();
    let draft = Arc::new(Model::from_gguf(
        &g,
        &LoadOptions {
            threads: Some(env_or("DP_THREADS", 2)),
            logits_vocab: Some(env_or("DP_VOCAB", 65536).min(vocab)),
            logits_also: stops.clone(),
            requantize: Some(GgmlDType::Q4_0),
            ..LoadOptions::default()
        },
    )?);
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(bench)?)?;
    let records = doc["records"]
        .as_array()
        .ok_or("no records in the bench JSON")?;
    let mut f = std::io::BufWriter::new(std::fs::File::create(out)?);
    // One line a prompt: a repeated benchmark has an `ar` record for each repetition.
    for r in records
        .iter()
        .filter(|r| r["mode"] == "ar" && r["repeat"].as_u64().unwrap_or(0) == 0)
    {
        let (prompt, output) = (ids(&r["prompt_tokens"]), ids(&r["output_tokens"]));
        let all: Vec<u32> = prompt.iter().chain(&output).copied().collect();
        let mut s = Session::new(draft.clone(), all.len() + 1);
        let rows = output.len() + 1;
        let logits = s.feed(&all, rows)?;
        let mut pred = Vec::with_capacity(rows);
        let mut conf = Vec::with_capacity(rows);
        let mut pred2 = Vec::with_capacity(rows);
        let mut conf2 = Vec::with_capacity(rows);
        for row in logits.chunks_exact(vocab) {
            // Tokens outside a restricted vocabulary score -inf; NaN or +inf is a broken pass.
            if row.iter().any(|x| x.is_nan() || *x == f32::INFINITY) {
                return Err(format!("{}: non-finite logits", r["id"]).into());
            }
            let (mut best, mut second) = (0, 1);
            if row[second] > row[best] {
                (best, second) = (second, best);
            }
            for (i, &x) in row.iter().enumerate().skip(2) {
                if x > row[best] {
                    second = best;
                    best = i;
                } else if x > row[second] {
                    second = i;
                }
            }
            let max = row[best];
            let total: f64 = row.iter().map(|&x| f64::from(x - max).exp()).sum();
            pred.push(best as u32);
            conf.push((1.0 / total) as f32);
            pred2.push(second as u32);
            conf2.push((f64::from(row[second] - max).exp() / total) as f32);
        }
        let line = serde_json::json!({
            "id": r["id"],
            "category": r["category"],
            "prompt": prompt,
            "output": output,
            "pred": pred,
            "conf": conf,
            "pred2": pred2,
            "conf2": conf2,
            "stop": stops,
        });
        writeln!(f, "{line}")?;
        let agree = pred.iter().zip(&output).filter(|(a, b)| a == b).count();
        eprintln!(
            "{}: {} prompt + {} answer tokens, the draft predicts {agree} of the answer's",
            r["id"].as_str().unwrap_or("?"),
            prompt.len(),
            output.len()
        );
    }
    Ok(())
}
