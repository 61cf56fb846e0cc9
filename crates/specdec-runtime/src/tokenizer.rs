//! The tokenizer, built from GGUF metadata; stop tokens; the chat template; incremental detokenising.

use candle_core::quantized::tokenizer::TokenizerFromGguf;
use minijinja::{context, Environment};
use serde::Serialize;
use specdec_core::TokenId;

use crate::error::{Error, Result};
use crate::gguf::Gguf;

/// Tokens that end a turn in the chat formats we know, when the vocabulary has them (Llama 3.1's
/// `<|eom_id|>` ends a turn that called a tool).
const END_OF_TURN: [&str; 7] = [
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "</s>",
    "<|end|>",
];

/// A tokenizer with the model's special tokens and chat template.
#[derive(Clone)]
pub struct Tokenizer {
    /// Splits special-token text (`<|im_start|>`) out as the special token.
    inner: tokenizers::Tokenizer,
    /// The same tokenizer with special-token text encoded as ordinary text: for text a user or a file
    /// supplied, which must not be able to open a turn or switch roles.
    plain: tokenizers::Tokenizer,
    /// The text of every special token, to tell whether a message spells one out.
    specials: Vec<String>,
    vocab: usize,
    bos: Option<(TokenId, String)>,
    eos: Option<(TokenId, String)>,
    add_bos: bool,
    stop: Vec<TokenId>,
    chat_template: Option<String>,
    /// How a vocabulary entry spells its bytes.
    pieces: Pieces,
    /// Added (special or user-defined) tokens, whose entries are their literal text.
    added: std::collections::HashSet<TokenId>,
    /// The most bytes one token stands for, computed when first asked.
    max_token_bytes: std::sync::OnceLock<usize>,
}

/// How the vocabulary's entries spell the bytes a token stands for (GGUF `tokenizer.ggml.model`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pieces {
    /// `gpt2`: byte-level BPE, every byte written as one character of GPT-2's byte alphabet.
    ByteLevel,
    /// `llama`: SentencePiece, `▁` for a space and `<0xNN>` for a byte-fallback token.
    SentencePiece,
    /// Anything else: the token decoded alone.
    Decoded,
}

/// The byte a character of GPT-2's byte-level alphabet stands for: the printable bytes `!`..=`~`,
/// `¡`..=`¬` and `®`..=`ÿ` are themselves, and the other 68 bytes, in increasing order, are
/// U+0100..=U+0143.
fn byte_level_byte(c: char) -> Option<u8> {
    let c = u32::from(c);
    let byte = match c {
        33..=126 | 161..=172 | 174..=255 => c,
        256..=288 => c - 256,
        289..=322 => c - 289 + 127,
        323 => 173,
        _ => return None,
    };
    u8::try_from(byte).ok()
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.vocab)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("stop", &self.stop)
            .finish_non_exhaustive()
    }
}

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    /// A message.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

impl Tokenizer {
    /// Builds the tokenizer described by `tokenizer.ggml.*` (candle's `TokenizerFromGguf`) and reads
    /// the special tokens and `tokenizer.chat_template`.
    pub fn from_gguf(g: &Gguf) -> Result<Self> {
        let mut inner = tokenizers::Tokenizer::from_gguf(g.content())
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", g.path().display())))?;
        fix_pre_tokenizer(g, &mut inner)?;
        let vocab = g.array_len("tokenizer.ggml.tokens")?;
        let token = |key: &str| -> Result<Option<(TokenId, String)>> {
            let Some(id) = g.usize_opt(key)? else {
                return Ok(None);
            };
            let id = TokenId::try_from(id).map_err(|_| Error::BadKey {
                path: g.path().to_path_buf(),
                key: key.to_string(),
                expected: "a token id (below 2^32)",
            })?;
            Ok(inner.id_to_token(id).map(|s| (id, s)))
        };
        let bos = token("tokenizer.ggml.bos_token_id")?;
        let eos = token("tokenizer.ggml.eos_token_id")?;
        let mut stop: Vec<TokenId> = eos.iter().map(|(id, _)| *id).collect();
        // The end-of-turn tokens the file names (llama.cpp's end-of-generation set), then those we
        // know by their text.
        let named = [
            token("tokenizer.ggml.eot_token_id")?,
            token("tokenizer.ggml.eom_token_id")?,
        ];
        let known = END_OF_TURN
            .iter()
            .filter_map(|name| inner.token_to_id(name));
        for id in named.into_iter().flatten().map(|(id, _)| id).chain(known) {
            if !stop.contains(&id) {
                stop.push(id);
            }
        }
        let mut plain = inner.clone();
        plain.set_encode_special_tokens(true);
        let added_tokens = inner.get_added_tokens_decoder();
        let added = added_tokens.keys().copied().collect();
        let specials = added_tokens
            .into_values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        let pieces = match g.str("tokenizer.ggml.model") {
            Ok("gpt2") => Pieces::ByteLevel,
            Ok("llama") => Pieces::SentencePiece,
            _ => Pieces::Decoded,
        };
        Ok(Self {
            inner,
            plain,
            specials,
            vocab,
            bos,
            eos,
            add_bos: g.bool_opt("tokenizer.ggml.add_bos_token")?.unwrap_or(false),
            stop,
            chat_template: g.str("tokenizer.chat_template").ok().map(str::to_string),
            pieces,
            added,
            max_token_bytes: std::sync::OnceLock::new(),
        })
    }

    /// The most bytes of text one token of the vocabulary stands for (at least 1). With a byte-level
    /// vocabulary (every byte has a token) a text of `n` bytes after normalisation needs at least
    /// `n / max_token_bytes()` tokens, which lets a caller refuse a text far too long for a context
    /// without tokenizing it (allowing for normalisation: Qwen2's NFC shortens a text at most
    /// threefold). Computed over the whole vocabulary the first time (milliseconds for a byte-level
    /// one).
    pub fn max_token_bytes(&self) -> usize {
        *self.max_token_bytes.get_or_init(|| {
            (0..self.vocab)
                .filter_map(|id| TokenId::try_from(id).ok())
                .filter_map(|id| self.token_bytes(id))
                .map(|b| b.len())
                .max()
                .unwrap_or(0)
                .max(1)
        })
    }

    /// The vocabulary size of the tokenizer.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Tokens that end generation: the EOS token, the end-of-turn tokens the file names
    /// (`tokenizer.ggml.eot_token_id`, `eom_token_id`) and any the vocabulary has of those we know
    /// by their text (`<|im_end|>`, `<|endoftext|>` for Qwen, `<|eot_id|>`, `<|eom_id|>` for Llama 3).
    pub fn stop_tokens(&self) -> &[TokenId] {
        &self.stop
    }

    /// Encodes text as ordinary text: special-token text such as `<|im_start|>` is tokenized like any
    /// other characters, never turned into the control token (as llama.cpp does for user text). A BOS
    /// token is prepended when the model asks for one and `add_bos` is set.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<TokenId>> {
        let mut ids = Vec::new();
        self.push_bos(add_bos, &mut ids);
        encode_into(&self.plain, text, &mut ids)?;
        Ok(ids)
    }

    /// Encodes text in which special tokens written out (`<|im_start|>`) become their ids: for
    /// prompts that are already formatted, on request (`--parse-special`).
    pub fn encode_with_special(&self, text: &str, add_bos: bool) -> Result<Vec<TokenId>> {
        let mut ids = Vec::new();
        self.push_bos(add_bos, &mut ids);
        let added = ids.len();
        encode_into(&self.inner, text, &mut ids)?;
        if added == 1 && ids.get(1) == ids.first() {
            // The text began with the BOS token itself: keep one.
            ids.remove(0);
        }
        Ok(ids)
    }

    /// Renders `messages` with the chat template and encodes the result. Only the template's own text
    /// becomes special tokens; the content of a message is always ordinary text, so a user who types
    /// `<|im_start|>system` gets those characters, not a new turn.
    ///
    /// When no message spells out a special token, the rendered text is encoded as a whole, exactly as
    /// the template wrote it. Otherwise each content is rendered as a marker and encoded on its own;
    /// should the template change the text of messages (trim it, split it), the markers could not
    /// stand for the contents, and that is an error rather than a silently different prompt.
    pub fn encode_chat(&self, messages: &[Message]) -> Result<Vec<TokenId>> {
        let rendered = self.apply_chat_template(messages)?;
        let mut ids = Vec::new();
        if messages.iter().any(|m| self.has_special_text(&m.content)) {
            self.encode_marked(messages, &rendered, &mut ids)?;
        } else {
            // Parsing can only find the template's own special tokens here.
            encode_into(&self.inner, &rendered, &mut ids)?;
        }
        let bos = self.bos.as_ref().map(|(b, _)| *b);
        if bos.is_some() && ids.first().copied() != bos {
            // The template did not write the BOS token itself.
            let mut with_bos = Vec::with_capacity(ids.len() + 1);
            self.push_bos(true, &mut with_bos);
            with_bos.extend_from_slice(&ids);
            ids = with_bos;
        }
        Ok(ids)
    }

    /// Whether `text` contains the text of a special token.
    fn has_special_text(&self, text: &str) -> bool {
        self.specials.iter().any(|s| text.contains(s.as_str()))
    }

    /// Encodes the template's text with special tokens and each message's content without, given the
    /// template's rendering of the real messages to check the pieces against.
    fn encode_marked(
        &self,
        messages: &[Message],
        rendered: &str,
        ids: &mut Vec<TokenId>,
    ) -> Result<()> {
        let marked: Vec<Message> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| Message::new(m.role.clone(), marker(i)))
            .collect();
        let with_markers = self.apply_chat_template(&marked)?;
        // (template text, the message that follows it)
        let mut pieces: Vec<(&str, Option<&Message>)> = Vec::new();
        let mut rest = with_markers.as_str();
        while let Some(start) = rest.find(MARKER) {
            let after = &rest[start + MARKER.len_utf8()..];
            let message = after.find(MARKER).and_then(|len| {
                let i: usize = after[..len].parse().ok()?;
                Some((messages.get(i)?, len))
            });
            let Some((message, len)) = message else {
                return Err(Error::Template(
                    "the chat template altered a message marker".into(),
                ));
            };
            pieces.push((&rest[..start], Some(message)));
            rest = &after[len + MARKER.len_utf8()..];
        }
        pieces.push((rest, None));
        let rebuilt: String = pieces
            .iter()
            .flat_map(|(text, m)| [*text, m.map_or("", |m| m.content.as_str())])
            .collect();
        if rebuilt != rendered {
            return Err(Error::Template(
                "the chat template changes the text of messages (trims or splits it), so a message \
                 that spells out a special token cannot be kept from becoming one; remove the \
                 special-token text from the message"
                    .into(),
            ));
        }
        for (text, message) in pieces {
            encode_into(&self.inner, text, ids)?;
            if let Some(m) = message {
                encode_into(&self.plain, &m.content, ids)?;
            }
        }
        Ok(())
    }

    /// Replaces the chat template (a Jinja template over `messages`, `add_generation_prompt`,
    /// `bos_token`, `eos_token`).
    pub fn set_chat_template(&mut self, template: impl Into<String>) {
        self.chat_template = Some(template.into());
    }

    fn push_bos(&self, add_bos: bool, ids: &mut Vec<TokenId>) {
        if add_bos && self.add_bos {
            if let Some((bos, _)) = &self.bos {
                ids.push(*bos);
            }
        }
    }

    /// Decodes tokens, special tokens included.
    pub fn decode(&self, ids: &[TokenId]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    /// The token's text, for diagnostics.
    pub fn token_text(&self, id: TokenId) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The bytes the token stands for, which need not be whole UTF-8 characters (a byte-level token
    /// may hold part of one). With a byte-level vocabulary the bytes of a sequence's tokens,
    /// concatenated, are its decoded text; a SentencePiece token keeps the space of its `▁`, which
    /// decoding drops at the start of a text. `None` for an id outside the vocabulary.
    pub fn token_bytes(&self, id: TokenId) -> Option<Vec<u8>> {
        let piece = self.inner.id_to_token(id)?;
        if self.added.contains(&id) {
            return Some(piece.into_bytes());
        }
        let decoded = || self.decode(&[id]).ok().map(String::into_bytes);
        match self.pieces {
            Pieces::ByteLevel => piece
                .chars()
                .map(byte_level_byte)
                .collect::<Option<Vec<u8>>>()
                .or_else(decoded),
            Pieces::SentencePiece => {
                let hex = piece
                    .strip_prefix("<0x")
                    .and_then(|h| h.strip_suffix('>'))
                    .filter(|h| h.len() == 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                Some(match hex {
                    Some(byte) => vec![byte],
                    None => piece.replace('\u{2581}', " ").into_bytes(),
                })
            }
            Pieces::Decoded => decoded(),
        }
    }

    /// Whether the model ships a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders `messages` with the model's chat template, ending with the assistant's turn opened.
    pub fn apply_chat_template(&self, messages: &[Message]) -> Result<String> {
        let template = self
            .chat_template
            .as_deref()
            .ok_or_else(|| Error::Template("the model has no tokenizer.chat_template".into()))?;
        let mut env = Environment::new();
        // The template comes from the model file: bounded in instructions and in output, so that
        // one that loops for ever or writes without end is an error, not a hang or an abort.
        env.set_fuel(Some(TEMPLATE_FUEL.saturating_add(
            TEMPLATE_FUEL_PER_MESSAGE.saturating_mul(messages.len() as u64),
        )));
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", template)
            .map_err(|e| Error::Template(e.to_string()))?;
        let tmpl = env
            .get_template("chat")
            .map_err(|e| Error::Template(e.to_string()))?;
        let name = |t: &Option<(TokenId, String)>| t.as_ref().map(|(_, s)| s.clone());
        let input: usize = messages
            .iter()
            .map(|m| m.role.len() + m.content.len())
            .sum();
        let mut out = Capped {
            bytes: Vec::new(),
            cap: TEMPLATE_OUTPUT.saturating_add(input.saturating_mul(8)),
        };
        tmpl.render_captured_to(
            context! {
                messages => minijinja::Value::from(minijinja::value::Serde(messages)),
                add_generation_prompt => true,
                bos_token => name(&self.bos).unwrap_or_default(),
                eos_token => name(&self.eos).unwrap_or_default(),
            },
            &mut out,
        )
        .map_err(|e| match e.kind() {
            minijinja::ErrorKind::WriteFailure => Error::Template(format!(
                "the chat template wrote more than {} bytes for {input} bytes of messages",
                out.cap
            )),
            _ => Error::Template(e.to_string()),
        })?;
        String::from_utf8(out.bytes).map_err(|e| Error::Template(e.to_string()))
    }
}

/// Instructions a chat template may run ([`Environment::set_fuel`]), and more for each message:
/// far more than a chat template runs per message (the tests render 2,000 messages).
const TEMPLATE_FUEL: u64 = 1_000_000;
const TEMPLATE_FUEL_PER_MESSAGE: u64 = 100_000;

/// Bytes a chat template may write, and eight more per byte of the messages.
const TEMPLATE_OUTPUT: usize = 1 << 20;

/// A writer that fails past `cap` bytes.
struct Capped {
    bytes: Vec<u8>,
    cap: usize,
}

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len().saturating_add(buf.len()) > self.cap {
            return Err(std::io::Error::other(
                "the chat template's output is too long",
            ));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Brackets the index of a message in [`Tokenizer::encode_chat`]: a private-use character no chat
/// template writes.
const MARKER: char = '\u{10FFFD}';

fn marker(i: usize) -> String {
    format!("{MARKER}{i}{MARKER}")
}

fn encode_into(t: &tokenizers::Tokenizer, text: &str, ids: &mut Vec<TokenId>) -> Result<()> {
    if text.is_empty() {
        return Ok(());
    }
    let enc = t
        .encode(text, false)
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    ids.extend_from_slice(enc.get_ids());
    Ok(())
}

/// Names llama.cpp reads as Llama 3's pre-tokenizer (`LLAMA_VOCAB_PRE_TYPE_LLAMA3` in
/// `llama-vocab.cpp`; newer versions add more): its converter writes `llama-bpe` for Llama 3, 3.1
/// and 3.2, a name candle does not know.
const LLAMA3_PRE: [&str; 8] = [
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
];

/// Names llama.cpp reads as Qwen2's pre-tokenizer (`LLAMA_VOCAB_PRE_TYPE_QWEN2`) that files of the
/// `qwen2` architecture carry: `deepseek-r1-qwen` is the DeepSeek-R1 distillations of Qwen2.5's.
const QWEN2_PRE: [&str; 2] = ["qwen2", "deepseek-r1-qwen"];

/// Llama 3's split (llama.cpp's `LLAMA3` regex, as candle writes it): letters, numbers in groups of
/// at most three, punctuation, newlines, spaces.
const LLAMA3_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's split (numbers one digit at a time), as candle writes it.
const QWEN2_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Sets the pre-tokenizer (and what goes with it) that llama.cpp uses for the file's
/// `tokenizer.ggml.pre`, where candle's differs. candle knows `qwen2`, `llama3`, `smaug-bpe` and
/// `lfm2` and maps every other name to GPT-2's byte-level step, which adds a prefix space:
/// - llama.cpp's other names for Llama 3's ([`LLAMA3_PRE`], `llama-bpe` among them) get its split
///   and no prefix space, and every one of them, candle's own `llama3` included, the BPE option
///   `ignore_merges` (a word that is a token of the vocabulary is that token, whatever the merges
///   would make of it), as llama.cpp and Hugging Face's Llama 3 tokenizer set it;
/// - `deepseek-r1-qwen` gets what candle gives `qwen2` (Hugging Face's Qwen2 tokenizer: NFC
///   normalisation, then its split);
/// - any other name keeps GPT-2's step, with the prefix space only where the file does not say
///   `add_space_prefix = false`; for `smollm` llama.cpp also splits digits one by one before it.
fn fix_pre_tokenizer(g: &Gguf, inner: &mut tokenizers::Tokenizer) -> Result<()> {
    use tokenizers::normalizers::unicode::NFC;
    use tokenizers::pre_tokenizers::{
        byte_level::ByteLevel,
        digits::Digits,
        sequence::Sequence,
        split::{Split, SplitPattern},
        PreTokenizerWrapper,
    };
    use tokenizers::SplitDelimiterBehavior;
    let pre = g.str("tokenizer.ggml.pre").unwrap_or("gpt2");
    let split = |regex: &str, byte_level: ByteLevel| -> Result<PreTokenizerWrapper> {
        let split = Split::new(
            SplitPattern::Regex(regex.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(Sequence::new(vec![split.into(), byte_level.into()]).into())
    };
    if LLAMA3_PRE.contains(&pre) {
        inner.with_pre_tokenizer(Some(split(
            LLAMA3_SPLIT,
            ByteLevel::new(false, true, false),
        )?));
        if let tokenizers::ModelWrapper::BPE(bpe) = inner.get_model() {
            let mut bpe = bpe.clone();
            bpe.ignore_merges = true;
            inner.with_model(bpe);
        }
        return Ok(());
    }
    if QWEN2_PRE.contains(&pre) {
        if pre != "qwen2" {
            inner
                .with_normalizer(Some(NFC))
                .map_err(|e| Error::Tokenizer(e.to_string()))?;
            inner.with_pre_tokenizer(Some(split(
                QWEN2_SPLIT,
                ByteLevel::new(false, false, false),
            )?));
        }
        return Ok(());
    }
    if pre == "smaug-bpe" {
        return Ok(());
    }
    let prefix_space = g
        .bool_opt("tokenizer.ggml.add_space_prefix")?
        .unwrap_or(true);
    let byte_level: PreTokenizerWrapper = ByteLevel::new(prefix_space, true, true).into();
    let wrapper = if pre == "smollm" {
        Sequence::new(vec![Digits::new(true).into(), byte_level]).into()
    } else {
        byte_level
    };
    inner.with_pre_tokenizer(Some(wrapper));
    Ok(())
}

/// Whether `bytes` end with the first bytes of a UTF-8 character, not all of them (a valid start
/// that more bytes could complete): what tells a text that ends inside a character, which decodes
/// to a U+FFFD at the end, from one that ends with a U+FFFD of its own.
pub fn ends_inside_a_character(bytes: &[u8]) -> bool {
    let n = bytes.len();
    // The last byte that is not a continuation byte, among the last four.
    (1..=n.min(4))
        .find(|&back| bytes[n - back] & 0xC0 != 0x80)
        .is_some_and(|back| {
            matches!(std::str::from_utf8(&bytes[n - back..]), Err(e) if e.error_len().is_none())
        })
}

/// Turns a stream of tokens into text pieces without ever emitting a broken UTF-8 sequence: a piece is
/// released only once its bytes decode to complete characters.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    ids: Vec<TokenId>,
    prefix: usize,
    read: usize,
}

impl StreamDecoder {
    /// A decoder with nothing decoded yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a token; returns the new text it completes, if any.
    pub fn push(&mut self, tok: &Tokenizer, id: TokenId) -> Result<Option<String>> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        // From the tokens' bytes: a U+FFFD at the end may be the text's own.
        let tail: Vec<u8> = self.ids[self.read..]
            .iter()
            .flat_map(|&id| tok.token_bytes(id).unwrap_or_default())
            .collect();
        if now.len() > before.len() && !ends_inside_a_character(&tail) && now.starts_with(&before) {
            let piece = now[before.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(Some(piece))
        } else {
            Ok(None)
        }
    }

    /// Whatever is still held back (an incomplete character at the end of generation).
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<Option<String>> {
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(now
            .strip_prefix(&before)
            .filter(|s| !s.is_empty())
            .map(str::to_string))
    }
}
