//! Shared helpers for the runtime's tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use specdec_core::{
    generate, Batch, Draft, DraftLenPolicy, GenerateConfig, Logits, ModelDrafter, Output, Score,
    SeqId, Target, TokenId,
};
use specdec_runtime::testing::TinySpec;
use specdec_runtime::{Arch, LoadOptions, Model, Session, StreamDecoder, Tokenizer};

/// Writes a tiny model into a fresh temporary folder; the folder lives as long as the guard.
pub fn tiny(spec: &TinySpec) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    spec.write(&path).unwrap();
    (dir, path)
}

pub fn tiny_model(spec: &TinySpec) -> Arc<Model> {
    let (_dir, path) = tiny(spec);
    Arc::new(Model::load(&path, &LoadOptions::default()).unwrap())
}

/// The logits of `req` scored by a session of its own, on a cache of 128 positions.
pub fn score_alone(model: &Arc<Model>, req: &Score<'_>) -> Logits {
    let mut alone = Session::new(model.clone(), 128);
    let mut want = [Logits::new(0)];
    alone
        .score(
            &[Score {
                seq: SeqId(0),
                ..*req
            }],
            &mut want,
        )
        .unwrap();
    let [want] = want;
    want
}

/// `config` with `k` tokens drafted a round by `draft`'s model, sessions of `capacity` positions.
pub fn generate_drafted(
    (target, draft): (&Arc<Model>, &Arc<Model>),
    prompt: &[u32],
    config: &GenerateConfig,
    k: usize,
    capacity: usize,
) -> Output {
    let config = GenerateConfig {
        draft_len: DraftLenPolicy::Fixed { draft_len: k },
        ..config.clone()
    };
    let mut t = Session::new(target.clone(), capacity);
    let mut d = ModelDrafter::new(Session::new(draft.clone(), capacity));
    generate(&mut t, &mut d, prompt, &config, &mut |_| {
        ControlFlow::Continue(())
    })
    .unwrap()
}

/// Adds `prompts` to `batch` with `config` and steps it until all of them have finished: the
/// tokens of each.
pub fn decode_together<T: Target, D: Draft>(
    batch: &mut Batch<T, D>,
    prompts: &[(SeqId, &[TokenId])],
    config: &GenerateConfig,
) -> HashMap<SeqId, Vec<TokenId>> {
    for (id, p) in prompts {
        batch.add(*id, p.to_vec(), config.clone(), None).unwrap();
    }
    let mut got = HashMap::new();
    while got.len() < prompts.len() {
        for f in batch.step(&mut |_, _| ControlFlow::Continue(())) {
            got.insert(f.seq, f.result.unwrap().tokens);
        }
    }
    got
}

/// Every architecture with every quantisation type the tests cover.
pub fn all_specs() -> Vec<TinySpec> {
    let mut out = Vec::new();
    for arch in [Arch::Llama, Arch::Qwen2] {
        for dtype in [
            GgmlDType::F32,
            GgmlDType::F16,
            GgmlDType::BF16,
            GgmlDType::Q8_0,
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q5_1,
            GgmlDType::Q2K,
            GgmlDType::Q3K,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ] {
            out.push(TinySpec::new(arch, dtype));
        }
    }
    out
}

pub const EDGE_CASES: [&str; 7] = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "def f(x):\n\tif x:\n\t\treturn x  # tab-indented",
    "emoji 🦀🚀 and flags 🇫🇷",
    "中文字符和日本語のテキスト",
    "mixed: café naïve — “quotes” ½",
    "\n\n\r\n multiple\n\nnewlines",
];

/// Encoding then decoding, in one go and streamed, gives the text back.
pub fn check_round_trips(t: &Tokenizer) {
    for text in EDGE_CASES {
        let ids = t.encode(text, false).unwrap();
        assert_eq!(t.decode(&ids).unwrap(), text, "round trip of {text:?}");
        // The tokens' own bytes, concatenated, are the text (pieces of characters included).
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&id| t.token_bytes(id).unwrap())
            .collect();
        assert_eq!(bytes, text.as_bytes(), "token bytes of {text:?}");
        // Streaming yields the same text and never a replacement character.
        let mut stream = StreamDecoder::new();
        let mut out = String::new();
        for &id in &ids {
            if let Some(piece) = stream.push(t, id).unwrap() {
                assert!(!piece.contains('\u{FFFD}'), "broken UTF-8 in {piece:?}");
                out.push_str(&piece);
            }
        }
        if let Some(rest) = stream.finish(t).unwrap() {
            out.push_str(&rest);
        }
        assert_eq!(out, text, "streamed {text:?}");
    }
    // The CLI refuses, untokenized, a text of more than 4 × max_token_bytes bytes for each token of
    // room: no text has fewer tokens than that bound allows, for long runs that merge into a vocabulary's longest tokens
    // and for characters that normalisation shortens (NFC: a Kelvin sign's 3 bytes become `K`,
    // Hangul jamo's 9 one syllable's 3).
    let most = t.max_token_bytes();
    for c in [
        " ",
        "=",
        "-",
        "\n",
        "\t",
        "a",
        "#",
        "_",
        "é",
        "\u{212A}",
        "\u{1100}\u{1161}\u{11A8}",
    ] {
        let text = c.repeat(400);
        let ids = t.encode(&text, false).unwrap();
        assert!(
            ids.len() * 4 * most >= text.len(),
            "{c:?} × 400: {} tokens of at most {most} bytes",
            ids.len()
        );
    }
}
