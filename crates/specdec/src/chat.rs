//! `specdec chat`: an interactive conversation through the model's chat template. The sessions keep
//! their caches between turns, so each turn only processes the new tokens.

use std::io::{BufRead, Write};

use anyhow::Result;
use specdec_runtime::Message;

use crate::cli::ChatArgs;
use crate::engine::{Loaded, Ui};
use crate::generate::{run_to_stdout, stats_line};

/// `specdec chat`.
pub fn command(args: &ChatArgs, ui: Ui) -> Result<()> {
    let loaded = Loaded::load(&args.model, &[args.decode.drafter], ui)?;
    let config = crate::engine::generate_config(&args.decode, &loaded.tokenizer)?;
    let mut target = loaded.target_session();
    let mut drafter = loaded.drafter(args.decode.drafter)?;
    crate::engine::install_ctrl_c();
    let system: Vec<Message> = args
        .system
        .iter()
        .map(|s| Message::new("system", s.clone()))
        .collect();
    let mut history = system.clone();
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
        // Ctrl-C stops the reply being generated; the chat goes on.
        crate::engine::INTERRUPTED.store(false, std::sync::atomic::Ordering::SeqCst);
        history.push(Message::new("user", line));
        let prompt = loaded.tokenizer.encode_chat(&history)?;
        let g = run_to_stdout(
            &mut target,
            &mut drafter,
            &loaded.tokenizer,
            &prompt,
            &config,
        )?;
        ui.note(stats_line(&g));
        if let Some(e) = &g.error {
            eprintln!("error: {e}");
        }
        history.push(Message::new("assistant", g.text));
    }
    Ok(())
}
