//! The `specdec` command-line program: wires the core and the runtime together. Errors are one line on
//! stderr and a non-zero exit code, mapped in one place below.

mod bench;
mod calibration;
mod chat;
mod cli;
mod costcurve;
mod engine;
mod generate;
mod plot;
mod serve;

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;
use clap::{CommandFactory, FromArgMatches};

use crate::cli::{Cli, Command};
use crate::engine::Ui;

/// Exit code for a failure (bad arguments exit with clap's 2).
const EXIT_FAILURE: u8 = 1;

/// The version line: the crate version, the matrix kernels this CPU runs and whether `--device
/// cuda` is built in.
fn version() -> String {
    let kernels = match specdec_kernels::Kernels::from_env() {
        Ok(k) => format!("kernels {}", k.level().name()),
        Err(e) => format!(
            "kernels {} ({}: {e})",
            specdec_kernels::Kernels::get().level().name(),
            specdec_kernels::LEVEL_ENV
        ),
    };
    let supported: Vec<&str> = specdec_kernels::CpuLevel::supported()
        .into_iter()
        .map(|l| l.name())
        .collect();
    let cuda = if cfg!(feature = "cuda") {
        "with"
    } else {
        "without"
    };
    format!(
        "{} ({kernels}; this CPU supports {}; built {cuda} CUDA)",
        env!("CARGO_PKG_VERSION"),
        supported.join(", ")
    )
}

fn main() -> ExitCode {
    // clap takes a static string; the version is made once per process.
    let version: &'static str = Box::leak(version().into_boxed_str());
    let matches = Cli::command().version(version).get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    let ui = Ui { quiet: cli.quiet };
    let result = match &cli.command {
        Command::Fetch { models } => fetch(models, ui),
        Command::Generate(args) => generate::command(args, ui),
        Command::Chat(args) => chat::command(args, ui),
        Command::Bench(args) => bench::command(args, ui),
        Command::Serve(args) => serve::command(args, ui),
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
        writeln!(std::io::stdout(), "{m}\t{}", path.display())
            .context("printing the model's path")?;
    }
    Ok(())
}
