//! `specdec chat`: an interactive conversation through the model's chat template. The sessions keep
//! their caches between turns, so each turn only processes the new tokens.
//!
//! When the history and room for the reply no longer fit the context, the oldest exchanges are dropped
//! (the system prompt stays) with a one-line notice, so the chat keeps going.

use std::io::{BufRead, Write};

use anyhow::Result;
use specdec_core::TokenId;
use specdec_runtime::{Message, Tokenizer};

use crate::cli::ChatArgs;
use crate::engine::{Loaded, Ui};
use crate::generate::{run_to_stdout, stats_line};

/// `specdec chat`.
pub fn command(args: &ChatArgs, ui: Ui) -> Result<()> {
    let loaded = Loaded::load(&args.model, &[args.decode.drafter], ui)?;
    let mut config = crate::engine::generate_config(&args.decode, &loaded.tokenizer)?;
    crate::calibration::apply(&mut config.draft_len, &loaded, true, ui)?;
    let mut target = loaded.target_session();
    let mut drafter = loaded.drafter(args.decode.drafter)?;
    crate::engine::install_ctrl_c();
    let system: Vec<Message> = args
        .system
        .iter()
        .map(|s| Message::new("system", s.clone()))
        .collect();
    let mut history = system.clone();
    // What the turns so far saw lately (their steps and the model's acceptance), for the next.
    let mut learned = None;
    let budget = prompt_budget(loaded.ctx, config.max_new_tokens);
    ui.note(
        "chat: type a message and press Enter; /reset clears the history, /exit or Ctrl-D quits",
    );
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        eprint!("> ");
        std::io::stderr().flush()?;
        let Some(line) = lines.next() else { break };
        let line = line?;
        let line = line.trim();
        match line {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                history = system.clone();
                ui.note("history cleared");
                continue;
            }
            _ => {}
        }
        let room = format!("--ctx {} minus room for the reply", loaded.ctx);
        if let Err(e) = loaded.check_fits("this message", line.len() as u64, budget, &room) {
            eprintln!("error: {e:#}");
            continue;
        }
        // Ctrl-C stops the reply being generated; the chat goes on.
        crate::engine::INTERRUPTED.store(false, std::sync::atomic::Ordering::SeqCst);
        history.push(Message::new("user", line));
        let count = |h: &[Message]| prompt_tokens(&loaded.tokenizer, h).map(|p| p.len());
        let dropped = match messages_to_drop(&history, system.len(), count, budget) {
            Ok(dropped) => dropped,
            Err(e) => {
                // E.g. a template that rewrites messages, given one that spells a special token:
                // this message is refused, the chat goes on.
                history.pop();
                eprintln!("error: {e:#}");
                continue;
            }
        };
        match dropped {
            Some(0) => {}
            Some(n) => {
                history.drain(system.len()..system.len() + n);
                let s = if n == 1 { "" } else { "s" };
                ui.note(format!(
                    "note: context full: dropped the {n} oldest message{s}"
                ));
            }
            None => {
                // Not even this message alone fits: say so, and keep the history as it was.
                history.pop();
                let mut alone = system.clone();
                alone.push(Message::new("user", line));
                let len = prompt_tokens(&loaded.tokenizer, &alone)?.len();
                eprintln!(
                    "error: this message does not fit the context: {len} prompt tokens, {budget} \
                     allowed (--ctx {} minus room for the reply); shorten it or raise --ctx",
                    loaded.ctx
                );
                continue;
            }
        }
        let prompt = prompt_tokens(&loaded.tokenizer, &history)?;
        let g = run_to_stdout(
            &mut target,
            &mut drafter,
            &loaded.tokenizer,
            &prompt,
            &config,
            &args.decode.stop,
        )?;
        ui.note(stats_line(&g, &config));
        // The next turn starts from the calibration this one taught.
        let metrics = &g.output.metrics;
        if let Some(cal) = crate::calibration::learn_saved(&loaded, metrics, learned.as_ref(), ui) {
            cal.set_prior(&mut config.draft_len);
            learned = Some(cal);
        }
        if let Some(e) = &g.error {
            eprintln!("error: {e}");
        }
        // Also a reply cut off by the context: the next turn drops old messages to make room.
        history.push(Message::new("assistant", g.text));
    }
    Ok(())
}

/// The prompt of a turn: `history` through the chat template. Every token count of a history comes
/// from here.
fn prompt_tokens(tokenizer: &Tokenizer, history: &[Message]) -> Result<Vec<TokenId>> {
    Ok(tokenizer.encode_chat(history)?)
}

/// The most prompt tokens a turn may use in a context of `ctx`, leaving room for a reply of
/// `max_tokens`: at least one token (the decoder needs room for one), at most half the context (so a
/// huge `--max-tokens` does not empty the history).
fn prompt_budget(ctx: usize, max_tokens: usize) -> usize {
    ctx.saturating_sub(max_tokens.clamp(1, (ctx / 2).max(1)))
}

/// How many messages after the first `keep` (the system prompt) to drop, oldest first, so that the
/// prompt of the rest is at most `budget` tokens as counted by `count`; `None` when even the last
/// message alone (with the first `keep`) does not fit. The kept part always starts with a user message
/// (an exchange is dropped whole), and the last message is never dropped.
fn messages_to_drop<E>(
    history: &[Message],
    keep: usize,
    mut count: impl FnMut(&[Message]) -> Result<usize, E>,
    budget: usize,
) -> Result<Option<usize>, E> {
    let Some(last) = history.len().checked_sub(1) else {
        return Ok(Some(0));
    };
    let keep = keep.min(last);
    let mut candidate = Vec::with_capacity(history.len());
    for start in keep..=last {
        // Start at a user message, or at the last message whatever it is.
        if start > keep && start < last && history[start].role != "user" {
            continue;
        }
        candidate.clear();
        candidate.extend_from_slice(&history[..keep]);
        candidate.extend_from_slice(&history[start..]);
        if count(&candidate)? <= budget {
            return Ok(Some(start - keep));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> Message {
        Message::new(role, content)
    }

    /// One token per byte of content plus two per message: a stand-in for the template.
    fn count(h: &[Message]) -> Result<usize, ()> {
        Ok(h.iter().map(|m| m.content.len() + 2).sum())
    }

    fn chat() -> Vec<Message> {
        vec![
            msg("system", "sys"),          // 5
            msg("user", "aaaa"),           // 6
            msg("assistant", "bbbbbbbb"),  // 10
            msg("user", "cc"),             // 4
            msg("assistant", "dddddddd"),  // 10
            msg("user", "eeeeeeeeeeeeee"), // 16
        ]
    }

    #[test]
    fn nothing_is_dropped_while_the_history_fits() {
        assert_eq!(messages_to_drop(&chat(), 1, count, 51), Ok(Some(0)));
        assert_eq!(messages_to_drop(&chat(), 1, count, 1000), Ok(Some(0)));
    }

    #[test]
    fn whole_exchanges_are_dropped_oldest_first() {
        // 51 in all; without the first exchange 35, without both 21.
        assert_eq!(messages_to_drop(&chat(), 1, count, 50), Ok(Some(2)));
        assert_eq!(messages_to_drop(&chat(), 1, count, 35), Ok(Some(2)));
        assert_eq!(messages_to_drop(&chat(), 1, count, 34), Ok(Some(4)));
        assert_eq!(messages_to_drop(&chat(), 1, count, 21), Ok(Some(4)));
    }

    #[test]
    fn the_system_prompt_is_kept_and_a_message_too_long_alone_is_none() {
        assert_eq!(messages_to_drop(&chat(), 1, count, 20), Ok(None));
        // Without a system prompt the last message alone needs 16.
        assert_eq!(messages_to_drop(&chat()[1..], 0, count, 16), Ok(Some(4)));
        assert_eq!(messages_to_drop(&chat()[1..], 0, count, 15), Ok(None));
    }

    #[test]
    fn the_kept_messages_reach_the_count_in_order() {
        let mut seen = Vec::new();
        let r = messages_to_drop(
            &chat(),
            1,
            |h: &[Message]| -> Result<usize, ()> {
                seen.push(h.iter().map(|m| m.content.clone()).collect::<Vec<_>>());
                count(h)
            },
            21,
        );
        assert_eq!(r, Ok(Some(4)));
        assert_eq!(
            seen,
            [
                vec![
                    "sys",
                    "aaaa",
                    "bbbbbbbb",
                    "cc",
                    "dddddddd",
                    "eeeeeeeeeeeeee"
                ],
                vec!["sys", "cc", "dddddddd", "eeeeeeeeeeeeee"],
                vec!["sys", "eeeeeeeeeeeeee"],
            ]
        );
    }

    #[test]
    fn count_errors_pass_through() {
        assert_eq!(
            messages_to_drop(&chat(), 1, |_: &[Message]| Err::<usize, _>("bad"), 10),
            Err("bad")
        );
    }

    #[test]
    fn the_budget_leaves_room_for_a_capped_reply() {
        assert_eq!(prompt_budget(256, 32), 224);
        assert_eq!(prompt_budget(256, 10_000), 128);
        assert_eq!(prompt_budget(256, 0), 255);
        assert_eq!(prompt_budget(2, 1), 1);
        assert_eq!(prompt_budget(1, 5), 0);
    }
}
