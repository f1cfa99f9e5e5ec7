//! Writes planned tensors to a GGUF file one tensor at a time, converting a
//! bounded chunk of rows at once, rows in parallel.

use std::io::{self, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use kiln_gguf::{GgufWriter, Value};
use rayon::prelude::*;

use super::plan::TensorPlan;
use super::{QuantizeError, Result};

/// Where the values of the tensors being written come from.
pub trait TensorSource: Sync {
    /// The stored bytes of tensor `index` in its plan's source type, if it
    /// has any; they are copied verbatim when the output type is the same.
    fn stored_bytes(&self, index: usize) -> Option<&[u8]>;

    /// Writes row `row` of tensor `index` as f32 values into `out` (one row).
    fn row_f32(&self, index: usize, row: usize, out: &mut [f32]) -> Result<()>;

    /// `Some(p)` when row `r` of tensor `index` always equals row `r % p`: the writer then
    /// converts the first `p` rows only and repeats their bytes.
    fn row_period(&self, _index: usize) -> Option<usize> {
        None
    }
}

/// Progress notifications; every method has a do-nothing default.
pub trait Progress: Sync {
    /// Writing is about to start with these tensors.
    fn planned(&self, _plans: &[TensorPlan]) {}
    /// Tensor `index` (of `plans`) is about to be written.
    fn tensor_started(&self, _index: usize, _plan: &TensorPlan) {}
    /// `n_elements` more elements were written.
    fn advanced(&self, _n_elements: u64) {}
}

impl Progress for () {}

/// Totals of one written file.
#[derive(Clone, Debug, PartialEq)]
pub struct WriteSummary {
    pub n_tensors: usize,
    /// Tensors converted to another type (the others were copied).
    pub n_converted: usize,
    /// Tensors whose mix type did not fit their rows.
    pub n_fallback: usize,
    pub n_elements: u64,
    /// Tensor bytes in the source types.
    pub src_bytes: u64,
    /// Tensor bytes written.
    pub dst_bytes: u64,
    pub elapsed: Duration,
}

/// Elements converted per step: bounds memory (one chunk of output bytes)
/// while giving every thread many rows to work on.
const CHUNK_ELEMENTS: usize = 1 << 22;

fn bytes_of(ty: crate::GgmlType, n_elements: u64) -> u64 {
    ty.bytes_for(n_elements).unwrap_or(0)
}

/// Converts rows of tensor `index` chunk by chunk into `out`.
fn convert_tensor(plan: &TensorPlan, index: usize, source: &dyn TensorSource, out: &mut dyn Write, progress: &dyn Progress) -> Result<(), ConvertError> {
    let row_len = plan.row_len();
    let n_rows = (plan.n_elements() / row_len as u64) as usize;
    let row_bytes = bytes_of(plan.dst_type, row_len as u64) as usize;
    if let Some(period) = source.row_period(index).filter(|&p| p > 0 && p < n_rows) {
        let mut distinct = vec![0u8; period * row_bytes];
        convert_rows(plan, index, source, 0, &mut distinct)?;
        for first in (0..n_rows).step_by(period) {
            let n = period.min(n_rows - first);
            out.write_all(&distinct[..n * row_bytes]).map_err(ConvertError::Io)?;
            progress.advanced((n * row_len) as u64);
        }
        return Ok(());
    }
    let rows_per_chunk = (CHUNK_ELEMENTS / row_len).clamp(1, n_rows.max(1));
    let mut buf = vec![0u8; rows_per_chunk * row_bytes];
    for first in (0..n_rows).step_by(rows_per_chunk) {
        let n = rows_per_chunk.min(n_rows - first);
        let chunk = &mut buf[..n * row_bytes];
        convert_rows(plan, index, source, first, chunk)?;
        out.write_all(chunk).map_err(ConvertError::Io)?;
        progress.advanced((n * row_len) as u64);
    }
    Ok(())
}

/// Converts the rows from `first` on of tensor `index` that fit in `dst`, rows in parallel.
fn convert_rows(plan: &TensorPlan, index: usize, source: &dyn TensorSource, first: usize, dst: &mut [u8]) -> Result<(), ConvertError> {
    let row_len = plan.row_len();
    let row_bytes = bytes_of(plan.dst_type, row_len as u64) as usize;
    // Short rows are batched so each rayon task has enough work to be worth it.
    let min_rows_per_task = (4096 / row_len).max(1);
    dst.par_chunks_mut(row_bytes)
        .with_min_len(min_rows_per_task)
        .enumerate()
        .try_for_each_init(
            || vec![0f32; row_len],
            |scratch, (i, dst)| {
                source.row_f32(index, first + i, scratch)?;
                crate::quantize(plan.dst_type, scratch, dst).map_err(|source| QuantizeError::Quant { tensor: plan.name.clone(), source })
            },
        )
        .map_err(ConvertError::Quantize)
}

enum ConvertError {
    Io(io::Error),
    Quantize(QuantizeError),
}

fn copy_tensor(plan: &TensorPlan, bytes: &[u8], out: &mut dyn Write, progress: &dyn Progress) -> io::Result<()> {
    let (n_elements, total) = (plan.n_elements(), bytes.len().max(1) as u64);
    let (mut done_bytes, mut reported) = (0u64, 0u64);
    for part in bytes.chunks(CHUNK_ELEMENTS * 4) {
        out.write_all(part)?;
        // Elements in proportion to bytes, adding up to the exact total.
        done_bytes += part.len() as u64;
        let now = (n_elements as u128 * done_bytes as u128 / total as u128) as u64;
        progress.advanced(now - reported);
        reported = now;
    }
    Ok(())
}

/// Writes `metadata` and the tensors of `plans` (in that order) to `path`,
/// taking values from `source`. The file appears only once complete.
pub fn write_planned(
    path: &Path,
    metadata: Vec<(String, Value)>,
    plans: &[TensorPlan],
    source: &dyn TensorSource,
    progress: &dyn Progress,
) -> Result<WriteSummary> {
    let start = Instant::now();
    let mut writer = GgufWriter::new();
    for (key, value) in metadata {
        writer.add_kv(key, value);
    }
    for p in plans {
        writer.add_tensor(p.name.clone(), p.dims.clone(), p.dst_type)?;
    }
    progress.planned(plans);
    let mut failure = None;
    let written = writer.write_to_file(path, |index, out| {
        let plan = &plans[index];
        progress.tensor_started(index, plan);
        match source.stored_bytes(index) {
            Some(bytes) if plan.src_type == plan.dst_type => copy_tensor(plan, bytes, out, progress),
            _ => convert_tensor(plan, index, source, out, progress).map_err(|e| match e {
                ConvertError::Io(e) => e,
                ConvertError::Quantize(e) => {
                    failure = Some(e);
                    io::Error::other("conversion failed")
                }
            }),
        }
    });
    if let Err(source) = written {
        return Err(failure.unwrap_or_else(|| QuantizeError::Write { path: path.to_path_buf(), source }));
    }
    Ok(WriteSummary {
        n_tensors: plans.len(),
        n_converted: plans.iter().filter(|p| p.src_type != p.dst_type).count(),
        n_fallback: plans.iter().filter(|p| p.fallback).count(),
        n_elements: plans.iter().map(TensorPlan::n_elements).sum(),
        src_bytes: plans.iter().map(|p| bytes_of(p.src_type, p.n_elements())).sum(),
        dst_bytes: plans.iter().map(|p| bytes_of(p.dst_type, p.n_elements())).sum(),
        elapsed: start.elapsed(),
    })
}
