//! Block layouts have ggml's fields and sizes (byte for byte but for the K-quants' quants, kept in the
//! kernels' order), and dequantisation follows ggml's definitions.

mod common;

use common::Rng;
use specdec_kernels::{
    dequantize_row, quantize_row_q8_0, ActQ8_0, BlockQ4K, BlockQ4_0, BlockQ5_0, BlockQ6K, BlockQ8K,
    BlockQ8_0, WeightBlock, F16,
};
use std::mem::{align_of, size_of};

#[test]
fn blocks_have_ggml_sizes() {
    assert_eq!(size_of::<BlockQ8_0>(), 34);
    assert_eq!(size_of::<BlockQ4_0>(), 18);
    assert_eq!(size_of::<BlockQ5_0>(), 22);
    assert_eq!(BlockQ5_0::BYTES, size_of::<BlockQ5_0>());
    assert_eq!(size_of::<BlockQ4K>(), 144);
    assert_eq!(size_of::<BlockQ6K>(), 210);
    assert_eq!(size_of::<BlockQ8K>(), 320);
    assert_eq!(align_of::<BlockQ8K>(), 32);
    assert_eq!(align_of::<BlockQ6K>(), 2);
    assert_eq!(BlockQ8_0::BYTES, size_of::<BlockQ8_0>());
    assert_eq!(BlockQ4_0::BYTES, size_of::<BlockQ4_0>());
    assert_eq!(BlockQ4K::BYTES, size_of::<BlockQ4K>());
    assert_eq!(BlockQ6K::BYTES, size_of::<BlockQ6K>());
}

/// `read` and `write` round-trip, and agree with the in-memory `repr(C)` layout on this
/// little-endian target outside `reordered` (the byte range a K-quant keeps in the kernels' order).
fn check_bytes<B: WeightBlock + PartialEq + std::fmt::Debug>(
    rng: &mut Rng,
    reordered: std::ops::Range<usize>,
) {
    let bytes: Vec<u8> = (0..B::BYTES).map(|_| rng.byte()).collect();
    let block = B::read(&bytes).expect("exact length");
    let mut back = vec![0u8; B::BYTES];
    block.write(&mut back);
    assert_eq!(back, bytes);
    // SAFETY: `B` is a `repr(C)` block of plain integers with no padding (size == BYTES).
    let raw = unsafe { std::slice::from_raw_parts((&block as *const B).cast::<u8>(), B::BYTES) };
    assert_eq!(raw[..reordered.start], bytes[..reordered.start]);
    assert_eq!(raw[reordered.end..], bytes[reordered.end..]);
    if !reordered.is_empty() {
        assert_ne!(
            raw[reordered.clone()],
            bytes[reordered],
            "random quants stay put"
        );
    }
    assert!(B::read(&bytes[1..]).is_none());
}

#[test]
fn read_and_write_match_the_memory_layout() {
    let mut rng = Rng(10);
    for _ in 0..20 {
        check_bytes::<BlockQ8_0>(&mut rng, 0..0);
        check_bytes::<BlockQ4_0>(&mut rng, 0..0);
        check_bytes::<BlockQ5_0>(&mut rng, 0..0);
        check_bytes::<BlockQ4K>(&mut rng, 16..144);
        check_bytes::<BlockQ6K>(&mut rng, 0..192);
    }
}

/// ggml's packing of 6-bit scales and mins (the inverse of `get_scale_min_k4`).
fn pack_scales_mins(sc: [u8; 8], m: [u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
    }
    q
}

#[test]
fn q4_k_dequantises_as_ggml() {
    let mut rng = Rng(11);
    for _ in 0..50 {
        let sc: [u8; 8] = std::array::from_fn(|_| rng.byte() & 63);
        let m: [u8; 8] = std::array::from_fn(|_| rng.byte() & 63);
        let qs: [u8; 128] = rng.bytes();
        let (d, dmin) = (rng.scale(), rng.scale());
        let mut bytes = [0u8; 144];
        bytes[..2].copy_from_slice(&d.0.to_le_bytes());
        bytes[2..4].copy_from_slice(&dmin.0.to_le_bytes());
        bytes[4..16].copy_from_slice(&pack_scales_mins(sc, m));
        bytes[16..].copy_from_slice(&qs);
        let block = BlockQ4K::read(&bytes).expect("a whole block");
        assert_eq!(block.scales_mins(), (sc, m));
        let mut out = [0f32; 256];
        block.dequantize(&mut out);
        for (p, &v) in out.iter().enumerate() {
            let (s, l) = (p / 32, p % 32);
            let nibble = (qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0x0f;
            let want =
                d.to_f32() * f32::from(sc[s]) * f32::from(nibble) - dmin.to_f32() * f32::from(m[s]);
            assert_eq!(v.to_bits(), want.to_bits(), "value {p}");
        }
    }
}

#[test]
fn q6_k_dequantises_as_ggml() {
    let mut rng = Rng(12);
    let bytes: [u8; 208] = rng.bytes();
    let d = rng.scale();
    let mut file = bytes.to_vec();
    file.extend(d.0.to_le_bytes());
    let block = BlockQ6K::read(&file).expect("a whole block");
    let mut out = [0f32; 256];
    block.dequantize(&mut out);
    // ggml's dequantize_row_q6_K on the file's bytes, transcribed loop for loop.
    let mut want = [0f32; 256];
    let d = d.to_f32();
    let scales = bytes[192..].iter().map(|&b| b as i8).collect::<Vec<_>>();
    for n in 0..2 {
        let (ql, qh, sc, y) = (
            &bytes[64 * n..128],
            &bytes[128 + 32 * n..192],
            &scales[8 * n..],
            &mut want[128 * n..],
        );
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) as i8 - 32;
            let q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            y[l] = d * f32::from(sc[is]) * f32::from(q1);
            y[l + 32] = d * f32::from(sc[is + 2]) * f32::from(q2);
            y[l + 64] = d * f32::from(sc[is + 4]) * f32::from(q3);
            y[l + 96] = d * f32::from(sc[is + 6]) * f32::from(q4);
        }
    }
    assert_eq!(out.map(f32::to_bits), want.map(f32::to_bits));
}

/// ggml's `dequantize_row_q5_0`, transcribed.
#[test]
fn q5_0_dequantises_as_ggml() {
    let mut rng = Rng(55);
    for _ in 0..200 {
        let b = BlockQ5_0 {
            d: F16::from_f32(0.25 * rng.unit()),
            qh: rng.bytes(),
            qs: rng.bytes(),
        };
        let mut out = [0f32; 32];
        b.dequantize(&mut out);
        let d = b.d.to_f32();
        let qh = u32::from_le_bytes(b.qh);
        let mut want = [0f32; 32];
        for j in 0..16 {
            let xh0 = (((qh >> j) << 4) & 0x10) as u8;
            let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
            let x0 = ((b.qs[j] & 0x0f) | xh0) as i32 - 16;
            let x1 = ((b.qs[j] >> 4) | xh1) as i32 - 16;
            want[j] = x0 as f32 * d;
            want[j + 16] = x1 as f32 * d;
        }
        assert_eq!(out.map(f32::to_bits), want.map(f32::to_bits));
    }
}

#[test]
fn q4_0_and_q8_0_dequantise_as_ggml() {
    let q4 = BlockQ4_0 {
        d: F16::from_f32(0.5),
        qs: std::array::from_fn(|i| (i as u8) | 0xf0),
    };
    let mut out = [0f32; 32];
    q4.dequantize(&mut out);
    for i in 0..16 {
        assert_eq!(out[i], (i as f32 - 8.0) * 0.5);
        assert_eq!(out[i + 16], 7.0 * 0.5);
    }
    let q8 = BlockQ8_0 {
        d: F16::from_f32(-2.0),
        qs: std::array::from_fn(|i| i as i8 - 16),
    };
    let mut row = [0f32; 64];
    dequantize_row(&[q8, q8], &mut row);
    assert_eq!(row[0], 32.0);
    assert_eq!(row[63], -30.0);
}

#[test]
fn q8_0_activations_round_their_scale_to_f16_and_quants_half_away_from_zero() {
    // amax = 127 · 0.1 so d = 0.1 (rounded to f16); the value 2.5 · d rounds away from zero to 3.
    let mut x = [0f32; 32];
    x[0] = 12.7;
    x[1] = -2.5 * 0.1;
    let mut out = [ActQ8_0 {
        d: 0.0,
        sum: 0,
        qs: [0; 32],
    }];
    quantize_row_q8_0(&x, &mut out);
    assert_eq!(out[0].d, F16::from_f32(0.1).to_f32());
    assert_eq!(out[0].qs[0], 127);
    assert_eq!(
        out[0].qs[1],
        (x[1] * (1.0 / (12.7f32 / 127.0))).round() as i8
    );
    assert_eq!(out[0].to_block().d, F16::from_f32(0.1));
}
