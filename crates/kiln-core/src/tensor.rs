//! Typed views of backend buffers: a buffer, the shape its first values are read as, and (from
//! the buffer type) their element type. Ops take views instead of a buffer plus loose counts, so
//! every count an op uses comes from a shape checked against the buffer when the view is made
//! and against the op's other operands by [`expect_shape`].
//!
//! A view covers the first `numel` values of its buffer: workspaces are allocated once for the
//! largest step, and a step of `n` tokens views their first `n` rows.

use std::fmt;

use crate::backend::{BackendError, Result};

/// The element type of a buffer's values.
///
/// Only `F32` exists: every activation buffer of every backend holds f32 (weights carry their
/// GGML type, KV caches their `KvType`). The element type belongs to the buffer type
/// ([`DeviceBuffer::DTYPE`]), so a mismatch is a compile error rather than a check each op
/// repeats; an f16 or bf16 activation buffer would be a new buffer type with its own `DTYPE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
        })
    }
}

/// A buffer a backend's ops read and write: its length in elements and their type.
pub trait DeviceBuffer: Send + Sync + Sized {
    const DTYPE: DType;

    /// Elements the buffer holds.
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first values of the buffer read as `shape`.
    fn view(&self, shape: impl Into<Shape>) -> Result<Tensor<'_, Self>> {
        Tensor::new(self, shape)
    }

    fn view_mut(&mut self, shape: impl Into<Shape>) -> Result<TensorMut<'_, Self>> {
        TensorMut::new(self, shape)
    }

    /// The first `n` rows of `width` values.
    fn rows(&self, n: usize, width: usize) -> Result<Tensor<'_, Self>> {
        self.view([n, width])
    }

    fn rows_mut(&mut self, n: usize, width: usize) -> Result<TensorMut<'_, Self>> {
        self.view_mut([n, width])
    }

    /// The whole buffer as one vector (a norm weight, a bias, a table).
    fn whole(&self) -> Tensor<'_, Self> {
        Tensor { buf: self, shape: Shape::from([self.len()]) }
    }
}

impl DeviceBuffer for Vec<f32> {
    const DTYPE: DType = DType::F32;

    fn len(&self) -> usize {
        Vec::len(self)
    }
}

#[cfg(feature = "cuda")]
impl DeviceBuffer for cudarc::driver::CudaSlice<f32> {
    const DTYPE: DType = DType::F32;

    fn len(&self) -> usize {
        cudarc::driver::CudaSlice::len(self)
    }
}

/// Up to three dimensions, outermost first.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    dims: [usize; 3],
    rank: usize,
}

impl Shape {
    pub fn dims(&self) -> &[usize] {
        &self.dims[..self.rank]
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn numel(&self) -> usize {
        self.dims().iter().product()
    }

    /// The innermost dimension: the length of one row.
    pub fn cols(&self) -> usize {
        self.dims[self.rank - 1]
    }

    /// Rows of [`Shape::cols`] values: the product of the outer dimensions.
    pub fn rows(&self) -> usize {
        self.dims[..self.rank - 1].iter().product()
    }

    /// The dimensions of a rank-2 shape, else an error naming `op` and `tensor`.
    pub fn dims2(&self, op: &str, tensor: &str) -> Result<[usize; 2]> {
        match *self.dims() {
            [a, b] => Ok([a, b]),
            _ => Err(mismatch(op, tensor, *self, "a rank-2 shape".into())),
        }
    }

    /// The dimensions of a rank-3 shape, else an error naming `op` and `tensor`.
    pub fn dims3(&self, op: &str, tensor: &str) -> Result<[usize; 3]> {
        match *self.dims() {
            [a, b, c] => Ok([a, b, c]),
            _ => Err(mismatch(op, tensor, *self, "a rank-3 shape".into())),
        }
    }
}

impl From<[usize; 1]> for Shape {
    fn from(d: [usize; 1]) -> Shape {
        Shape { dims: [d[0], 0, 0], rank: 1 }
    }
}

impl From<[usize; 2]> for Shape {
    fn from(d: [usize; 2]) -> Shape {
        Shape { dims: [d[0], d[1], 0], rank: 2 }
    }
}

impl From<[usize; 3]> for Shape {
    fn from(d: [usize; 3]) -> Shape {
        Shape { dims: d, rank: 3 }
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.dims())
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

fn mismatch(op: &str, tensor: &str, found: Shape, expected: String) -> BackendError {
    BackendError::ShapeMismatch { op: op.into(), tensor: tensor.into(), expected, found }
}

/// The one shape check of every op: `found` (tensor `tensor` of op `op`) must equal `expected`.
pub fn expect_shape(op: &str, tensor: &str, found: Shape, expected: impl Into<Shape>) -> Result<()> {
    let expected = expected.into();
    if found != expected {
        return Err(mismatch(op, tensor, found, expected.to_string()));
    }
    Ok(())
}

fn check_fits(shape: Shape, len: usize) -> Result<()> {
    if shape.rank == 0 || shape.numel() > len {
        return Err(BackendError::ViewTooLarge { shape, need: shape.numel(), len });
    }
    Ok(())
}

/// A read-only view: the first `shape.numel()` values of a buffer.
pub struct Tensor<'a, T> {
    buf: &'a T,
    shape: Shape,
}

impl<T> Clone for Tensor<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Tensor<'_, T> {}

/// The shape accessors both view types share.
macro_rules! view_accessors {
    () => {
        pub fn shape(&self) -> Shape {
            self.shape
        }

        pub fn dtype(&self) -> DType {
            T::DTYPE
        }

        pub fn numel(&self) -> usize {
            self.shape.numel()
        }

        pub fn rows(&self) -> usize {
            self.shape.rows()
        }

        pub fn cols(&self) -> usize {
            self.shape.cols()
        }
    };
}

impl<'a, T: DeviceBuffer> Tensor<'a, T> {
    /// A view of `shape` over the start of `buf`; an error when `buf` is shorter.
    pub fn new(buf: &'a T, shape: impl Into<Shape>) -> Result<Self> {
        let shape = shape.into();
        check_fits(shape, buf.len())?;
        Ok(Tensor { buf, shape })
    }

    pub fn buf(&self) -> &'a T {
        self.buf
    }

    view_accessors!();

    /// The same values as another shape of as many elements.
    pub fn reshape(self, shape: impl Into<Shape>) -> Result<Self> {
        let shape = shape.into();
        if shape.numel() != self.numel() {
            return Err(mismatch("reshape", "view", self.shape, format!("{} values as {shape}", self.numel())));
        }
        Ok(Tensor { shape, ..self })
    }
}

impl<'a> Tensor<'a, Vec<f32>> {
    /// The viewed values.
    pub fn data(&self) -> &'a [f32] {
        &self.buf[..self.shape.numel()]
    }
}

/// A writable view: the first `shape.numel()` values of a buffer.
pub struct TensorMut<'a, T> {
    buf: &'a mut T,
    shape: Shape,
}

impl<'a, T: DeviceBuffer> TensorMut<'a, T> {
    /// A view of `shape` over the start of `buf`; an error when `buf` is shorter.
    pub fn new(buf: &'a mut T, shape: impl Into<Shape>) -> Result<Self> {
        let shape = shape.into();
        check_fits(shape, buf.len())?;
        Ok(TensorMut { buf, shape })
    }

    pub fn buf(&self) -> &T {
        self.buf
    }

    pub fn buf_mut(&mut self) -> &mut T {
        self.buf
    }

    view_accessors!();

    /// A read-only view of the same values.
    pub fn as_ref(&self) -> Tensor<'_, T> {
        Tensor { buf: self.buf, shape: self.shape }
    }

    /// This view, borrowed again for one op.
    pub fn reborrow(&mut self) -> TensorMut<'_, T> {
        TensorMut { buf: self.buf, shape: self.shape }
    }

    /// The same values as another shape of as many elements.
    pub fn reshape(self, shape: impl Into<Shape>) -> Result<Self> {
        let shape = shape.into();
        if shape.numel() != self.numel() {
            return Err(mismatch("reshape", "view", self.shape, format!("{} values as {shape}", self.numel())));
        }
        Ok(TensorMut { shape, ..self })
    }
}

impl TensorMut<'_, Vec<f32>> {
    /// The viewed values.
    pub fn data(&self) -> &[f32] {
        &self.buf[..self.shape.numel()]
    }

    pub fn data_mut(&mut self) -> &mut [f32] {
        let n = self.shape.numel();
        &mut self.buf[..n]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_are_checked_against_the_buffer_and_each_other() {
        let buf = vec![0f32; 12];
        let t = buf.view([3, 4]).unwrap();
        assert_eq!((t.rows(), t.cols(), t.numel(), t.dtype()), (3, 4, 12, DType::F32));
        assert_eq!(buf.view([2, 3, 2]).unwrap().rows(), 6);
        let err = buf.view([4, 4]).err().unwrap().to_string();
        assert!(err.contains("[4, 4]") && err.contains("16") && err.contains("12"), "{err}");
        let err = expect_shape("rms_norm", "out", t.shape(), [3, 5]).unwrap_err().to_string();
        assert!(err.contains("rms_norm") && err.contains("out") && err.contains("[3, 4]") && err.contains("[3, 5]"), "{err}");
        assert!(t.reshape([2, 6]).is_ok() && t.reshape([2, 5]).is_err());
        assert!(t.shape().dims3("rope", "x").is_err());
    }

    #[test]
    fn ops_refuse_views_that_disagree_with_a_typed_error() {
        use crate::backend::{Backend, BackendError, RouterParams};
        let b = crate::CpuBackend::exact();
        let (x, weight, mut out) = (vec![1f32; 12], vec![1f32; 4], vec![0f32; 12]);
        let err = b.rms_norm(x.rows(3, 4).unwrap(), weight.whole(), out.rows_mut(4, 3).unwrap(), 1e-5).unwrap_err();
        assert!(matches!(&err, BackendError::ShapeMismatch { op, tensor, .. } if op == "rms_norm" && tensor == "out"), "{err}");
        assert!(err.to_string().contains("[4, 3]") && err.to_string().contains("[3, 4]"), "{err}");
        let err = b.rms_norm(x.rows(3, 4).unwrap(), weight.view([3]).unwrap(), out.rows_mut(3, 4).unwrap(), 1e-5).unwrap_err();
        assert!(matches!(&err, BackendError::ShapeMismatch { tensor, .. } if tensor == "weight"), "{err}");
        // Router: ids and weights must agree on the experts chosen per token.
        let (mut ids, mut w) = (vec![0f32; 6], vec![0f32; 6]);
        let err = b
            .moe_route(
                x.rows(3, 4).unwrap(),
                None,
                ids.rows_mut(3, 2).unwrap(),
                w.rows_mut(2, 3).unwrap(),
                &RouterParams { renormalize: true, shared_expert: false },
            )
            .unwrap_err();
        assert!(matches!(&err, BackendError::ShapeMismatch { op, tensor, .. } if op == "moe_route" && tensor == "weights"), "{err}");
        assert!(matches!(out.view([4, 4]), Err(BackendError::ViewTooLarge { need: 16, len: 12, .. })));
    }
}
