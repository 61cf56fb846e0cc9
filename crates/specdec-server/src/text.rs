//! From tokens to the text a client sees: incremental detokenisation that never ends a piece inside a
//! UTF-8 character, and stop strings matched on the decoded text, holding back just the text that
//! could still become a stop string (also when streaming).

use specdec_core::TokenId;

use crate::engine::Codec;

/// Decodes tokens one at a time into the text they complete.
#[derive(Clone, Debug, Default)]
pub struct Detokenizer {
    ids: Vec<TokenId>,
    prefix: usize,
    read: usize,
}

impl Detokenizer {
    /// Adds a token; returns the new text it completes (empty while a character is incomplete).
    pub fn push(&mut self, codec: &dyn Codec, id: TokenId) -> String {
        self.ids.push(id);
        let before = codec.decode(&self.ids[self.prefix..self.read]);
        let now = codec.decode(&self.ids[self.prefix..]);
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') && now.starts_with(&before) {
            let piece = now[before.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            piece
        } else {
            String::new()
        }
    }

    /// Whatever is still held back at the end (an incomplete character, as U+FFFD).
    pub fn finish(&mut self, codec: &dyn Codec) -> String {
        let before = codec.decode(&self.ids[self.prefix..self.read]);
        let now = codec.decode(&self.ids[self.prefix..]);
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        now.strip_prefix(&before).unwrap_or_default().to_string()
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
