//! The KV cache: keys and values of every layer for up to `capacity` positions, allocated once, stored
//! as IEEE f16 (half the bytes of f32, the type llama.cpp's cache uses by default).
//!
//! invariant: `truncate` only shortens, in O(1) (a length, no copy); writing past `capacity` is a
//! typed `ContextOverflow`, never a reallocation. The buffers come from the zeroed allocator, so
//! untouched positions cost address space, not resident memory. A value is rounded to f16 (to
//! nearest, ties to even) once, when it is written, so every later read of it sees the same bits.

use specdec_kernels::F16;

use crate::error::{Error, Result};

/// Positions per tile of the key cache: a tile holds its keys transposed, `[head_dim, KEY_TILE]`, so
/// that attention scores a tile's keys side by side in vector lanes with no horizontal sum.
pub(crate) const KEY_TILE: usize = 16;

/// Keys and values per layer as f16 bit patterns, of which the first `len` positions are valid. One KV
/// head's positions are contiguous, so attention over a head reads one stream: values are
/// `[heads, slots, head_dim]`, keys `[heads, slots / KEY_TILE, head_dim, KEY_TILE]` (tiles of
/// 16 positions, each transposed), `slots` being the capacity rounded up to whole tiles.
#[derive(Clone, Debug)]
pub struct KvCache {
    k: Vec<Vec<u16>>,
    v: Vec<Vec<u16>>,
    heads: usize,
    head_dim: usize,
    capacity: usize,
    /// `capacity` rounded up to a multiple of [`KEY_TILE`].
    slots: usize,
    len: usize,
    /// The forward pass's buffers, reused from one pass to the next.
    pub(crate) scratch: crate::model::Scratch,
    /// A cache of a model on a GPU: its keys and values are there ([`KvCache::gpu`]), and the
    /// host buffers above are empty.
    on_device: bool,
    /// The keys and values on the GPU, allocated by the first pass that writes them.
    #[cfg(feature = "cuda")]
    pub(crate) gpu: Option<crate::cuda::GpuCache>,
}

impl KvCache {
    /// A cache for `n_layer` layers of `heads` KV heads of `head_dim` values per position, and
    /// `capacity` positions.
    ///
    /// # Panics
    /// Where the size does not fit in memory, as [`Vec::with_capacity`] does (a size that would
    /// wrap saturates instead, so it never makes a smaller cache than asked).
    pub fn new(n_layer: usize, heads: usize, head_dim: usize, capacity: usize) -> Self {
        let slots = capacity
            .checked_next_multiple_of(KEY_TILE)
            .unwrap_or(usize::MAX);
        let size = heads.saturating_mul(slots).saturating_mul(head_dim);
        Self {
            k: (0..n_layer).map(|_| vec![0; size]).collect(),
            v: (0..n_layer).map(|_| vec![0; size]).collect(),
            heads,
            head_dim,
            capacity,
            slots,
            len: 0,
            scratch: crate::model::Scratch::default(),
            on_device: false,
            #[cfg(feature = "cuda")]
            gpu: None,
        }
    }

    /// A cache for a model on a GPU: the same shape, no host buffers; the device's are allocated
    /// by the first pass.
    #[cfg(feature = "cuda")]
    pub(crate) fn on_device(
        n_layer: usize,
        heads: usize,
        head_dim: usize,
        capacity: usize,
    ) -> Self {
        // No layers: no host buffers.
        let mut cache = Self::new(0, heads, head_dim, capacity);
        cache.k = (0..n_layer).map(|_| Vec::new()).collect();
        cache.v = (0..n_layer).map(|_| Vec::new()).collect();
        cache.on_device = true;
        cache
    }

    /// Layers, KV heads, the head size and whether it is on a GPU: what a model's pass needs its
    /// cache to have.
    pub(crate) fn shape(&self) -> (usize, usize, usize, bool) {
        (self.k.len(), self.heads, self.head_dim, self.on_device)
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
        let rows = k
            .chunks_exact(self.heads * hd)
            .zip(v.chunks_exact(self.heads * hd));
        for (r, (k, v)) in rows.enumerate() {
            let j = pos + r;
            let (keys, values) = (&mut self.k[layer], &mut self.v[layer]);
            for (h, (k, v)) in k.chunks_exact(hd).zip(v.chunks_exact(hd)).enumerate() {
                let at = h * stride + j * hd;
                for (d, &x) in values[at..at + hd].iter_mut().zip(v) {
                    *d = F16::from_f32(x).0;
                }
                // Element `d` of key `j` is lane `j % KEY_TILE` of row `d` of the key's tile.
                let tile = h * stride + (j - j % KEY_TILE) * hd + j % KEY_TILE;
                for (d, &x) in k.iter().enumerate() {
                    keys[tile + d * KEY_TILE] = F16::from_f32(x).0;
                }
            }
        }
    }

    /// Bytes of keys and values held per position (all layers).
    pub fn bytes_per_position(&self) -> usize {
        2 * self.k.len() * self.heads * self.head_dim * std::mem::size_of::<u16>()
    }

    /// Keys and values of layer `layer`, as f16 bit patterns: KV head `h`'s value at position `j` is
    /// at `h * head_stride() + j * head_dim`, and element `d` of its key at `h * head_stride() + (j -
    /// j % KEY_TILE) * head_dim + d * KEY_TILE + j % KEY_TILE`. Slots past the valid positions hold
    /// zeros or keys of truncated positions.
    pub(crate) fn layer(&self, layer: usize) -> (&[u16], &[u16]) {
        (&self.k[layer], &self.v[layer])
    }

    /// The distance between the first keys (and values) of two consecutive KV heads.
    pub(crate) fn head_stride(&self) -> usize {
        self.slots * self.head_dim
    }

    /// Makes the first `n` positions those of `src` (a cache of the same model), so that a sequence
    /// sharing `src`'s first `n` tokens need not compute them: a copy of their keys and values
    /// (whole key tiles), no arithmetic.
    ///
    /// # Errors
    /// [`Error::CacheShape`] if `src` belongs to a model of another shape, [`Error::Rollback`] if it
    /// holds fewer than `n` positions, [`Error::ContextOverflow`] if this one holds fewer.
    pub(crate) fn copy_prefix(&mut self, src: &KvCache, n: usize) -> Result<()> {
        if src.shape() != self.shape() {
            return Err(Error::CacheShape);
        }
        if n > src.len {
            return Err(Error::Rollback {
                len: n,
                cached: src.len,
            });
        }
        if n > self.capacity {
            return Err(Error::ContextOverflow {
                len: n,
                capacity: self.capacity,
            });
        }
        if self.on_device {
            // Invalid until the copy is whole (it can fail part way on the device).
            self.len = 0;
            #[cfg(feature = "cuda")]
            if let Some(g) = &src.gpu {
                crate::cuda::GpuCache::copy_prefix(
                    &mut self.gpu,
                    g,
                    (self.heads, self.head_dim, n),
                    (src.capacity, self.capacity),
                )?;
            }
            self.len = n;
            return Ok(());
        }
        let hd = self.head_dim;
        let (from, to) = (src.head_stride(), self.head_stride());
        // Keys in whole tiles (a partial tile's other lanes are past the valid positions).
        let keys = n.next_multiple_of(KEY_TILE) * hd;
        for (dst, src) in self.k.iter_mut().zip(&src.k) {
            for h in 0..self.heads {
                dst[h * to..h * to + keys].copy_from_slice(&src[h * from..h * from + keys]);
            }
        }
        for (dst, src) in self.v.iter_mut().zip(&src.v) {
            for h in 0..self.heads {
                dst[h * to..h * to + n * hd].copy_from_slice(&src[h * from..h * from + n * hd]);
            }
        }
        self.len = n;
        Ok(())
    }

    /// Marks `len` positions valid after a forward pass wrote them.
    pub(crate) fn set_len(&mut self, len: usize) {
        debug_assert!(len <= self.capacity);
        self.len = len;
    }
}
