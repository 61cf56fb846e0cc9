//! The KV cache: keys and values of every layer for up to `capacity` positions, allocated once, stored
//! as IEEE f16 (half the bytes of f32, the type llama.cpp's cache uses by default).
//!
//! invariant: `truncate` only shortens, in O(1) (a length, no copy); writing past `capacity` is a
//! typed `ContextOverflow`, never a reallocation. The buffers come from the zeroed allocator, so
//! untouched positions cost address space, not resident memory. A value is rounded to f16 (to
//! nearest, ties to even) once, when it is written, so every later read of it sees the same bits.

use specdec_kernels::F16;

use crate::error::{Error, Result};

/// Keys and values per layer, `[heads, capacity, head_dim]` f16 bit patterns each (one KV head's
/// positions contiguous, so attention over a head reads one stream), of which the first `len`
/// positions are valid.
#[derive(Clone, Debug)]
pub struct KvCache {
    k: Vec<Vec<u16>>,
    v: Vec<Vec<u16>>,
    heads: usize,
    head_dim: usize,
    capacity: usize,
    len: usize,
    /// The forward pass's buffers, reused from one pass to the next.
    pub(crate) scratch: crate::model::Scratch,
}

impl KvCache {
    /// A cache for `n_layer` layers of `heads` KV heads of `head_dim` values per position, and
    /// `capacity` positions.
    pub fn new(n_layer: usize, heads: usize, head_dim: usize, capacity: usize) -> Self {
        let size = heads * capacity * head_dim;
        Self {
            k: (0..n_layer).map(|_| vec![0; size]).collect(),
            v: (0..n_layer).map(|_| vec![0; size]).collect(),
            heads,
            head_dim,
            capacity,
            len: 0,
            scratch: crate::model::Scratch::default(),
        }
    }

    /// Valid positions.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no position is valid.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most positions it can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Keeps the first `len` positions. Growing is an error.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.len {
            return Err(Error::Rollback {
                len,
                cached: self.len,
            });
        }
        self.len = len;
        Ok(())
    }

    /// Checks that `m` positions starting at `pos` (which must be the current length) fit.
    pub(crate) fn reserve(&self, pos: usize, m: usize) -> Result<()> {
        if pos != self.len {
            return Err(Error::Rollback {
                len: pos,
                cached: self.len,
            });
        }
        if pos + m > self.capacity {
            return Err(Error::ContextOverflow {
                len: pos + m,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    /// Writes positions `pos..pos + m` of layer `layer` (`k` and `v` are `[m, heads * head_dim]`),
    /// rounded to f16.
    pub(crate) fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let hd = self.head_dim;
        let stride = self.head_stride();
        for (src, dst) in [(k, &mut self.k[layer]), (v, &mut self.v[layer])] {
            for (r, row) in src.chunks_exact(self.heads * hd).enumerate() {
                for (h, head) in row.chunks_exact(hd).enumerate() {
                    let at = h * stride + (pos + r) * hd;
                    for (d, &x) in dst[at..at + hd].iter_mut().zip(head) {
                        *d = F16::from_f32(x).0;
                    }
                }
            }
        }
    }

    /// Bytes of keys and values held per position (all layers).
    pub fn bytes_per_position(&self) -> usize {
        2 * self.k.len() * self.heads * self.head_dim * std::mem::size_of::<u16>()
    }

    /// Keys and values of layer `layer`, as f16 bit patterns: KV head `h`'s position `j` is at
    /// `h * head_stride() + j * head_dim`.
    pub(crate) fn layer(&self, layer: usize) -> (&[u16], &[u16]) {
        (&self.k[layer], &self.v[layer])
    }

    /// The distance between the first values of two consecutive KV heads.
    pub(crate) fn head_stride(&self) -> usize {
        self.capacity * self.head_dim
    }

    /// Marks `len` positions valid after a forward pass wrote them.
    pub(crate) fn set_len(&mut self, len: usize) {
        debug_assert!(len <= self.capacity);
        self.len = len;
    }
}
