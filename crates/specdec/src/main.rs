//! The `specdec` command-line program: wires the core and the runtime together. Errors are one line on
//! stderr and a non-zero exit code, mapped in one place below.

mod bench;
mod chat;
mod cli;
mod costcurve;
mod engine;
mod generate;
mod plot;

use std::process::ExitCode;

use clap::Parser;

use crate::cli::{Cli, Command};
use crate::engine::Ui;

/// Exit code for a failure (bad arguments exit with clap's 2).
const EXIT_FAILURE: u8 = 1;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let ui = Ui { quiet: cli.quiet };
    let result = match &cli.command {
        Command::Fetch { models } => fetch(models, ui),
        Command::Generate(args) => generate::command(args, ui),
        Command::Chat(args) => chat::command(args, ui),
        Command::Bench(args) => bench::command(args, ui),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the chain of causes, outermost first.
            let msg: Vec<String> = e.chain().map(|c| c.to_string()).collect();
            eprintln!("error: {}", msg.join(": "));
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

fn fetch(models: &[String], ui: Ui) -> anyhow::Result<()> {
    let defaults = [
        specdec_runtime::fetch::DEFAULT_TARGET.to_string(),
        specdec_runtime::fetch::DEFAULT_DRAFT.to_string(),
    ];
    let models = if models.is_empty() {
        &defaults[..]
    } else {
        models
    };
    for m in models {
        if specdec_runtime::fetch::known(m).is_none() {
            anyhow::bail!(
                "unknown model `{m}`: known aliases are {}",
                specdec_runtime::fetch::ALIASES.join(", ")
            );
        }
        let path = ui.model_path(m)?;
        println!("{m}\t{}", path.display());
    }
    Ok(())
}
