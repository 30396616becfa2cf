//! The tensor: a layout and dtype over a shared storage, plus its autograd state.
//!
//! A [`Tensor`] is a cheap handle (`Clone` shares it, like a Python reference). Its data is a
//! [`Buffer`] shared with every view of it; its autograd state (requires-grad flag, `.grad`,
//! the node that produced it, hooks) sits behind one lock. This module holds construction, host
//! transfers and the autograd accessors; ops live in `crate::ops` and differentiation in
//! `crate::engine`. It knows nothing about any particular backend.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::backend::{BackendRef, View};
use crate::buffer::Buffer;
use crate::dtype::{DType, Device};
use crate::error::{Result, TensorError};
use crate::graph::Node;
use crate::hooks::{GradHook, HookHandle, HookList, PostAccumulateHook};
use crate::layout::Layout;

/// A host element type that tensors can be built from and read into.
pub trait Element: bytemuck::Pod + Send + Sync {
    /// The matching dtype.
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for float8::F8E4M3 {
    const DTYPE: DType = DType::F8E4M3;
}
impl Element for float8::F8E5M2 {
    const DTYPE: DType = DType::F8E5M2;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}

/// An n-dimensional array on a device, with autograd.
#[derive(Clone)]
pub struct Tensor {
    pub(crate) inner: Arc<TensorImpl>,
}

pub(crate) struct TensorImpl {
    pub(crate) buffer: Arc<Buffer>,
    pub(crate) layout: Layout,
    pub(crate) dtype: DType,
    /// Whether this tensor shares its storage with another tensor (a view).
    pub(crate) is_view: bool,
    pub(crate) meta: Mutex<AutogradMeta>,
}

#[derive(Default)]
pub(crate) struct AutogradMeta {
    /// Set on leaves by `requires_grad_`; a non-leaf requires grad through its `grad_fn`.
    pub(crate) requires_grad: bool,
    pub(crate) grad_fn: Option<Arc<Node>>,
    pub(crate) output_nr: usize,
    pub(crate) grad: Option<Tensor>,
    /// Gradient hooks of a leaf (a non-leaf keeps them on its node).
    pub(crate) grad_hooks: Arc<HookList<GradHook>>,
    pub(crate) post_accumulate_hooks: Arc<HookList<PostAccumulateHook>>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let meta = self.inner.meta.lock();
        f.debug_struct("Tensor")
            .field("shape", &self.shape())
            .field("strides", &self.strides())
            .field("offset", &self.inner.layout.offset())
            .field("dtype", &self.dtype())
            .field("device", &self.device())
            .field(
                "requires_grad",
                &(meta.requires_grad || meta.grad_fn.is_some()),
            )
            .field("grad_fn", &meta.grad_fn.as_ref().map(|node| node.name()))
            .finish()
    }
}

impl Tensor {
    pub(crate) fn from_parts(
        buffer: Arc<Buffer>,
        layout: Layout,
        dtype: DType,
        is_view: bool,
    ) -> Tensor {
        debug_assert!(layout.storage_extent() * dtype.size_in_bytes() <= buffer.len_bytes());
        Tensor {
            inner: Arc::new(TensorImpl {
                buffer,
                layout,
                dtype,
                is_view,
                meta: Mutex::new(AutogradMeta::default()),
            }),
        }
    }

    /// A new contiguous tensor with unspecified contents. A shape whose element or byte count
    /// overflows is a [`TensorError::SizeOverflow`].
    pub fn empty(backend: &BackendRef, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let layout = Layout::try_contiguous(shape)?;
        let bytes = layout
            .numel()
            .checked_mul(dtype.size_in_bytes())
            .ok_or_else(|| TensorError::SizeOverflow {
                op: "empty",
                reason: format!("{shape:?} elements of {dtype:?} are more bytes than usize holds"),
            })?;
        let buffer = Buffer::new(backend, bytes)?;
        Ok(Tensor::from_parts(Arc::new(buffer), layout, dtype, false))
    }

    /// A new tensor filled with `value`.
    pub fn full(backend: &BackendRef, shape: &[usize], value: f64, dtype: DType) -> Result<Tensor> {
        let res = Tensor::empty(backend, shape, dtype)?;
        backend.fill(res.view(), value)?;
        Ok(res)
    }

    /// A new tensor of zeros.
    pub fn zeros(backend: &BackendRef, shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::full(backend, shape, 0.0, dtype)
    }

    /// A new tensor of ones.
    pub fn ones(backend: &BackendRef, shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::full(backend, shape, 1.0, dtype)
    }

    /// A 0-dim tensor.
    pub fn scalar(backend: &BackendRef, value: f64, dtype: DType) -> Result<Tensor> {
        Tensor::full(backend, &[], value, dtype)
    }

    /// A tensor with the elements of `data` (row-major) and the element type `T`.
    pub fn from_slice<T: Element>(
        backend: &BackendRef,
        data: &[T],
        shape: &[usize],
    ) -> Result<Tensor> {
        let numel = crate::layout::checked_numel("from_slice", shape)?;
        if numel != data.len() {
            return Err(TensorError::InvalidArgument {
                op: "from_slice",
                reason: format!("{} elements do not fill shape {shape:?}", data.len()),
            });
        }
        let res = Tensor::empty(backend, shape, T::DTYPE)?;
        backend.write_host(&res.inner.buffer, 0, bytemuck::cast_slice(data))?;
        Ok(res)
    }

    /// A tensor of dtype `dtype` from f64 values (converted on the host).
    pub fn from_f64s(
        backend: &BackendRef,
        data: &[f64],
        shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        match dtype {
            DType::F64 => Tensor::from_slice(backend, data, shape),
            DType::F32 => Tensor::from_slice(
                backend,
                &data.iter().map(|&v| v as f32).collect::<Vec<_>>(),
                shape,
            ),
            DType::F16 => Tensor::from_slice(
                backend,
                &data
                    .iter()
                    .map(|&v| half::f16::from_f64(v))
                    .collect::<Vec<_>>(),
                shape,
            ),
            DType::BF16 => Tensor::from_slice(
                backend,
                &data
                    .iter()
                    .map(|&v| half::bf16::from_f64(v))
                    .collect::<Vec<_>>(),
                shape,
            ),
            DType::I64 => Tensor::from_slice(
                backend,
                &data.iter().map(|&v| v as i64).collect::<Vec<_>>(),
                shape,
            ),
            DType::I32 => Tensor::from_slice(
                backend,
                &data.iter().map(|&v| v as i32).collect::<Vec<_>>(),
                shape,
            ),
            DType::U8 => Tensor::from_slice(
                backend,
                &data.iter().map(|&v| v as u8).collect::<Vec<_>>(),
                shape,
            ),
            DType::F8E4M3 => Tensor::from_slice(
                backend,
                &data
                    .iter()
                    .map(|&v| float8::F8E4M3::from_f64(v))
                    .collect::<Vec<_>>(),
                shape,
            ),
            DType::F8E5M2 => Tensor::from_slice(
                backend,
                &data
                    .iter()
                    .map(|&v| float8::F8E5M2::from_f64(v))
                    .collect::<Vec<_>>(),
                shape,
            ),
            DType::Bool => {
                let res = Tensor::from_slice(
                    backend,
                    &data.iter().map(|&v| u8::from(v != 0.0)).collect::<Vec<_>>(),
                    shape,
                )?;
                Ok(Tensor::from_parts(
                    Arc::clone(&res.inner.buffer),
                    res.inner.layout.clone(),
                    DType::Bool,
                    false,
                ))
            }
        }
    }

    /// The elements in row-major order, converted to `T`'s dtype if needed.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let dense = self.to_dtype_contiguous(T::DTYPE)?;
        let mut res = vec![T::zeroed(); dense.numel()];
        let byte_offset = dense.inner.layout.offset() * T::DTYPE.size_in_bytes();
        dense.backend().read_host(
            &dense.inner.buffer,
            byte_offset,
            bytemuck::cast_slice_mut(&mut res),
        )?;
        Ok(res)
    }

    /// The elements in row-major order, converted to f64.
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        match self.dtype() {
            DType::F64 => self.to_vec::<f64>(),
            DType::F32 => Ok(self.to_vec::<f32>()?.into_iter().map(f64::from).collect()),
            DType::F16 => Ok(self
                .to_vec::<half::f16>()?
                .into_iter()
                .map(f64::from)
                .collect()),
            DType::BF16 => Ok(self
                .to_vec::<half::bf16>()?
                .into_iter()
                .map(f64::from)
                .collect()),
            DType::I64 => Ok(self
                .to_vec::<i64>()?
                .into_iter()
                .map(|v| v as f64)
                .collect()),
            DType::I32 => Ok(self.to_vec::<i32>()?.into_iter().map(f64::from).collect()),
            DType::U8 => Ok(self.to_vec::<u8>()?.into_iter().map(f64::from).collect()),
            DType::F8E4M3 => Ok(self
                .to_vec::<float8::F8E4M3>()?
                .into_iter()
                .map(|v| v.to_f64())
                .collect()),
            DType::F8E5M2 => Ok(self
                .to_vec::<float8::F8E5M2>()?
                .into_iter()
                .map(|v| v.to_f64())
                .collect()),
            DType::Bool => {
                let as_bytes = Tensor::from_parts(
                    Arc::clone(&self.inner.buffer),
                    self.inner.layout.clone(),
                    DType::U8,
                    true,
                );
                as_bytes.to_vec_f64()
            }
        }
    }

    /// The value of a one-element tensor.
    pub fn item(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(TensorError::InvalidArgument {
                op: "item",
                reason: format!("a tensor of shape {:?} is not one element", self.shape()),
            });
        }
        Ok(self.to_vec_f64()?[0])
    }

    /// Dimension sizes.
    pub fn shape(&self) -> &[usize] {
        self.inner.layout.shape()
    }

    /// Strides in elements.
    pub fn strides(&self) -> &[usize] {
        self.inner.layout.strides()
    }

    /// The full layout (shape, strides, offset).
    pub fn layout(&self) -> &Layout {
        &self.inner.layout
    }

    /// Number of dims.
    pub fn ndim(&self) -> usize {
        self.inner.layout.ndim()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.inner.layout.numel()
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.inner.dtype
    }

    /// Where the storage lives.
    pub fn device(&self) -> Device {
        self.inner.buffer.device()
    }

    /// The backend that owns the storage.
    pub fn backend(&self) -> &BackendRef {
        self.inner.buffer.backend()
    }

    /// The shared storage.
    pub fn buffer(&self) -> &Arc<Buffer> {
        &self.inner.buffer
    }

    /// Whether the elements are row-major with no gaps.
    pub fn is_contiguous(&self) -> bool {
        self.inner.layout.is_contiguous()
    }

    /// Whether this tensor shares storage with the tensor it was made from.
    pub fn is_view(&self) -> bool {
        self.inner.is_view
    }

    /// The storage's in-place write count.
    pub fn version(&self) -> u64 {
        self.inner.buffer.version()
    }

    /// The elements as a backend sees them.
    pub fn view(&self) -> View<'_> {
        View {
            buffer: &self.inner.buffer,
            layout: &self.inner.layout,
            dtype: self.inner.dtype,
        }
    }

    /// Whether two handles are the same tensor.
    pub fn same_tensor(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    // ---- autograd state ----

    /// Whether gradients flow to or through this tensor.
    pub fn requires_grad(&self) -> bool {
        let meta = self.inner.meta.lock();
        meta.requires_grad || meta.grad_fn.is_some()
    }

    /// Whether this tensor was not produced by a recorded op.
    pub fn is_leaf(&self) -> bool {
        self.inner.meta.lock().grad_fn.is_none()
    }

    /// Marks a leaf as a parameter whose gradient is accumulated into `.grad` (or unmarks it).
    pub fn requires_grad_(&self, requires_grad: bool) -> Result<&Tensor> {
        let mut meta = self.inner.meta.lock();
        if meta.grad_fn.is_some() {
            return Err(TensorError::Autograd {
                op: "requires_grad_",
                reason: "only leaves can change requires_grad; use detach() on a non-leaf".into(),
            });
        }
        if requires_grad && !self.inner.dtype.is_float() {
            return Err(TensorError::UnsupportedDtype {
                op: "requires_grad_",
                dtype: self.inner.dtype,
            });
        }
        meta.requires_grad = requires_grad;
        Ok(self)
    }

    /// The name of the op that produced this tensor, if it was recorded.
    pub fn grad_fn_name(&self) -> Option<&'static str> {
        self.inner
            .meta
            .lock()
            .grad_fn
            .as_ref()
            .map(|node| node.name())
    }

    /// The accumulated gradient of a leaf.
    pub fn grad(&self) -> Option<Tensor> {
        self.inner.meta.lock().grad.clone()
    }

    /// Replaces `.grad` (shape and dtype must match when set).
    pub fn set_grad(&self, grad: Option<Tensor>) -> Result<()> {
        if let Some(grad) = &grad {
            if grad.shape() != self.shape() {
                return Err(TensorError::ShapeMismatch {
                    op: "set_grad",
                    lhs: self.shape().to_vec(),
                    rhs: grad.shape().to_vec(),
                });
            }
            if grad.dtype() != self.dtype() {
                return Err(TensorError::DtypeMismatch {
                    op: "set_grad",
                    lhs: self.dtype(),
                    rhs: grad.dtype(),
                });
            }
        }
        self.inner.meta.lock().grad = grad;
        Ok(())
    }

    /// Takes `.grad`, leaving it empty (what an optimizer-in-backward hook does).
    pub fn take_grad(&self) -> Option<Tensor> {
        self.inner.meta.lock().grad.take()
    }

    /// Clears `.grad`: drops it when `set_to_none`, zeroes it in place otherwise.
    pub fn zero_grad(&self, set_to_none: bool) -> Result<()> {
        if set_to_none {
            self.inner.meta.lock().grad = None;
            return Ok(());
        }
        let grad = self.grad();
        if let Some(grad) = grad {
            grad.backend().fill(grad.view(), 0.0)?;
            grad.inner.buffer.bump_version();
        }
        Ok(())
    }

    /// The same data with no autograd history (shares storage and version counter).
    pub fn detach(&self) -> Tensor {
        Tensor::from_parts(
            Arc::clone(&self.inner.buffer),
            self.inner.layout.clone(),
            self.inner.dtype,
            self.inner.is_view,
        )
    }

    /// Registers a hook called with this tensor's gradient during backward, before it is used
    /// (non-leaf) or accumulated (leaf); returning `Some` replaces the gradient.
    pub fn register_hook(
        &self,
        hook: impl Fn(&Tensor) -> Result<Option<Tensor>> + Send + Sync + 'static,
    ) -> Result<HookHandle> {
        let meta = self.inner.meta.lock();
        let hook: GradHook = Arc::new(hook);
        if let Some(node) = &meta.grad_fn {
            return Ok(node.register_pre_hook(meta.output_nr, hook));
        }
        if !meta.requires_grad {
            return Err(TensorError::Autograd {
                op: "register_hook",
                reason: "cannot register a hook on a tensor that does not require grad".into(),
            });
        }
        Ok(HookList::push(&meta.grad_hooks, hook))
    }

    /// Registers a hook on a leaf that runs once `.grad` is final for a backward pass (after
    /// accumulation). It may take the gradient and leave `.grad` empty.
    pub fn register_post_accumulate_grad_hook(
        &self,
        hook: impl Fn(&Tensor) -> Result<()> + Send + Sync + 'static,
    ) -> Result<HookHandle> {
        let meta = self.inner.meta.lock();
        if meta.grad_fn.is_some() || !meta.requires_grad {
            return Err(TensorError::Autograd {
                op: "register_post_accumulate_grad_hook",
                reason:
                    "post-accumulate-grad hooks can only be registered on leaves that require grad"
                        .into(),
            });
        }
        Ok(HookList::push(&meta.post_accumulate_hooks, Arc::new(hook)))
    }

    /// Whether nothing but this handle holds the tensor or its storage, and it is dense: then
    /// its memory may be overwritten (the engine accumulates into such a gradient, and backward
    /// functions write their result over such an incoming gradient).
    pub(crate) fn is_exclusive_dense(&self) -> bool {
        Arc::strong_count(&self.inner) == 1
            && Arc::strong_count(&self.inner.buffer) == 1
            && self.is_contiguous()
            && self.numel() * self.dtype().size_in_bytes() == self.buffer().len_bytes()
    }

    pub(crate) fn grad_fn(&self) -> Option<(Arc<Node>, usize)> {
        let meta = self.inner.meta.lock();
        meta.grad_fn
            .as_ref()
            .map(|node| (Arc::clone(node), meta.output_nr))
    }

    pub(crate) fn set_grad_fn(&self, node: Arc<Node>, output_nr: usize) {
        let mut meta = self.inner.meta.lock();
        meta.grad_fn = Some(node);
        meta.output_nr = output_nr;
    }

    /// This tensor as dtype `dtype`, contiguous, without recording (a no-op when it already is).
    pub(crate) fn to_dtype_contiguous(&self, dtype: DType) -> Result<Tensor> {
        if self.dtype() == dtype && self.is_contiguous() {
            return Ok(self.clone());
        }
        let res = Tensor::empty(self.backend(), self.shape(), dtype)?;
        self.backend().copy(self.view(), res.view())?;
        Ok(res)
    }
}
