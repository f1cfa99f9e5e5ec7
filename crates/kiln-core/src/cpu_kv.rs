//! The CPU backend's paged KV cache: rows of `width` values in f32, f16 or ggml q8_0 blocks,
//! written and read through kiln-quant's reference conversions, so it is the reference every
//! device cache is compared with.

use half::f16;
use kiln_quant::GgmlType;

use crate::backend::{BackendError, Result};
use crate::cpu_simd::KvRow;
use crate::plan::{KvCacheSpec, KvType};

/// Rows of one K or V cache.
pub(crate) enum KvRows {
    F32(Vec<f32>),
    F16(Vec<f16>),
    /// ggml `block_q8_0` bytes, `width / 32` blocks a row.
    Q8(Vec<u8>),
}

impl KvRows {
    fn new(ty: KvType, width: usize) -> Result<KvRows> {
        ty.check_width(width)?;
        Ok(match ty {
            KvType::F32 => KvRows::F32(Vec::new()),
            KvType::F16 => KvRows::F16(Vec::new()),
            KvType::Q8_0 => KvRows::Q8(Vec::new()),
        })
    }

    /// Grows to `rows` rows.
    fn grow(&mut self, rows: usize, width: usize, what: &str) -> Result<()> {
        fn extend<T: Clone>(v: &mut Vec<T>, len: usize, fill: T, what: &str) -> Result<()> {
            if len > v.len() {
                let extra = len - v.len();
                v.try_reserve_exact(extra).map_err(|_| BackendError::OutOfMemory {
                    device: "host".into(),
                    what: what.into(),
                    requested_bytes: (extra * std::mem::size_of::<T>()) as u64,
                    free_bytes: None,
                })?;
                v.resize(len, fill);
            }
            Ok(())
        }
        match self {
            KvRows::F32(v) => extend(v, rows * width, 0.0, what),
            KvRows::F16(v) => extend(v, rows * width, f16::ZERO, what),
            KvRows::Q8(v) => extend(v, rows * KvType::Q8_0.row_bytes(width), 0, what),
        }
    }

    fn store(&mut self, row: usize, width: usize, values: &[f32]) {
        match self {
            KvRows::F32(data) => data[row * width..(row + 1) * width].copy_from_slice(values),
            KvRows::F16(data) => {
                for (d, &v) in data[row * width..(row + 1) * width].iter_mut().zip(values) {
                    *d = f16::from_f32(v);
                }
            }
            KvRows::Q8(data) => {
                let row_bytes = KvType::Q8_0.row_bytes(width);
                kiln_quant::quantize(GgmlType::Q8_0, values, &mut data[row * row_bytes..(row + 1) * row_bytes]).expect("width checked at allocation");
            }
        }
    }

    /// Values `col..col + len` of row `row`, borrowed in their storage type.
    fn row(&self, row: usize, width: usize, col: usize, len: usize) -> KvRow<'_> {
        let at = row * width + col;
        match self {
            KvRows::F32(data) => KvRow::F32(&data[at..at + len]),
            KvRows::F16(data) => KvRow::F16(&data[at..at + len]),
            KvRows::Q8(data) => {
                let at = row * KvType::Q8_0.row_bytes(width);
                KvRow::Q8 { blocks: &data[at + col / 32 * 34..at + (col + len).div_ceil(32) * 34], col: col % 32 }
            }
        }
    }

    /// Values `col..col + out.len()` of row `row` into `out`.
    #[cfg(test)]
    fn load(&self, row: usize, width: usize, col: usize, out: &mut [f32]) {
        match self {
            KvRows::F32(data) => out.copy_from_slice(&data[row * width + col..row * width + col + out.len()]),
            KvRows::F16(data) => {
                for (o, d) in out.iter_mut().zip(&data[row * width + col..]) {
                    *o = d.to_f32();
                }
            }
            KvRows::Q8(data) => {
                let row_bytes = KvType::Q8_0.row_bytes(width);
                let bytes = &data[row * row_bytes..(row + 1) * row_bytes];
                let mut block = [0f32; 32];
                let mut at = col;
                let mut written = 0;
                while written < out.len() {
                    let (b, offset) = (at / 32, at % 32);
                    kiln_quant::dequantize(GgmlType::Q8_0, &bytes[b * 34..(b + 1) * 34], &mut block).expect("one q8_0 block");
                    let take = (32 - offset).min(out.len() - written);
                    out[written..written + take].copy_from_slice(&block[offset..offset + take]);
                    written += take;
                    at += take;
                }
            }
        }
    }
}

pub struct CpuKvCache {
    pub(crate) spec: KvCacheSpec,
    k: KvRows,
    v: KvRows,
    usable_blocks: usize,
    what: String,
}

impl CpuKvCache {
    pub(crate) fn new(spec: &KvCacheSpec, what: &str) -> Result<CpuKvCache> {
        Ok(CpuKvCache { spec: *spec, k: KvRows::new(spec.k_type, spec.width)?, v: KvRows::new(spec.v_type, spec.width)?, usable_blocks: 0, what: what.into() })
    }

    pub(crate) fn grow(&mut self, n_blocks: usize) -> Result<()> {
        if n_blocks > self.spec.n_blocks {
            return Err(BackendError::BadPlan(format!("{}: {n_blocks} blocks asked of a cache of {}", self.what, self.spec.n_blocks)));
        }
        let rows = n_blocks.max(self.usable_blocks) * crate::plan::KV_BLOCK_SIZE;
        self.k.grow(rows, self.spec.width, &self.what)?;
        self.v.grow(rows, self.spec.width, &self.what)?;
        self.usable_blocks = n_blocks.max(self.usable_blocks);
        Ok(())
    }

    pub(crate) fn usable_rows(&self) -> usize {
        self.usable_blocks * crate::plan::KV_BLOCK_SIZE
    }

    pub(crate) fn store(&mut self, row: usize, k: &[f32], v: &[f32]) {
        let width = self.spec.width;
        self.k.store(row, width, k);
        self.v.store(row, width, v);
    }

    /// `len` K values of row `row` from column `col`.
    pub(crate) fn k_row(&self, row: usize, col: usize, len: usize) -> KvRow<'_> {
        self.k.row(row, self.spec.width, col, len)
    }

    pub(crate) fn v_row(&self, row: usize, col: usize, len: usize) -> KvRow<'_> {
        self.v.row(row, self.spec.width, col, len)
    }

    /// `out.len()` K values of row `row` from column `col`, as f32.
    #[cfg(test)]
    pub(crate) fn load_k(&self, row: usize, col: usize, out: &mut [f32]) {
        self.k.load(row, self.spec.width, col, out)
    }

    #[cfg(test)]
    pub(crate) fn load_v(&self, row: usize, col: usize, out: &mut [f32]) {
        self.v.load(row, self.spec.width, col, out)
    }

    pub fn spec(&self) -> &KvCacheSpec {
        &self.spec
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_round_trips_within_its_precision() {
        let width = 64;
        let values: Vec<f32> = (0..width).map(|i| ((i * 37 % 19) as f32 - 9.0) * 0.37).collect();
        for (ty, tolerance) in [(KvType::F32, 0.0), (KvType::F16, 2e-3), (KvType::Q8_0, 0.02)] {
            let spec = KvCacheSpec { n_blocks: 2, width, k_type: ty, v_type: KvType::F32 };
            let mut cache = CpuKvCache::new(&spec, "test").unwrap();
            cache.grow(2).unwrap();
            cache.store(37, &values, &values);
            let mut out = vec![0f32; 40];
            cache.load_k(37, 20, &mut out);
            for (o, v) in out.iter().zip(&values[20..60]) {
                assert!((o - v).abs() <= tolerance * 3.4, "{ty}: {o} vs {v}");
            }
            cache.load_v(37, 20, &mut out);
            assert_eq!(out, values[20..60]);
        }
    }
}
