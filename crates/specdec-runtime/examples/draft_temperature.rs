//! Expected acceptance of sampled model drafts by the draft's sampling temperature, exactly from
//! logits (no timing): `draft_temperature TARGET.gguf DRAFT.gguf PROMPTS.jsonl [PER_CATEGORY]`.
//!
//! For each prompt (a `specdec bench` JSONL line: `id`, `prompt`, `chat`, `category`), the target
//! samples an answer at temperature `DT_T` (default 0.7; `DT_TOKENS` tokens, default 128; seed =
//! the prompt's index). Then both models score the prompt and answer, and at every answer position
//! the target's distribution `p` (temperature `DT_T`) is compared with the draft's `q_τ` at each
//! temperature τ of `DT_TEMPS` (default 0.3,0.4,…,1.0), restricted to the draft vocabulary the CLI
//! uses (ids below `DT_VOCAB`, default 65536, and the stop tokens) and re-quantised to Q4_0 as
//! `--draft-quant q4_0` does: rejection sampling accepts a token drawn from `q_τ` with
//! probability `Σ min(p, q_τ)`. Prints its mean per category and τ. `DT_THREADS` sets the kernel
//! threads (default 2). Stop 65 measured with it that a draft temperature other than the target's
//! would not pay (docs/HISTORY.md, section "Stop 65").

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::sync::Arc;

use specdec_core::{generate, GenerateConfig, NoDraft, Probs, Sampler, SamplingParams};
use specdec_runtime::{GgmlDType, Gguf, LoadOptions, Message, Model, Session, Tokenizer};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (target_path, draft_path, prompts) = match &args[..] {
        [_, t, d, p, ..] => (t, d, p),
        _ => {
            return Err(
                "usage: draft_temperature TARGET.gguf DRAFT.gguf PROMPTS.jsonl [PER_CATEGORY]"
                    .into(),
            )
        }
    };
    let per_category: usize = args.get(4).map_or(Ok(usize::MAX), |s| s.parse())?;
    let t: f32 = env_or("DT_T", 0.7);
    let tokens: usize = env_or("DT_TOKENS", 128);
    let vocab_limit: usize = env_or("DT_VOCAB", 65536);
    let temps: Vec<f32> = std::env::var("DT_TEMPS")
        .unwrap_or_else(|_| "0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0".into())
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;

    let g = Gguf::open(target_path)?;
    let tok = Tokenizer::from_gguf(&g)?;
    let options = LoadOptions {
        threads: Some(env_or("DT_THREADS", 2)),
        ..LoadOptions::default()
    };
    let target = Arc::new(Model::from_gguf(&g, &options)?);
    let draft = Arc::new(Model::load(
        draft_path,
        &LoadOptions {
            requantize: Some(GgmlDType::Q4_0),
            ..options.clone()
        },
    )?);
    let vocab = target.config().vocab;
    if draft.config().vocab != vocab {
        return Err("the draft's vocabulary differs from the target's".into());
    }
    let stops = tok.stop_tokens().to_vec();
    let in_draft = |id: usize| id < vocab_limit || stops.contains(&(id as u32));

    // Per category: per τ the sum of acceptance, and the positions counted.
    let mut sums: BTreeMap<String, (Vec<f64>, usize)> = BTreeMap::new();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for (i, line) in std::fs::read_to_string(prompts)?.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)?;
        let category = v["category"].as_str().unwrap_or("?").to_string();
        let n = seen.entry(category.clone()).or_insert(0);
        if *n >= per_category {
            continue;
        }
        *n += 1;
        let text = v["prompt"].as_str().ok_or("a prompt without text")?;
        let prompt = if v["chat"].as_bool().unwrap_or(false) {
            tok.encode_chat(&[Message::new("user", text)])?
        } else {
            tok.encode(text, true)?
        };
        let config = GenerateConfig {
            sampling: SamplingParams {
                temperature: t,
                ..SamplingParams::default()
            },
            stop_tokens: stops.clone(),
            max_new_tokens: tokens,
            seed: i as u64,
            ..GenerateConfig::default()
        };
        let mut session = Session::new(target.clone(), prompt.len() + tokens + 1);
        let out = generate(&mut session, &mut NoDraft, &prompt, &config, &mut |_| {
            ControlFlow::Continue(())
        })?;
        let answer = &out.tokens;
        if answer.is_empty() {
            continue;
        }
        // Logits after each token from the prompt's last to the answer's last but one: the
        // distributions the answer's tokens were drawn from.
        let mut all = prompt.clone();
        all.extend_from_slice(answer);
        let fed = &all[..all.len() - 1];
        let mut ts = Session::new(target.clone(), all.len());
        let p_logits = ts.feed(fed, answer.len())?.to_vec();
        let mut ds = Session::new(draft.clone(), all.len());
        let q_logits = ds.feed(fed, answer.len())?.to_vec();

        let mut target_sampler = Sampler::new(SamplingParams {
            temperature: t,
            ..SamplingParams::default()
        });
        let entry = sums
            .entry(category.clone())
            .or_insert_with(|| (vec![0.0; temps.len()], 0));
        let mut q_row = vec![0f32; vocab];
        for r in 0..answer.len() {
            let mut p = Probs::OneHot(0);
            target_sampler.probs(&p_logits[r * vocab..(r + 1) * vocab], &[], &mut p)?;
            for (id, (q, &l)) in q_row
                .iter_mut()
                .zip(&q_logits[r * vocab..(r + 1) * vocab])
                .enumerate()
            {
                // Outside the draft's vocabulary: a logit whose exponential is 0.
                *q = if in_draft(id) { l } else { -1e30 };
            }
            for (j, &tau) in temps.iter().enumerate() {
                let mut s = Sampler::new(SamplingParams {
                    temperature: tau,
                    ..SamplingParams::default()
                });
                let mut q = Probs::OneHot(0);
                s.probs(&q_row, &[], &mut q)?;
                let a: f64 = (0..vocab as u32)
                    .map(|id| f64::from(p.prob(id).min(q.prob(id))))
                    .sum();
                entry.0[j] += a;
            }
            entry.1 += 1;
        }
        eprintln!("{} ({category}): {} answer tokens", v["id"], answer.len());
    }
    print!("{:<12}{:>8}", "category", "tokens");
    for tau in &temps {
        print!("{:>8}", format!("τ={tau}"));
    }
    println!();
    let mut total = (vec![0.0; temps.len()], 0);
    for (category, (s, n)) in &sums {
        print!("{category:<12}{n:>8}");
        for (j, v) in s.iter().enumerate() {
            print!("{:>8.3}", v / *n as f64);
            total.0[j] += v;
        }
        total.1 += n;
        println!();
    }
    print!("{:<12}{:>8}", "all", total.1);
    for v in &total.0 {
        print!("{:>8.3}", v / total.1 as f64);
    }
    println!();
    Ok(())
}
