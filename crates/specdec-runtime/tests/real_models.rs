//! The real default pair and SmolLM2, when present in the cache (CI fetches them; elsewhere the tests
//! print SKIPPED and return).

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use std::ops::ControlFlow;
use std::sync::Arc;

use specdec_core::{
    generate, DraftLenPolicy, GenerateConfig, ModelDrafter, NoDraft, SamplingParams,
};
use specdec_runtime::{Gguf, LoadOptions, Message, Model, Session, Tokenizer};

const PROMPTS: [&str; 10] = [
    "def fibonacci(n):",
    "// Binary search over a sorted slice in Rust\nfn binary_search(",
    "import numpy as np\n\ndef softmax(x):",
    "class Stack:\n    def __init__(self):",
    "#include <stdio.h>\n\nint main(void) {",
    "SELECT name, COUNT(*) FROM orders",
    "function debounce(fn, ms) {",
    "Write a haiku about compilers.",
    "Explain what a hash map is in two sentences.",
    "What does `git rebase -i` do?",
];

#[test]
fn default_pair_greedy_speculative_equals_greedy_plain() {
    let Some((tp, dp)) = common::default_pair() else {
        return;
    };
    let tg = Gguf::open(&tp).unwrap();
    let tok = Tokenizer::from_gguf(&tg).unwrap();
    let target = Arc::new(Model::from_gguf(&tg, &LoadOptions::default()).unwrap());
    let draft = Arc::new(Model::load(&dp, &LoadOptions::default()).unwrap());
    let mut t = Session::new(target.clone(), 1024);
    let mut d = ModelDrafter::new(Session::new(draft.clone(), 1024));
    let (mut drafted, mut accepted) = (0, 0);
    for (i, text) in PROMPTS.iter().enumerate() {
        let prompt = if i >= 7 {
            tok.encode(
                &tok.apply_chat_template(&[Message::new("user", *text)])
                    .unwrap(),
                true,
            )
            .unwrap()
        } else {
            tok.encode(text, true).unwrap()
        };
        let base = GenerateConfig {
            max_new_tokens: 64,
            sampling: SamplingParams::greedy(),
            stop_tokens: tok.stop_tokens().to_vec(),
            ..GenerateConfig::default()
        };
        let plain = generate(&mut t, &mut NoDraft, &prompt, &base, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
        let config = GenerateConfig {
            draft_len: DraftLenPolicy::Fixed {
                draft_len: 1 + i % 6,
            },
            ..base
        };
        let spec = generate(&mut t, &mut d, &prompt, &config, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
        assert_eq!(
            spec.tokens,
            plain.tokens,
            "prompt {i}: {text:?}\nspec:  {:?}\nplain: {:?}",
            tok.decode(&spec.tokens),
            tok.decode(&plain.tokens)
        );
        drafted += spec.metrics.drafted;
        accepted += spec.metrics.accepted;
        eprintln!(
            "prompt {i}: {} tokens, acceptance {:.2}, mean accepted length {:.2}",
            spec.tokens.len(),
            spec.metrics.acceptance_rate(),
            spec.metrics.mean_accepted_len()
        );
    }
    eprintln!("overall acceptance {:.3}", accepted as f64 / drafted as f64);
    assert!(
        accepted * 3 > drafted,
        "a same-family draft should agree often: {accepted}/{drafted}"
    );
}

fn block_equals_single(path: &std::path::Path) {
    let g = Gguf::open(path).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let model = Arc::new(Model::from_gguf(&g, &LoadOptions::default()).unwrap());
    let toks = tok
        .encode("fn main() { println!(\"hello\"); }", true)
        .unwrap();
    let n = toks.len();
    let mut a = Session::new(model.clone(), 256);
    let mut single = Vec::new();
    for &t in &toks {
        single.extend_from_slice(a.feed(&[t], 1).unwrap());
    }
    let mut b = Session::new(model, 256);
    let mut block = b.feed(&toks[..3], 3).unwrap().to_vec();
    block.extend_from_slice(b.feed(&toks[3..], n - 3).unwrap());
    assert_eq!(block.len(), single.len());
    let differ = block
        .iter()
        .zip(&single)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count();
    assert_eq!(
        differ,
        0,
        "{}: {differ} logits differ between block and single-token scoring",
        path.display()
    );
}

#[test]
fn real_block_logits_equal_single_token_logits() {
    for alias in [
        "smollm2-135m-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
    ] {
        if let Some(p) = common::real_model(alias) {
            block_equals_single(&p);
        }
    }
}
