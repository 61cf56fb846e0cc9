//! From tokens to the text a client sees: incremental detokenisation that never ends a piece inside a
//! UTF-8 character, and stop strings matched on the decoded text, holding back just the text that
//! could still become a stop string (also when streaming).

use specdec_core::TokenId;
use specdec_runtime::tokenizer::ends_inside_a_character;

use crate::engine::Codec;

/// Decodes tokens one at a time into the text they complete.
///
/// A token whose text ends inside a UTF-8 character releases the complete characters before it at
/// once and holds back only the incomplete one, so a stop string in that text ends generation at this
/// token, not the next.
#[derive(Clone, Debug, Default)]
pub struct Detokenizer {
    ids: Vec<TokenId>,
    /// Decoding restarts at `ids[prefix]` (a few tokens of context, for decoders that look at the
    /// previous token, such as SentencePiece's leading space).
    prefix: usize,
    /// `ids[prefix..read]` decode to text already released in full.
    read: usize,
    /// Bytes of the text of `ids[read..]` already released (its complete characters).
    sent: usize,
}

impl Detokenizer {
    /// Adds a token; returns the new text it completes (without a trailing incomplete character).
    pub fn push(&mut self, codec: &dyn Codec, id: TokenId) -> String {
        self.ids.push(id);
        let before = codec.decode(&self.ids[self.prefix..self.read]);
        let now = codec.decode(&self.ids[self.prefix..]);
        if !now.starts_with(&before) {
            return String::new();
        }
        // An incomplete character decodes as one U+FFFD at the end; the characters before it are
        // final. Whether the text ends inside a character is read from the tokens' bytes, as a
        // U+FFFD in the text may also be a character of its own, released like any other.
        let tail: Vec<u8> = self.ids[self.read..]
            .iter()
            .flat_map(|&id| codec.token_bytes(id))
            .collect();
        let complete = !ends_inside_a_character(&tail);
        let end = if complete {
            now.len()
        } else {
            now.strip_suffix('\u{FFFD}').unwrap_or(&now).len()
        };
        let from = before.len() + self.sent;
        let piece = now.get(from..end).unwrap_or_default().to_string();
        if complete && end > before.len() {
            self.prefix = self.read;
            self.read = self.ids.len();
            self.sent = 0;
        } else {
            self.sent += piece.len();
        }
        piece
    }

    /// Whatever is still held back at the end (an incomplete character, as U+FFFD).
    pub fn finish(&mut self, codec: &dyn Codec) -> String {
        let before = codec.decode(&self.ids[self.prefix..self.read]);
        let now = codec.decode(&self.ids[self.prefix..]);
        let from = before.len() + self.sent;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        self.sent = 0;
        match now.get(from..) {
            Some(rest) if now.starts_with(&before) => rest.to_string(),
            _ => String::new(),
        }
    }
}

/// Where the text is cut: before the stop string that is complete first (the smallest end, then the
/// longest), as if the text arrived one character at a time, whatever the pieces.
fn first_stop(text: &str, stops: &[String]) -> Option<usize> {
    stops
        .iter()
        .filter_map(|s| text.find(s.as_str()).map(|i| (i + s.len(), i)))
        .min()
        .map(|(_, start)| start)
}

/// What [`StopText::push`] lets through.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Release {
    /// Text that cannot be part of a stop string.
    Text(String),
    /// A stop string was found: the text before it, and generation should end.
    Stopped(String),
}

/// Stop strings matched on the decoded text.
#[derive(Clone, Debug, Default)]
pub struct StopText {
    stops: Vec<String>,
    held: String,
}

impl StopText {
    /// Matches `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    /// Adds decoded text; returns what may be sent.
    pub fn push(&mut self, piece: &str) -> Release {
        self.held.push_str(piece);
        if self.stops.is_empty() {
            return Release::Text(std::mem::take(&mut self.held));
        }
        if let Some(at) = first_stop(&self.held, &self.stops) {
            let out = self.held[..at].to_string();
            self.held.clear();
            return Release::Stopped(out);
        }
        // Hold the longest suffix that is the start of a stop string; `char_indices` keeps the cut
        // on a character boundary.
        let keep_from = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let rest = self.held.split_off(keep_from);
        Release::Text(std::mem::replace(&mut self.held, rest))
    }

    /// The text held back when generation ends without a stop string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    fn run(pieces: &[&str], stops: &[&str]) -> (String, bool) {
        let mut st = StopText::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            match st.push(p) {
                Release::Text(t) => out.push_str(&t),
                Release::Stopped(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&st.finish());
        (out, false)
    }

    #[test]
    fn a_stop_string_split_across_pieces_is_found_and_cut() {
        assert_eq!(
            run(&["Hello wo", "r", "ld!"], &["world"]),
            ("Hello ".into(), true)
        );
        assert_eq!(run(&["a", "b", "c"], &["bd"]), ("abc".into(), false));
        assert_eq!(run(&["x</", "s>y"], &["</s>", "y"]), ("x".into(), true));
        // Multi-byte characters are never cut.
        assert_eq!(run(&["café", "é!"], &["é!"]), ("café".into(), true));
        assert_eq!(run(&["caf", "é!"], &["é!"]), ("caf".into(), true));
        assert_eq!(run(&["日本", "語"], &["本語"]), ("日".into(), true));
    }

    /// Tokens standing for raw bytes, decoded as UTF-8 with U+FFFD for what is not (as the real
    /// tokenizers do).
    struct Bytes(Vec<Vec<u8>>);

    impl Bytes {
        fn of(tokens: &[&[u8]]) -> Self {
            Bytes(tokens.iter().map(|t| t.to_vec()).collect())
        }
    }

    impl Codec for Bytes {
        fn encode(&self, _: &str) -> Result<Vec<TokenId>, String> {
            Err("not used".into())
        }
        fn encode_chat(&self, _: &[(String, String)]) -> Result<Vec<TokenId>, String> {
            Err("not used".into())
        }
        fn decode(&self, ids: &[TokenId]) -> String {
            let bytes: Vec<u8> = ids
                .iter()
                .flat_map(|&i| self.0[i as usize].iter().copied())
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
        fn token_bytes(&self, id: TokenId) -> Vec<u8> {
            self.0[id as usize].clone()
        }
        fn stop_tokens(&self) -> Vec<TokenId> {
            Vec::new()
        }
    }

    #[test]
    fn complete_characters_are_released_with_the_token_that_ends_them() {
        // "é" is C3 A9, "日" E6 97 A5: token 1 ends with half of "é", token 3 starts "日".
        let codec = Bytes::of(&[b"ab", b"c\xC3", b"\xA9d", b"e\xE6", b"\x97", b"\xA5!"]);
        let mut d = Detokenizer::default();
        let pieces: Vec<String> = (0..6).map(|i| d.push(&codec, i)).collect();
        assert_eq!(pieces, ["ab", "c", "éd", "e", "", "日!"]);
        assert_eq!(d.finish(&codec), "");
        // An incomplete character at the end comes out as U+FFFD, once.
        let codec = Bytes::of(&[b"x\xE6", b"\x97"]);
        let mut d = Detokenizer::default();
        assert_eq!(d.push(&codec, 0), "x");
        assert_eq!(d.push(&codec, 1), "");
        assert_eq!(d.finish(&codec), "\u{FFFD}");
    }

    /// A U+FFFD that the text holds (three bytes of its own, not an incomplete character) is
    /// released with its token like any other character, and the window decoded again moves on.
    #[test]
    fn a_replacement_character_of_the_text_is_released_at_once() {
        let fffd = "\u{FFFD}".as_bytes();
        let codec = Bytes::of(&[fffd, fffd, b"a", b"\xE6", fffd]);
        let mut d = Detokenizer::default();
        let pieces: Vec<String> = (0..5).map(|i| d.push(&codec, i)).collect();
        // Token 3 begins a character that token 4's bytes do not continue: both are final then.
        assert_eq!(
            pieces,
            ["\u{FFFD}", "\u{FFFD}", "a", "", "\u{FFFD}\u{FFFD}"]
        );
        assert_eq!(d.finish(&codec), "");
        assert!(ends_inside_a_character(b"x\xE6\x97"));
        assert!(ends_inside_a_character(b"\xF0\x9F\x90"));
        assert!(!ends_inside_a_character(fffd));
        assert!(!ends_inside_a_character(b"\xE6\x97\xA5"));
        // Not a valid start: nothing can complete it.
        assert!(!ends_inside_a_character(b"\xE0\x80"));
        assert!(!ends_inside_a_character(b"\x80"));
        assert!(!ends_inside_a_character(b""));
    }

    #[test]
    fn a_stop_string_before_an_incomplete_character_stops_at_that_token() {
        // Token 1 completes the stop string "END" and begins a character.
        let codec = Bytes::of(&[b"x EN", b"D\xC3", b"\xA9"]);
        let mut d = Detokenizer::default();
        let mut st = StopText::new(vec!["END".into()]);
        assert_eq!(st.push(&d.push(&codec, 0)), Release::Text("x ".into()));
        assert_eq!(st.push(&d.push(&codec, 1)), Release::Stopped(String::new()));
    }

    proptest! {
        #[test]
        fn pieces_concatenate_to_the_decoded_text(
            text in "[aé日🐱]{0,12}",
            cuts in proptest::collection::vec(0usize..64, 0..10),
        ) {
            // Split the bytes anywhere, also inside characters.
            let bytes = text.as_bytes();
            let mut at: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
            at.push(0);
            at.push(bytes.len());
            at.sort_unstable();
            at.dedup();
            let tokens: Vec<Vec<u8>> = at.windows(2).map(|w| bytes[w[0]..w[1]].to_vec()).collect();
            let n = tokens.len();
            let codec = Bytes(tokens);
            let mut d = Detokenizer::default();
            let mut out = String::new();
            for i in 0..n {
                let piece = d.push(&codec, i as TokenId);
                prop_assert!(!piece.contains('\u{FFFD}'), "a released piece is all complete characters");
                out.push_str(&piece);
                // Everything released so far is a prefix of the text.
                prop_assert!(text.starts_with(&out));
            }
            out.push_str(&d.finish(&codec));
            prop_assert_eq!(out, text);
        }
    }

    #[test]
    fn held_text_is_only_a_possible_stop_prefix() {
        let mut st = StopText::new(vec!["END".into()]);
        assert_eq!(st.push("abc E"), Release::Text("abc ".into()));
        assert_eq!(st.push("N"), Release::Text(String::new()));
        assert_eq!(st.push("x"), Release::Text("ENx".into()));
    }

    proptest! {
        #[test]
        fn released_text_is_the_text_up_to_the_first_stop(
            text in "[ab日é]{0,24}",
            stops in proptest::collection::vec("[ab日é]{1,3}", 0..3),
            cuts in proptest::collection::vec(0usize..30, 0..8),
        ) {
            // Split on character boundaries at the chosen places.
            let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
            let mut at: Vec<usize> = cuts.iter().map(|c| bounds[c % bounds.len()]).collect();
            at.push(0);
            at.push(text.len());
            at.sort_unstable();
            at.dedup();
            let pieces: Vec<&str> = at.windows(2).map(|w| &text[w[0]..w[1]]).collect();
            let stop_refs: Vec<&str> = stops.iter().map(String::as_str).collect();
            let (got, stopped) = run(&pieces, &stop_refs);
            match first_stop(&text, &stops) {
                Some(i) => {
                    prop_assert!(stopped);
                    prop_assert_eq!(got, &text[..i]);
                }
                None => {
                    prop_assert!(!stopped);
                    prop_assert_eq!(got, text);
                }
            }
        }
    }
}
