//! The tokenizer from GGUF metadata, the chat template and streaming detokenisation, on the tiny
//! byte-level tokenizer and (when present) on the real Qwen and SmolLM2 tokenizers.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

mod common;

use candle_core::quantized::GgmlDType;
use specdec_runtime::testing::TinySpec;
use specdec_runtime::{Arch, Gguf, Message, StreamDecoder, Tokenizer};

const EDGE_CASES: [&str; 7] = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "def f(x):\n\tif x:\n\t\treturn x  # tab-indented",
    "emoji 🦀🚀 and flags 🇫🇷",
    "中文字符和日本語のテキスト",
    "mixed: café naïve — “quotes” ½",
    "\n\n\r\n multiple\n\nnewlines",
];

fn tiny_tokenizer() -> (tempfile::TempDir, Tokenizer) {
    let (dir, path) = common::tiny(&TinySpec::new(Arch::Qwen2, GgmlDType::Q8_0));
    let t = Tokenizer::from_gguf(&Gguf::open(&path).unwrap()).unwrap();
    (dir, t)
}

fn check_round_trips(t: &Tokenizer) {
    for text in EDGE_CASES {
        let ids = t.encode(text, false).unwrap();
        assert_eq!(t.decode(&ids).unwrap(), text, "round trip of {text:?}");
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
}

#[test]
fn tiny_tokenizer_round_trips_and_streams() {
    let (_d, t) = tiny_tokenizer();
    check_round_trips(&t);
    // Byte-level with no merges: one token per UTF-8 byte, so an emoji takes 4 tokens and must be held
    // back until complete.
    assert_eq!(t.encode("🦀", false).unwrap().len(), 4);
}

#[test]
fn special_tokens_in_text_become_their_ids() {
    let (_d, t) = tiny_tokenizer();
    let ids = t.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
    assert_eq!(ids.first(), Some(&257));
    assert_eq!(ids.last(), Some(&258));
    assert!(t.stop_tokens().contains(&258));
    assert!(t.stop_tokens().contains(&256), "<|endoftext|> stops too");
}

#[test]
fn chat_template_renders_chatml() {
    let (_d, t) = tiny_tokenizer();
    let s = t
        .apply_chat_template(&[Message::new("user", "Hi")])
        .unwrap();
    assert_eq!(s, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

#[test]
fn qwen_tokenizer_and_template() {
    let Some(path) = common::real_model("qwen2.5-coder-1.5b-instruct") else {
        return;
    };
    let t = Tokenizer::from_gguf(&Gguf::open(&path).unwrap()).unwrap();
    check_round_trips(&t);
    assert_eq!(t.encode("<|im_start|>", false).unwrap(), [151644]);
    assert_eq!(t.encode("<|im_end|>", false).unwrap(), [151645]);
    assert_eq!(t.encode("<|endoftext|>", false).unwrap(), [151643]);
    for stop in [151645, 151643] {
        assert!(t.stop_tokens().contains(&stop), "{:?}", t.stop_tokens());
    }
    // Qwen2's pre-tokenizer splits digits one by one.
    assert_eq!(t.encode("12345", false).unwrap().len(), 5);
    // The template adds Qwen's default system prompt when none is given.
    let s = t
        .apply_chat_template(&[Message::new("user", "Write hello world in Rust.")])
        .unwrap();
    assert_eq!(
        s,
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nWrite hello world in Rust.<|im_end|>\n<|im_start|>assistant\n"
    );
    let s = t
        .apply_chat_template(&[
            Message::new("system", "Be brief."),
            Message::new("user", "Hi"),
        ])
        .unwrap();
    assert_eq!(s, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

#[test]
fn smollm2_tokenizer_and_template() {
    let Some(path) = common::real_model("smollm2-135m-instruct") else {
        return;
    };
    let t = Tokenizer::from_gguf(&Gguf::open(&path).unwrap()).unwrap();
    check_round_trips(&t);
    assert!(t.stop_tokens().contains(&2), "{:?}", t.stop_tokens());
    let s = t
        .apply_chat_template(&[Message::new("user", "Hi")])
        .unwrap();
    assert!(s.starts_with("<|im_start|>system\n"), "{s}");
    assert!(
        s.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
        "{s}"
    );
}
