//! GGUF files: candle's bounded header parser, typed metadata access, and tensor reads that check
//! shape, type and extent before allocating anything.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, TensorInfo, Value};
use candle_core::quantized::GgmlDType;

use crate::error::{Error, Result};
use crate::weights::QWeight;

/// candle's header parser, with its panics (a header whose `general.alignment` is 0 divides by
/// zero in it) caught and returned as errors like its own, so that a malformed file is an error,
/// never a crash. While it runs, this thread's panics are not printed: a caught panic's message is
/// in the error.
fn read_header(reader: &mut BufReader<&File>) -> std::result::Result<Content, String> {
    use std::cell::Cell;
    thread_local! {
        static QUIET: Cell<bool> = const { Cell::new(false) };
    }
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(Cell::get) {
                previous(info);
            }
        }));
    });
    QUIET.with(|q| q.set(true));
    let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Content::read(reader)));
    QUIET.with(|q| q.set(false));
    match read {
        Ok(content) => content.map_err(|e| e.to_string()),
        Err(panic) => Err(format!(
            "the header parser failed: {}",
            panic
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("a malformed header")
        )),
    }
}

/// An open GGUF file: its header, with the tensor data left on disk until asked for.
#[derive(Debug)]
pub struct Gguf {
    path: PathBuf,
    file: File,
    len: u64,
    content: Content,
}

impl Gguf {
    /// Opens and parses the header. Counts and lengths in the header are checked against the file
    /// size before anything is allocated, so a corrupt header is an error, never a huge allocation.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        let len = file.metadata().map_err(|e| Error::io(&path, e))?.len();
        let mut reader = BufReader::new(&file);
        let content = read_header(&mut reader).map_err(|reason| Error::Gguf {
            path: path.clone(),
            reason,
        })?;
        Ok(Self {
            path,
            file,
            len,
            content,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The parsed header (metadata and tensor descriptors).
    pub fn content(&self) -> &Content {
        &self.content
    }

    fn value(&self, key: &str) -> Result<&Value> {
        self.content
            .metadata
            .get(key)
            .ok_or_else(|| Error::MissingKey {
                path: self.path.clone(),
                key: key.to_string(),
            })
    }

    fn bad(&self, key: &str, expected: &'static str) -> Error {
        Error::BadKey {
            path: self.path.clone(),
            key: key.to_string(),
            expected,
        }
    }

    /// Whether the metadata holds `key`.
    pub fn has(&self, key: &str) -> bool {
        self.content.metadata.contains_key(key)
    }

    /// A non-negative integer, whatever integer type the file used.
    pub fn usize(&self, key: &str) -> Result<usize> {
        let v = self.value(key)?;
        let n: Option<u64> = match v {
            Value::U8(x) => Some(u64::from(*x)),
            Value::U16(x) => Some(u64::from(*x)),
            Value::U32(x) => Some(u64::from(*x)),
            Value::U64(x) => Some(*x),
            Value::I8(x) => u64::try_from(*x).ok(),
            Value::I16(x) => u64::try_from(*x).ok(),
            Value::I32(x) => u64::try_from(*x).ok(),
            Value::I64(x) => u64::try_from(*x).ok(),
            _ => None,
        };
        n.and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| self.bad(key, "a non-negative integer"))
    }

    /// An optional non-negative integer.
    pub fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        if self.has(key) {
            self.usize(key).map(Some)
        } else {
            Ok(None)
        }
    }

    /// A float.
    pub fn f32(&self, key: &str) -> Result<f32> {
        match self.value(key)? {
            Value::F32(x) => Ok(*x),
            Value::F64(x) => Ok(*x as f32),
            _ => Err(self.bad(key, "a float")),
        }
    }

    /// An optional float.
    pub fn f32_opt(&self, key: &str) -> Result<Option<f32>> {
        if self.has(key) {
            self.f32(key).map(Some)
        } else {
            Ok(None)
        }
    }

    /// A string.
    pub fn str(&self, key: &str) -> Result<&str> {
        match self.value(key)? {
            Value::String(s) => Ok(s),
            _ => Err(self.bad(key, "a string")),
        }
    }

    /// An optional boolean.
    pub fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.content.metadata.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(self.bad(key, "a boolean")),
        }
    }

    /// The length of an array value.
    pub fn array_len(&self, key: &str) -> Result<usize> {
        match self.value(key)? {
            Value::Array(a) => Ok(a.len()),
            _ => Err(self.bad(key, "an array")),
        }
    }

    /// The descriptor of tensor `name`.
    pub fn tensor_info(&self, name: &str) -> Result<&TensorInfo> {
        self.content
            .tensor_infos
            .get(name)
            .ok_or_else(|| Error::MissingTensor {
                path: self.path.clone(),
                name: name.to_string(),
            })
    }

    /// Whether the file holds tensor `name`.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Reads a matrix of `rows` rows of `cols` values (GGUF dims `[cols, rows]`), any supported type.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<QWeight> {
        let info = self.tensor_info(name)?;
        let dims = info.shape.dims();
        if dims != [rows, cols] {
            return Err(Error::TensorShape {
                path: self.path.clone(),
                name: name.to_string(),
                got: dims.to_vec(),
                expected: vec![rows, cols],
            });
        }
        let dtype = info.ggml_dtype;
        if !crate::weights::supported(dtype) || !cols.is_multiple_of(dtype.block_size()) {
            return Err(Error::UnsupportedType {
                path: self.path.clone(),
                name: name.to_string(),
                dtype: format!("{dtype:?} with rows of {cols} values"),
            });
        }
        let elems = rows
            .checked_mul(cols)
            .ok_or_else(|| self.truncated(name, u64::MAX))?;
        let bytes = self.read_bytes(name, info, elems)?;
        QWeight::from_bytes(dtype, &bytes, rows, cols)
    }

    /// Reads a vector of `len` f32 values (norm weights, biases); F16 and BF16 are widened.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let info = self.tensor_info(name)?;
        let dims = info.shape.dims();
        if dims != [len] {
            return Err(Error::TensorShape {
                path: self.path.clone(),
                name: name.to_string(),
                got: dims.to_vec(),
                expected: vec![len],
            });
        }
        if !matches!(
            info.ggml_dtype,
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16
        ) {
            return Err(Error::UnsupportedType {
                path: self.path.clone(),
                name: name.to_string(),
                dtype: format!("{:?} for a vector", info.ggml_dtype),
            });
        }
        let bytes = self.read_bytes(name, info, len)?;
        QWeight::from_bytes(info.ggml_dtype, &bytes, 1, len)?.to_f32()
    }

    /// The raw bytes of `elems` values of a tensor, in an 8-byte-aligned buffer, after checking that
    /// they lie inside the file.
    fn read_bytes(&self, name: &str, info: &TensorInfo, elems: usize) -> Result<AlignedBytes> {
        let dtype = info.ggml_dtype;
        let size = ((elems / dtype.block_size()) as u64)
            .checked_mul(dtype.type_size() as u64)
            .ok_or_else(|| self.truncated(name, u64::MAX))?;
        let start = self
            .content
            .tensor_data_offset
            .checked_add(info.offset)
            .ok_or_else(|| self.truncated(name, u64::MAX))?;
        let end = start
            .checked_add(size)
            .ok_or_else(|| self.truncated(name, u64::MAX))?;
        if end > self.len {
            return Err(self.truncated(name, end));
        }
        let mut buf = AlignedBytes::zeroed(size as usize);
        let mut f = &self.file;
        f.seek(SeekFrom::Start(start))
            .and_then(|_| f.read_exact(buf.as_mut()))
            .map_err(|e| Error::io(&self.path, e))?;
        Ok(buf)
    }

    fn truncated(&self, name: &str, end: u64) -> Error {
        Error::Truncated {
            path: self.path.clone(),
            name: name.to_string(),
            end,
            len: self.len,
        }
    }
}

/// Bytes in a `u64` buffer, so that candle's block types (which hold `f16` fields) can view them.
pub(crate) struct AlignedBytes {
    words: Vec<u64>,
    len: usize,
}

impl AlignedBytes {
    fn zeroed(len: usize) -> Self {
        Self {
            words: vec![0; len.div_ceil(8)],
            len,
        }
    }

    fn as_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        // SAFETY: the u64 buffer holds at least `len` initialised bytes; u8 has no alignment needs.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), len) }
    }
}

impl std::ops::Deref for AlignedBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: as in `as_mut`.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }
}
